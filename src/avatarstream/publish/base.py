"""The sink protocol: where published frames and the session's audio go."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from avatarstream.media.frames import AudioChunk, VideoChunk


@runtime_checkable
class Sink(Protocol):
    """Receives timed video and audio in timeline order (video and audio interleave freely).

    `open` is called once before anything is written; `close` finishes the output normally;
    `abort` removes whatever a run that published nothing useful left behind. `durable_frames`
    is how many video frames a reader of the output can already decode (a killed process keeps
    at least those).
    """

    durable_frames: int

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None: ...

    def write_video(self, chunk: VideoChunk) -> None: ...

    def write_audio(self, chunk: AudioChunk) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...
