"""Ctrl-C inside a muxer call is raised after it (publish/interrupt.py): PyAV swallows exceptions
raised in our write callback, so a KeyboardInterrupt there was lost and the run went on to the end."""

from __future__ import annotations

import os
import signal

import pytest

from avatarstream.publish import interrupt


@pytest.fixture
def deferring():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt.install()
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_inside_the_muxer_is_raised_when_it_returns(deferring):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupt.muxing():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the muxer call finished")  # not cut short inside FFmpeg's callback
    assert done == ["the muxer call finished"]


def test_an_interrupt_outside_the_muxer_is_raised_at_once(deferring):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        signal.sigtimedwait([], 0.1) if hasattr(signal, "sigtimedwait") else None
    with interrupt.muxing():
        pass  # nothing pending afterwards


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        interrupt.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
