"""The in-process sink: timed raw frames (and audio) for a consumer in the same process.

A WebRTC video track, a preview window or a test reads `frames()` on its own thread while the
publisher thread writes. The queues are bounded: when the consumer falls behind, `write_video`
blocks, which stalls the publisher and so generation (back-pressure) instead of piling up frames.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

import numpy as np

from avatarstream.media.frames import AudioChunk, VideoChunk

_END = object()


class RawFrameSink:
    """Hands out (pts_seconds, [H, W, 3] uint8) frames and (pts_seconds, [N] float32) audio.

    `frames()` and `audio()` each iterate until `close` or `abort`; each is meant for a single
    consumer (two consumers would split the items between them). Audio is queued only with
    `with_audio=True`, since an audio queue nobody reads would fill up and block the video.
    `durable_frames` counts frames handed to the queue.
    """

    def __init__(self, *, max_frames: int = 64, with_audio: bool = False,
                 max_audio_chunks: int = 64) -> None:
        self._frames: queue.Queue = queue.Queue(maxsize=max_frames)
        self._audio: queue.Queue | None = (queue.Queue(maxsize=max_audio_chunks) if with_audio
                                           else None)
        self.durable_frames = 0
        self.aborted = False
        self.size: tuple[int, int] | None = None  # (width, height) once opened
        self.fps = 0
        self.sample_rate = 0
        self._ended = False

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        self.size, self.fps, self.sample_rate = (width, height), fps, sample_rate

    def write_video(self, chunk: VideoChunk) -> None:
        """Queue each frame with its presentation time; blocks while the queue is full."""
        for pts, frame in zip(chunk.pts_seconds(), chunk.frames):
            self._frames.put((float(pts), frame))
            self.durable_frames += 1

    def write_audio(self, chunk: AudioChunk) -> None:
        """Queue the chunk with the time of its first sample (dropped unless with_audio)."""
        if self._audio is not None:
            self._audio.put((chunk.start_seconds, np.asarray(chunk.samples, np.float32)))

    def frames(self) -> Iterator[tuple[float, np.ndarray]]:
        """(pts_seconds, [H, W, 3] uint8) in timeline order until the sink is closed."""
        return _drain(self._frames)

    def audio(self) -> Iterator[tuple[float, np.ndarray]]:
        """(pts_seconds, [N] float32 mono) in timeline order until the sink is closed."""
        if self._audio is None:
            raise RuntimeError("RawFrameSink(with_audio=True) is needed to read audio")
        return _drain(self._audio)

    def close(self) -> None:
        """End the iterators after the items already queued (blocks until there is room)."""
        if self._ended:
            return
        self._ended = True
        self._frames.put(_END)
        if self._audio is not None:
            self._audio.put(_END)

    def abort(self) -> None:
        """Drop what is still queued and end the iterators now."""
        self.aborted = True
        for q in (self._frames, self._audio):
            if q is None:
                continue
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        self._ended = False
        self.close()


def _drain(q: queue.Queue) -> Iterator[tuple[float, np.ndarray]]:
    """Items of `q` until the end marker, which is put back so later iterators also stop."""
    while True:
        item = q.get()
        if item is _END:
            q.put(item)
            return
        yield item
