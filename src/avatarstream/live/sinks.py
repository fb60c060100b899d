"""The sinks a live session publishes into, besides the viewers' own.

- `LiveQueueSink`: a bounded drop-oldest queue behind `LiveSession.frames()` (live: a reader that
  falls behind loses the oldest items instead of stalling generation).
- `BackgroundSink`: any sink fed through the engine's Publisher thread (encoding off the
  scheduler thread).
Also the PCM16 decoding every speech input goes through.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np

from avatarstream.engine.publisher import Publisher
from avatarstream.errors import InputError
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.base import Sink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimedFrame:
    """One output item: a video frame [H, W, 3] uint8 or an audio chunk [N] float32, at `pts` s."""

    kind: Literal["video", "audio"]
    pts: float
    data: np.ndarray


class LiveQueueSink:
    """Sink into a bounded queue that drops its oldest item when full (live: never stalls).

    With max_items 0 it keeps nothing and only counts the frames published."""

    def __init__(self, max_items: int) -> None:
        self.enabled = max_items > 0
        self.q: queue.Queue = queue.Queue(maxsize=max(1, max_items))
        self.durable_frames = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        pass

    def _put(self, item: TimedFrame | None) -> None:
        if not self.enabled:
            return
        with self._lock:
            while True:
                try:
                    self.q.put_nowait(item)
                    return
                except queue.Full:
                    try:
                        self.q.get_nowait()
                        self.dropped += 1
                    except queue.Empty:
                        pass

    def write_video(self, chunk: VideoChunk) -> None:
        for pts, frame in zip(chunk.pts_seconds(), chunk.frames):
            self._put(TimedFrame("video", float(pts), frame))
            self.durable_frames += 1

    def write_audio(self, chunk: AudioChunk) -> None:
        self._put(TimedFrame("audio", chunk.start_seconds,
                             np.asarray(chunk.samples, np.float32)))

    def close(self) -> None:
        self._put(None)  # end marker

    def abort(self) -> None:
        self.close()


class BackgroundSink:
    """A sink fed through the engine's Publisher thread, so encoding (HLS, files) never runs on
    the scheduler thread; its bounded queue back-pressures only if the encoder falls far behind.
    watermark: mark the frames on that thread (a render's; a session's frames come marked)."""

    def __init__(self, sink: Sink, *, max_queued: int = 64, watermark: bool = False) -> None:
        self.sink = sink
        self.max_queued = max_queued
        self.watermark = watermark
        self._pub: Publisher | None = None

    @property
    def durable_frames(self) -> int:
        return self.sink.durable_frames

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        self.sink.open(width, height, fps, sample_rate)
        self._pub = Publisher([self.sink], max_queued=self.max_queued, watermark=self.watermark)

    def write_video(self, chunk: VideoChunk) -> None:
        assert self._pub is not None
        self._pub.put_video(chunk.frames, chunk.start_frame, chunk.fps)

    def write_audio(self, chunk: AudioChunk) -> None:
        assert self._pub is not None
        self._pub.put_audio(chunk.samples, chunk.start_sample, chunk.sample_rate)

    def close(self) -> None:
        if self._pub is not None:
            self._pub.drain()
        self.sink.close()

    def abort(self) -> None:
        try:
            if self._pub is not None:
                self._pub.drain()
        except Exception:  # noqa: BLE001 - aborting anyway
            log.debug("background sink failed while aborting", exc_info=True)
        self.sink.abort()


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian PCM16 mono bytes -> float32 [N] in [-1, 1]."""
    if len(data) % 2:
        raise InputError("PCM16 audio must have an even number of bytes (2 per sample)")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def as_float(audio: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(audio, (bytes, bytearray, memoryview)):
        return pcm16_to_float(bytes(audio))
    return np.asarray(audio, np.float32)
