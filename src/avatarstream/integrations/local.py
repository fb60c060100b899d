"""The in-process side of an agent-stack integration: shared hosts and one session's timed output.

    host = acquire_host("tiny-random", "face.jpg", max_sessions=2)   # loaded once per process
    stream = SessionStream(host, loop)          # one live session on the host's scheduler
    await stream.offer(samples16k)              # the agent's speech (float32, 16 kHz); False: full
    await stream.end_of_speech(); await stream.clear(); await stream.listen(True)
    async for item in stream: ...               # Frame(index, rgb, pcm16 | None) | SegmentEnd
    release_host(host)

`acquire_host` builds what `avatarstream serve` and the LiveKit worker build (`AvatarHost`: one
model, one `ChunkScheduler`, one admission) once per (model, avatar, device) in this process and
counts its users, so several agent pipelines in one process batch their chunks on one model, as
the sessions of one server do; the last `release_host` stops it.

`SessionStream` is one `LiveSession` on such a host with a sink that hands what the session
publishes (from the scheduler's threads) to the event loop, in publishing order, and pairs each
video frame with its audio: frame n with session samples [n * spf, (n + 1) * spf) (640 at 25 fps,
16 kHz) while the session speaks (between its `speech_started` and `speech_ended`), None while it
listens (idle frames: closed mouth, small motion; no audio). The speech samples are the ones
offered, bit for bit: the session passes speech through and pads with silence.

`remote.RemoteStream` has the same interface over a running `avatarstream serve`; the Pipecat
service drives either.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from avatarstream.media.timeline import SampleTimeline
from avatarstream.live.session import LiveSession, LiveSessionConfig
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.serve.livekit.host import AvatarHost

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Frame:
    index: int  # the video frame's index on the session's timeline (media time index / fps)
    rgb: np.ndarray  # [H, W, 3] uint8
    pcm: np.ndarray | None  # int16 mono at the model's rate: the frame's speech; None: listening


@dataclass(frozen=True)
class SegmentEnd:
    interrupted: bool  # the utterance was cut by an interrupt
    frame: int  # the first frame after it


# -- hosts shared in this process ------------------------------------------------------------------
_hosts: dict[tuple, list] = {}  # key -> [host, users]
_hosts_lock = threading.Lock()


def load_reference_frames(avatar: str | Path | None, config: Any) -> torch.Tensor:
    """[F, 3, H, W] uint8 at the model's output size: the avatar file, or a drawn test face."""
    from avatarstream.media.reference import fit_resize, load_reference
    from avatarstream.media.synthetic import face_image

    if avatar is None:
        return fit_resize(face_image(max(config.out_hw)), *config.out_hw).unsqueeze(0)
    return load_reference(avatar, size=config.out_hw, max_frames=config.ref_pixel_frames,
                          what="avatar").frames


def acquire_host(model: str | None = None, avatar: str | Path | None = None, *,
                 device: str = "cpu", max_sessions: int | None = None,
                 seconds_per_chunk: float | None = None, lead_s: float = 0.3) -> AvatarHost:
    """The started host for (model, avatar, device), made on first use (blocking: the model loads,
    the face is prepared, and with max_sessions None the capacity is measured as `serve` does;
    other callers wait meanwhile). Raises ConfigError / InputError for an unknown model or an unreadable avatar file."""
    from avatarstream.hardware import check_device
    from avatarstream.registry import load_model, model_spec_for, resolve_model

    name = resolve_model(model)
    key = (name, None if avatar is None else str(Path(avatar).resolve()), device)
    with _hosts_lock:
        if key in _hosts:
            _hosts[key][1] += 1
            return _hosts[key][0]
        check_device(device)
        reference = load_reference_frames(avatar, model_spec_for(name).pipeline())  # before the weights
        host = AvatarHost(load_model(name, device=device), reference, max_sessions=max_sessions,
                          seconds_per_chunk=seconds_per_chunk,
                          session=LiveSessionConfig(lead_s=lead_s))
        host.start()
        _hosts[key] = [host, 1]
        return host


def release_host(host: AvatarHost) -> None:
    """One user fewer; the last one stops the host (its scheduler) and forgets it."""
    with _hosts_lock:
        for key, entry in list(_hosts.items()):
            if entry[0] is host:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _hosts[key]
                    host.stop()
                return


