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
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    interrupt.install()
    yield
    signal.signal(signal.SIGINT, previous)
    signal.signal(signal.SIGTERM, previous_term)


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


def test_sigterm_is_an_interrupt_that_says_so(deferring):
    """SIGTERM used to end the process where it stood (no cleanup: lock files stayed)."""
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    with pytest.raises(KeyboardInterrupt, match=r"terminated \(SIGTERM\)"):
        with interrupt.muxing():
            os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match=r"terminated \(SIGTERM\)"):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.1)


def test_signals_inside_held_are_recorded_never_raised(deferring):
    with interrupt.held() as got:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        with interrupt.muxing():  # a muxer call inside does not raise them either
            os.kill(os.getpid(), signal.SIGINT)
        signal.sigtimedwait([], 0.05)
    assert got == [signal.SIGINT, signal.SIGTERM, signal.SIGINT]
    assert interrupt.names(got) == "SIGINT and SIGTERM"
    with pytest.raises(KeyboardInterrupt):  # after the block: as before
        os.kill(os.getpid(), signal.SIGINT)
        signal.sigtimedwait([], 0.1)


def test_an_interrupt_inside_pyav_code_comes_again_a_bit_later(deferring):
    """PyAV's Cython code swallowed a KeyboardInterrupt raised in it (`av.error.err_check`, while
    decoding the input audio): `generate` then ran to the end, exit 0, about one time in two."""
    import time
    from types import SimpleNamespace

    inside_pyav = SimpleNamespace(f_code=SimpleNamespace(co_filename="av/error.py"), f_back=None)
    interrupt._handler(signal.SIGINT, inside_pyav)  # not raised there
    with pytest.raises(KeyboardInterrupt, match="interrupted"):
        time.sleep(5)  # sent again RETRY_S later, into our own code
