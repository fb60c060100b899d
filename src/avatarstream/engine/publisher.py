"""Publisher: hands timed video frames and the input audio to the sinks on a background thread.

Encoding (libx264/AAC release the GIL) overlaps with the next chunk's generation. The queue is
bounded: when the sinks fall behind, `put_*` blocks and generation waits (back-pressure) instead
of buffering frames without limit. Errors raised by a sink resurface in the generating thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

import numpy as np

from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.base import Sink

_STOP = object()


class Publisher:
    def __init__(self, sinks: Sequence[Sink], *, max_queued: int = 4) -> None:
        self.sinks = list(sinks)
        self._q: queue.Queue = queue.Queue(maxsize=max_queued)
        self._error: BaseException | None = None
        self.first_frame_time: float | None = None
        self.frames_written = 0
        self.sink_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="avatarstream-publisher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            if self._error is not None:
                continue  # drain after a failure so producers never block forever
            try:
                t0 = time.perf_counter()
                for sink in self.sinks:
                    if isinstance(item, VideoChunk):
                        sink.write_video(item)
                    else:
                        sink.write_audio(item)
                self.sink_seconds += time.perf_counter() - t0
                if isinstance(item, VideoChunk):
                    if self.first_frame_time is None:
                        self.first_frame_time = time.perf_counter()
                    self.frames_written += item.frames.shape[0]
            except BaseException as e:  # noqa: BLE001 - re-raised in the producer
                self._error = e

    def _put(self, item: object) -> None:
        self.raise_if_failed()
        self._q.put(item)

    def put_video(self, frames: np.ndarray, start_frame: int, fps: int) -> None:
        """frames: [N, H, W, 3] uint8, the first being timeline frame `start_frame`."""
        self._put(VideoChunk(frames=frames, start_frame=start_frame, fps=fps))

    def put_audio(self, samples: np.ndarray, start_sample: int, sample_rate: int) -> None:
        self._put(AudioChunk(samples=samples, start_sample=start_sample, sample_rate=sample_rate))

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Wait until everything queued has reached the sinks, then stop the thread."""
        self._q.put(_STOP)
        self._thread.join()
        self.raise_if_failed()
