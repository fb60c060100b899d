"""LiveSession: one open-ended avatar session with a LiveKit-shaped interface.

    session = LiveSession(models, reference)      # reference: [F, 3, H, W] uint8 at hr_size
    session.start()
    session.push_audio(pcm16_bytes)               # or float32 samples; blocks when the buffer is full
    session.end_of_speech(); session.clear_buffer(); session.keep_alive()
    async for item in session.frames():           # TimedFrame(kind "video"|"audio", pts, data)
        ...
    session.stop()

The existing Pipeline runs in a worker thread against a `LiveAudioSource`: speech that is pushed
is spoken, and when none is queued the source feeds paced silence, so video keeps coming in real
time (the avatar listens). Video and audio carry presentation timestamps on the session's one
media clock (video frame i at i / fps, audio sample s at s / sample_rate).

Output is live: `frames()` reads a bounded queue; a reader that falls behind loses the oldest
items (counted in `dropped`) rather than stalling generation. Extra sinks (HLS, file) passed to
the constructor receive everything, with the pipeline's own back-pressure.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from avatarstream.engine.pipeline import ModelSet, Pipeline, RunSummary
from avatarstream.errors import InputError
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.base import Sink
from avatarstream.serve.live_audio import LiveAudioSource

log = logging.getLogger(__name__)


@dataclass
class LiveSessionConfig:
    packet_s: float = 0.04  # audio pulled by the pipeline per step
    max_buffer_s: float = 5.0  # speech queued ahead at most (push_audio blocks beyond it)
    lead_s: float = 0.3  # how far generation may run ahead of real-time playback
    idle_timeout_s: float | None = 30.0  # no speech and no keep-alive for this long: session ends
    max_out_items: int = 512  # video frames + audio chunks waiting for the frames() reader
    # (0: no frames() output at all, e.g. a server session that only publishes HLS)


@dataclass(frozen=True)
class TimedFrame:
    """One output item: a video frame [H, W, 3] uint8 or an audio chunk [N] float32, at `pts` s."""

    kind: Literal["video", "audio"]
    pts: float
    data: np.ndarray


class _LiveQueueSink:
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
        self._put(TimedFrame("audio", chunk.start_sample / chunk.sample_rate,
                             np.asarray(chunk.samples, np.float32)))

    def close(self) -> None:
        self._put(None)  # end marker

    def abort(self) -> None:
        self.close()


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian PCM16 mono bytes -> float32 [N] in [-1, 1]."""
    if len(data) % 2:
        raise InputError("PCM16 audio must have an even number of bytes (2 per sample)")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


class LiveSession:
    def __init__(self, models: ModelSet, reference: torch.Tensor, *,
                 config: LiveSessionConfig | None = None, sinks: Sequence[Sink] = (),
                 prompt: str = "") -> None:
        self.models = models
        self.reference = reference
        self.config = config or LiveSessionConfig()
        c, pc = self.config, models.config
        self.source = LiveAudioSource(sample_rate=pc.sample_rate, packet_s=c.packet_s,
                                      max_buffer_s=c.max_buffer_s, lead_s=c.lead_s,
                                      idle_timeout_s=c.idle_timeout_s)
        self._out = _LiveQueueSink(c.max_out_items)
        self._sinks: list[Sink] = [self._out, *sinks]
        self._prompt = prompt
        self._thread: threading.Thread | None = None
        self.summary: RunSummary | None = None
        self.error: BaseException | None = None
        self.speech_ended = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Encode the reference and start generating in a worker thread (returns at once)."""
        if self._thread is not None:
            raise RuntimeError("the session was already started")
        self._thread = threading.Thread(target=self._run, name="avatarstream-live-session",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pc = self.models.config
        for s in self._sinks:
            s.open(pc.hr_size, pc.hr_size, pc.fps, pc.sample_rate)
        ok = False
        try:
            self.summary = Pipeline(self.models).run(
                self.reference, iter(self.source), self._sinks, prompt=self._prompt,
                max_lead_s=self.config.lead_s)
            ok = True
        except BaseException as e:  # noqa: BLE001 - kept for the owner of the session
            self.error = e
            log.warning("live session failed: %s", e, exc_info=True)
        finally:
            self.source.close()
            for s in self._sinks:
                try:
                    s.close() if ok else s.abort()
                except Exception:  # noqa: BLE001 - one failing sink must not hide the others
                    log.warning("closing sink %r failed", s, exc_info=True)

    def stop(self, timeout: float | None = 10.0) -> None:
        """End the session: no more audio is taken; what is in flight is published, then closed."""
        self.source.close()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dropped(self) -> int:
        """Output items the frames() reader missed because it fell behind."""
        return self._out.dropped

    @property
    def frames_published(self) -> int:
        return self._out.durable_frames

    # -- input -----------------------------------------------------------------------------------
    def push_audio(self, audio: bytes | np.ndarray, *, timeout: float | None = None) -> bool:
        """Queue speech: PCM16 mono bytes or float32 samples, at the model's sample rate (16 kHz).

        Back-pressure: blocks while `max_buffer_s` of speech is already queued. With `timeout`,
        returns False if the audio could not all be queued in time (the client should slow down);
        also False once the session has ended.
        """
        x = pcm16_to_float(audio) if isinstance(audio, (bytes, bytearray, memoryview)) else audio
        self.speech_ended = False
        return self.source.push(np.asarray(x, np.float32), timeout=timeout)

    def offer_audio(self, audio: bytes | np.ndarray) -> bool:
        """Queue the whole piece if it fits in the speech buffer now, else nothing (never blocks).

        False means "slow down": the client sends faster than real time and should retry later."""
        x = pcm16_to_float(audio) if isinstance(audio, (bytes, bytearray, memoryview)) else audio
        self.speech_ended = False
        return self.source.offer(np.asarray(x, np.float32))

    def end_of_speech(self) -> None:
        """The current utterance is complete: queued speech plays out, then the avatar listens."""
        self.speech_ended = True
        self.source.keep_alive()

    def clear_buffer(self) -> float:
        """Interrupt: drop queued speech; the avatar stops speaking within one chunk.

        Returns the seconds of speech dropped."""
        return self.source.clear()

    def keep_alive(self) -> None:
        """Reset the idle timeout."""
        self.source.keep_alive()

    @property
    def buffered_seconds(self) -> float:
        return self.source.buffered_seconds

    # -- output ----------------------------------------------------------------------------------
    async def frames(self, poll_s: float = 0.1) -> AsyncIterator[TimedFrame]:
        """Timed video frames and audio chunks, in publishing order, until the session ends."""
        if not self._out.enabled:
            raise RuntimeError("this session was made with max_out_items=0: it has no frames()")
        while True:
            item = await asyncio.to_thread(self._get, poll_s)
            if item is _NOTHING:
                continue
            if item is None:
                self._out.close()  # keep the end marker for any later reader
                return
            yield item

    def _get(self, timeout: float) -> object:
        try:
            return self._out.q.get(timeout=timeout)
        except queue.Empty:
            return _NOTHING


_NOTHING = object()
