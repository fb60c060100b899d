"""Ctrl-C and SIGTERM that are never lost inside the muxer, and never cut content signing short.

PyAV calls our file writer (`publish/file.py FragmentFile.write`) from inside FFmpeg. A
KeyboardInterrupt raised there, by Python's default SIGINT handler, is swallowed by PyAV's
callback machinery: the run goes on to the end as if nothing happened (seen under load: a
SIGINT mid-run, exit 0, the whole file written). `install()` replaces the default handler by one
that, while the main thread is inside a muxer call (`muxing()`), only records the interrupt; the
KeyboardInterrupt is raised when the call returns, in Python code, where the chunk loop and the
sinks handle it. Outside muxer calls it raises at once, as the default handler does.

PyAV's Cython code also swallows a KeyboardInterrupt raised while the main thread runs it (seen
in `av.error.err_check` while the input audio is decoded and resampled: the run went on to the
end, exit 0, about one time in two). A signal that arrives there is sent again to the main
thread `RETRY_S` later, until it lands in our own code.

SIGTERM (`kill`, a service manager, a timeout) is handled the same way: a KeyboardInterrupt
("terminated"), so a terminated run ends its outputs as an interrupted one does (what was written
is kept and named, the lock files are removed) instead of dying where it stands.

Content signing (c2pa) reads the file through Python callbacks too, and an exception raised in one
of them is not seen by c2pa as an interruption: it must not happen. Inside `held()` (signing and
the rename that follows it) SIGINT and SIGTERM are only recorded; the caller learns which came
and the signing always finishes (about 1 s per 50 MB). Only SIGKILL stops it; what SIGKILL leaves
(a `….signing-<pid>.mp4` copy) is removed by the next run of the same output
(publish/output.py).

Only the main thread receives signals; a sink written from another thread needs nothing here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

_depth = 0  # the main thread's nesting of muxer calls
_pending: int | None = None  # a signal that came inside a muxer call
_holding: list[list[int]] = []  # the signals recorded by each open held() block
RETRY_S = 0.05  # a signal that came inside PyAV's code is sent again this much later


def _message(signum: int) -> str:
    return "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"


def _handler(signum: int, frame: Any) -> None:
    global _pending
    if _holding:
        _holding[-1].append(signum)
        return
    if _depth:
        _pending = _pending or signum
        return
    if _in_pyav(frame):  # PyAV's own code would swallow it (as in audio decoding): a bit later
        threading.Timer(RETRY_S, signal.pthread_kill, (threading.main_thread().ident, signum)).start()
        return
    raise KeyboardInterrupt(_message(signum))


def _in_pyav(frame: Any) -> bool:
    """Whether the main thread was stopped inside PyAV's (Cython) code, which does not pass a
    KeyboardInterrupt raised there on (seen: `av.error.err_check` while resampling audio)."""
    for _ in range(2):
        if frame is None:
            return False
        name = frame.f_code.co_filename.replace("\\", "/")
        if name.startswith("av/") or "/site-packages/av/" in name:
            return True
        frame = frame.f_back
    return False


def install() -> None:
    """Use the deferring handler for SIGINT where it has Python's default handler and for SIGTERM
    where it has the system's default, except in a launched rank (never over a handler someone
    else set, nor where a signal is ignored, as SIGINT is in a shell's background job)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _handler)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and not _a_launched_rank():
        signal.signal(signal.SIGTERM, _handler)


def _a_launched_rank() -> bool:
    """A rank of a torchrun (`env://`) job: its launcher's SIGTERM must stop it even inside a
    collective, where a Python handler would wait (parallel/run.py handles it where it can)."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def installed() -> bool:
    return signal.getsignal(signal.SIGINT) is _handler or signal.getsignal(signal.SIGTERM) is _handler


@contextlib.contextmanager
def muxing() -> Iterator[None]:
    """Around a call into the muxer: an interrupt that arrives inside is raised after it."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    if not _depth and _pending is not None and not _holding:
        signum, _pending = _pending, None
        raise KeyboardInterrupt(_message(signum))


@contextlib.contextmanager
def held() -> Iterator[list[int]]:
    """Around a step that must finish (signing, renaming): SIGINT and SIGTERM are recorded in the
    list yielded, never raised (in the main thread). Where one has its default action (SIGTERM in
    a torchrun rank, which `install()` leaves alone) the recording handler takes it for the block."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    _holding.append(got)
    taken = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)
             if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler)}
    try:
        yield got
    finally:
        for s, previous in taken.items():
            signal.signal(s, previous)
        _holding.remove(got)


def names(signals: list[int]) -> str:
    """`[2, 15]` -> "SIGINT and SIGTERM"."""
    return " and ".join(dict.fromkeys(signal.Signals(s).name for s in signals))
