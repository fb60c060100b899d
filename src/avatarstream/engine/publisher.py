"""Publisher: hands timed video frames and the input audio to the sinks on a background thread.

Encoding (libx264/AAC release the GIL) overlaps with the next chunk's generation. The queue is
bounded (`BackgroundWorker`): when the sinks fall behind, `put_*` blocks and generation waits
(back-pressure) instead of buffering frames without limit. Errors raised by a sink resurface in the
generating thread; what is queued after a failure is dropped.

`watermark`: every video chunk gets the invisible "AI-generated" mark (provenance/watermark.py)
on this thread, before it fans out to the sinks, so marking (about 2 ms a 256 px frame) overlaps
generation too. The file pipeline turns it on (`PipelineConfig.watermark`); a live session marks
its frames itself (they reach sinks without a Publisher), so `BackgroundSink` leaves it off there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from avatarstream.engine.worker import BackgroundWorker
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.provenance.watermark import embed
from avatarstream.publish.base import Sink


class Publisher:
    def __init__(self, sinks: Sequence[Sink], *, max_queued: int = 4, watermark: bool = False) -> None:
        self.sinks = list(sinks)
        self.watermark = watermark
        self._worker = BackgroundWorker("avatarstream-publisher", max_queued=max_queued,
                                        skip_after_error=True)
        self.first_frame_time: float | None = None
        self.frames_written = 0

    @property
    def sink_seconds(self) -> float:
        return self._worker.seconds

    def _write_video(self, chunk: VideoChunk) -> None:
        if self.watermark:
            chunk = VideoChunk(frames=embed(chunk.frames, chunk.start_frame), start_frame=chunk.start_frame,
                               fps=chunk.fps)
        for sink in self.sinks:
            sink.write_video(chunk)
        if self.first_frame_time is None:
            self.first_frame_time = time.perf_counter()
        self.frames_written += chunk.frames.shape[0]

    def _write_audio(self, chunk: AudioChunk) -> None:
        for sink in self.sinks:
            sink.write_audio(chunk)

    def put_video(self, frames: np.ndarray, start_frame: int, fps: int) -> None:
        """frames: [N, H, W, 3] uint8, the first being timeline frame `start_frame`."""
        self.raise_if_failed()
        chunk = VideoChunk(frames=frames, start_frame=start_frame, fps=fps)
        self._worker.submit(lambda: self._write_video(chunk))

    def put_audio(self, samples: np.ndarray, start_sample: int, sample_rate: int) -> None:
        self.raise_if_failed()
        chunk = AudioChunk(samples=samples, start_sample=start_sample, sample_rate=sample_rate)
        self._worker.submit(lambda: self._write_audio(chunk))

    def raise_if_failed(self) -> None:
        self._worker.raise_if_failed()

    def drain(self) -> None:
        """Wait until everything queued has reached the sinks, then stop the thread."""
        self._worker.close()
        self.raise_if_failed()