# -- one session's output ------------------------------------------------------------------------
class _Timeline(SampleTimeline):
    """The session's audio (float32 at its rate) by sample index, until its frame takes it."""

    def __init__(self) -> None:
        super().__init__(np.float32)

    def take(self, a: int, b: int) -> np.ndarray:
        """Samples [a, b) as int16 (zeros where none were published); drops all before b."""
        out = super().take(a, b)
        return np.clip(np.round(out * 32768.0), -32768, 32767).astype(np.int16)


_CLOSED = object()


class SessionStream:
    """One live session on `host`, its output as `Frame`s and `SegmentEnd`s (module doc).

    Also a `Sink` (open / write_video / write_audio / close / abort), attached to the session:
    the scheduler's threads put, the event loop gets. Unbounded: the session itself never renders
    more than `lead_s` ahead of the wall clock, so a reader that keeps up holds a few frames."""

    def __init__(self, host: AvatarHost, loop: asyncio.AbstractEventLoop) -> None:
        c = host.models.config
        self.fps, self.sample_rate, self.spf = c.fps, c.sample_rate, c.sample_rate // c.fps
        self.size = (c.out_hw[1], c.out_hw[0])  # (width, height)
        self.loop = loop
        self.durable_frames = 0
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self.session: LiveSession = host.open(sinks=[self], on_event=self._on_event)

    @property
    def origin(self) -> float:
        """The monotonic wall time of media time 0 (frame n is due at origin + n / fps)."""
        assert self.session.origin is not None
        return self.session.origin

    paced = False  # frames come as soon as they are made (up to lead_s ahead), not at their time

    @property
    def running(self) -> bool:
        return self.session.running

    async def offer(self, samples: np.ndarray) -> bool:
        """Queue float32 speech at the model's rate if it fits now (never blocks)."""
        return self.session.offer_audio(samples)

    async def end_of_speech(self) -> None:
        self.session.end_of_speech()

    async def clear(self) -> None:
        self.session.clear_buffer()

    async def listen(self, on: bool) -> None:
        self.session.listen(on)

    async def more_to_come(self, *, talking: bool) -> bool:
        """Whether speech is still queued (`talking`: or being spoken now)."""
        return bool(self.session.queue.buffered) or (talking and self.session.talking)

    def _put(self, item: object) -> None:
        with self._lock:
            self._items.append(item)
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop is closed: nobody reads any more
            pass

    def _on_event(self, event: dict) -> None:  # the scheduler thread, in publishing order
        if event["type"] == "speech_started":
            self._put(("start", event["frame"]))
        elif event["type"] == "speech_ended":
            self._put(SegmentEnd(bool(event["interrupted"]), int(event["frame"])))

    # -- Sink --------------------------------------------------------------------------------------
    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        pass

    def write_video(self, chunk: VideoChunk) -> None:
        self._put(("video", chunk.start_frame, chunk.frames))
        self.durable_frames += len(chunk.frames)

    def write_audio(self, chunk: AudioChunk) -> None:
        self._put(("audio", chunk.start_sample, chunk.samples))

    def close(self) -> None:
        self._put(_CLOSED)

    def abort(self) -> None:
        self.close()

    # -- the loop's side ---------------------------------------------------------------------------
    async def _get(self) -> object:
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                self._ready.clear()
            await self._ready.wait()

    def __aiter__(self) -> AsyncIterator[Frame | SegmentEnd]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[Frame | SegmentEnd]:
        audio = _Timeline()
        talk_from: int | None = None
        while True:
            item = await self._get()
            if item is _CLOSED:
                return
            if isinstance(item, SegmentEnd):
                talk_from = None
                yield item
            elif item[0] == "start":
                talk_from = item[1]
            elif item[0] == "audio":
                audio.add(item[1], item[2])
            else:
                _, start, frames = item
                for i, rgb in enumerate(frames):
                    n = start + i
                    pcm = audio.take(n * self.spf, (n + 1) * self.spf)
                    talking = talk_from is not None and n >= talk_from
                    yield Frame(n, rgb, pcm if talking else None)

    async def aclose(self) -> None:
        """End the session (its scheduler slot is freed)."""
        await asyncio.to_thread(self.session.stop, 10.0)
