"""Ctrl-C that is never lost inside the muxer.

PyAV calls our file writer (`publish/file.py FragmentFile.write`) from inside FFmpeg. A
KeyboardInterrupt raised there, by Python's default SIGINT handler, is swallowed by PyAV's
callback machinery: the run goes on to the end as if nothing happened (seen under load: a
SIGINT mid-run, exit 0, the whole file written). `install()` replaces the default handler by one
that, while the main thread is inside a muxer call (`muxing()`), only records the interrupt; the
KeyboardInterrupt is raised when the call returns, in Python code, where the chunk loop and the
sinks handle it. Outside muxer calls it raises at once, as the default handler does.

Only the main thread receives signals; a sink written from the decode thread needs nothing here.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_depth = 0  # the main thread's nesting of muxer calls
_pending = False


def _handler(signum: int, frame: Any) -> None:
    global _pending
    if _depth:
        _pending = True
        return
    raise KeyboardInterrupt


def install() -> None:
    """Use the deferring handler where SIGINT has Python's default one (never over a handler
    someone else set, nor where SIGINT is ignored, as in a shell's background job)."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _handler)


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
    if not _depth and _pending:
        _pending = False
        raise KeyboardInterrupt
