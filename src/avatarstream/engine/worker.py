"""BackgroundWorker: a thread that runs submitted calls in order, behind a bounded queue.

The one "bounded queue + thread + errors handed back" of the engine: the publisher (sinks encode
while the next chunk is made) and the executor's decode thread (the VAE decode of chunk k while
chunk k+1 is denoised) are both this. `submit` blocks while `max_queued` calls already wait
(back-pressure: memory stays bounded, the producer slows to the consumer). A call that raises does
not stop the thread: its error is kept with the call's `tag` (`failures()`, `raise_if_failed()`),
and later calls still run, so a failure of one session's decode never stalls the others'.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_STOP = object()


class BackgroundWorker:
    def __init__(self, name: str, *, max_queued: int = 1, skip_after_error: bool = False) -> None:
        """skip_after_error: once a call failed, drop the calls that follow (a single stream,
        whose later output means nothing after a gap) instead of running them."""
        self._q: queue.Queue = queue.Queue(maxsize=max_queued)
        self._failed: list[tuple[BaseException, Any]] = []
        self._lock = threading.Lock()
        self.skip_after_error = skip_after_error
        self.seconds, self.calls = 0.0, 0  # time inside the calls, calls that ran
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is _STOP:
                    return
                fn, tag = item
                if self.skip_after_error and self._failed:
                    continue  # keep draining so the producer never blocks
                t0 = time.perf_counter()
                try:
                    with torch.inference_mode():
                        fn()
                except BaseException as e:  # noqa: BLE001 - handed back to the producer
                    log.debug("background call failed", exc_info=True)
                    with self._lock:
                        self._failed.append((e, tag))
                self.seconds += time.perf_counter() - t0
                self.calls += 1
            finally:
                self._q.task_done()

    def submit(self, fn: Callable[[], None], tag: Any = None) -> None:
        self._q.put((fn, tag))

    def wait(self) -> None:
        """Until every submitted call has run."""
        self._q.join()

    def failures(self) -> list[tuple[BaseException, Any]]:
        """(error, tag) of the calls that failed since the last call of this method."""
        with self._lock:
            out, self._failed = self._failed, []
        return out

    def raise_if_failed(self) -> None:
        with self._lock:
            if self._failed:
                raise self._failed[0][0]

    def close(self, timeout: float | None = None) -> None:
        """Run what was submitted, then stop the thread."""
        self._q.put(_STOP)
        self._thread.join(timeout)


class SplitWorker:
    """Two `BackgroundWorker`s in a row: the executor's decode thread when a chunk's decode runs in
    two parts (`submit_split`: the VAE's low-resolution part on the first thread, the rest and the
    publication on the second), so chunk k finishes on one core while chunk k+1 starts on the
    other. A whole call (`submit`) runs on the first thread once the second is idle.
    The same interface as one worker (`wait`, `failures`, `close`, `seconds`); an error of either
    part is kept with its tag, and a front part that failed hands nothing to the second thread."""

    def __init__(self, name: str) -> None:
        self.front = BackgroundWorker(name, max_queued=1)
        self.back = BackgroundWorker(f"{name}-back", max_queued=1)

    @property
    def seconds(self) -> float:
        return self.front.seconds + self.back.seconds

    @property
    def calls(self) -> int:
        return self.back.calls

    def submit(self, fn: Callable[[], None], tag: Any = None) -> None:
        """A whole call: on the first thread once the second is idle (it may use every layer)."""
        def run() -> None:
            self.back.wait()
            fn()

        self.front.submit(run, tag)

    def submit_split(self, front: Callable[[], Any], back: Callable[[Any], None], tag: Any = None) -> None:
        """front() on the first thread, then back(its result) on the second."""
        def run_front() -> None:
            out = front()
            self.back.submit(lambda: back(out), tag)

        self.front.submit(run_front, tag)

    def wait(self) -> None:
        self.front.wait()  # the first thread hands its last part to the second before it is idle
        self.back.wait()

    def failures(self) -> list[tuple[BaseException, Any]]:
        return self.front.failures() + self.back.failures()

    def raise_if_failed(self) -> None:
        self.front.raise_if_failed()
        self.back.raise_if_failed()

    def close(self, timeout: float | None = None) -> None:
        self.front.close(timeout)
        self.back.close(timeout)
