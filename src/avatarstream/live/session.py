"""LiveSession: one open-ended avatar session with a LiveKit-shaped interface.

    session = LiveSession(models, reference, scheduler=shared)   # reference: [F,3,H,W] uint8
    session.start()
    session.push_audio(pcm16_bytes)        # or float32; blocks when the speech buffer is full
    session.offer_audio(pcm16_bytes)       # never blocks: False = "slow down"
    session.say(samples)                   # a whole utterance (the server's TTS)
    session.end_of_speech(); session.clear_buffer(); session.keep_alive()
    async for item in session.frames():    # TimedFrame(kind "video"|"audio", pts, data)
        ...
    session.stop()

One media clock per session: video frame i at i / fps, audio sample s at s / sample_rate, and the
timeline's time 0 is the wall time `origin` of `start()`. The session alternates two states:
- idle (nothing queued): the IdleAnimator's frames (small natural motion, mouth closed; attentive
  motion while `listening`) and silence, rendered a little ahead of the wall clock (`lead_s`), no
  model call; before speech the motion eases to the still reference and dissolves into the
  model's first frame (`ease_s`, published with the first chunk), and after speech it dissolves
  out of the model's last frame back into motion;
- talking: queued speech starts a TalkSegment at the next frame; the engine's stages generate it
  chunk by chunk, run by the shared ChunkScheduler (batched with other sessions' chunks), and
  publish the speech with its video; when the utterance ends (or `clear_buffer` cuts it) the
  session idles again from the segment's last frame.
Everything published goes to the session's sinks: a bounded drop-oldest queue for `frames()`, and
whatever else is attached (`add_sink`: the WebRTC playout, live HLS, ...).

`events` (and the `on_event` callback) report what a client needs to measure latency and sync:
`speech_started` / `speech_ended` with the media time of the segment's first / last frame,
`cleared`, `listening` (the user's turn began or ended: `on`), `session_ended` with a reason
(and, when it is "error", the error's message: one the user can act on, e.g. "no space left on
device", or "internal error").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from avatarstream.engine.config import ModelSet
from avatarstream.engine.stages.reference import check_reference_size
from avatarstream.errors import AvatarStreamError
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.base import Sink
from avatarstream.live.idle import IdleAnimator
from avatarstream.provenance.watermark import embed
from avatarstream.live.speech import SpeechQueue
from avatarstream.live.prepared import PreparedReference, prepare_reference
from avatarstream.live.segment import NotReady, TalkSegment, UtteranceAudio
from avatarstream.live.sinks import (BackgroundSink, TimedFrame, LiveQueueSink, as_float,
                                      pcm16_to_float)

__all__ = ["BackgroundSink", "LiveSession", "LiveSessionConfig", "TimedFrame", "pcm16_to_float"]

if TYPE_CHECKING:
    from avatarstream.engine.stage import ChunkRecord
    from avatarstream.live.scheduler import ChunkScheduler

log = logging.getLogger(__name__)


@dataclass
class LiveSessionConfig:
    packet_s: float = 0.04  # audio pulled by a segment per step
    max_buffer_s: float = 5.0  # streamed speech queued ahead at most (push_audio blocks beyond it)
    max_script_s: float = 180.0  # TTS speech queued at most
    lead_s: float = 0.3  # how far the timeline may run ahead of the wall clock
    hangover_s: float = 0.6  # a pause in live speech longer than this ends the utterance
    silence_rms: float = 0.003  # streamed audio quieter than this (-50 dBFS) is a pause
    idle_group: int = 4  # idle frames rendered per step
    ease_s: float = 0.32  # idle motion eased out to the still reference before speech starts
    idle_timeout_s: float | None = 30.0  # no speech and no keep-alive for this long: session ends
    max_out_items: int = 512  # video frames + audio chunks waiting for the frames() reader
    # (0: no frames() output at all, e.g. a server session that only publishes to its sinks)


class LiveSession:
    def __init__(self, models: ModelSet, reference: torch.Tensor, *,
                 prepared: PreparedReference | None = None,
                 config: LiveSessionConfig | None = None, sinks: Sequence[Sink] = (),
                 prompt: str = "", scheduler: ChunkScheduler | None = None,
                 on_event: Callable[[dict], None] | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        from avatarstream.live.scheduler import ChunkScheduler

        self.models = models
        self.reference = reference
        self.config = config or LiveSessionConfig()
        c, pc = self.config, models.config
        self.fps, self.sample_rate = pc.fps, pc.sample_rate
        self.spf = pc.sample_rate // pc.fps  # samples per video frame (640)
        self.queue = SpeechQueue(sample_rate=pc.sample_rate, max_buffer_s=c.max_buffer_s,
                                 max_script_s=c.max_script_s, idle_timeout_s=c.idle_timeout_s,
                                 now=now)
        check_reference_size(reference, pc.out_hw)
        if prepared is not None:
            prepared.check_geometry(pc)
        self.idle = IdleAnimator(reference, fps=pc.fps)
        self.prepared = prepared
        self._prompt = prompt
        self._out = LiveQueueSink(c.max_out_items)
        self._sinks: list[Sink] = [self._out, *sinks]
        self._sinks_lock = threading.Lock()
        # sinks are written by the scheduler thread (audio, idle frames) and by its decode
        # thread (talk frames): one writer at a time
        self._write_lock = threading.Lock()
        self._own_scheduler = scheduler is None
        self.scheduler = scheduler or ChunkScheduler(models)
        self.on_event = on_event
        self.events: deque[dict] = deque(maxlen=256)
        self.now = now
        self.origin: float | None = None  # wall time of media time 0
        self.frame = 0  # next video frame of the timeline to publish
        self.sample = 0  # next audio sample of the timeline to publish
        self.segment: TalkSegment | None = None
        self.segments = 0
        self.listening = False  # the user is speaking (set by `listen`)
        self.due: float | None = None  # when poll() has work next (scheduler hint)
        self.error: BaseException | None = None
        self.end_reason: str | None = None
        self._started = False
        self._ended = threading.Event()
        self._text: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._ease: tuple[int, int] | None = None  # frames easing into the next segment
        self._last_video: np.ndarray | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Prepare the reference if it was not given, open the sinks, join the scheduler."""
        if self._started:
            raise RuntimeError("the session was already started")
        self._started = True
        if self.prepared is None:
            self.prepared = prepare_reference(self.models, self.reference)
        self._text = self.models.text.call("encode", [self._prompt])
        pc = self.models.config
        for s in self._sinks:
            s.open(pc.out_hw[1], pc.out_hw[0], pc.fps, pc.sample_rate)
        self.origin = self.now()
        if self._own_scheduler:
            self.scheduler.start()
        self.scheduler.add(self)

    def stop(self, timeout: float | None = 10.0) -> None:
        """End the session: no more speech is taken; the sinks are closed."""
        self.queue.close()
        self.scheduler.notify()
        if self._started:
            self._ended.wait(timeout)
        if self._own_scheduler:
            self.scheduler.stop()

    @property
    def running(self) -> bool:
        return self._started and not self._ended.is_set()

    def wait_ended(self, timeout: float | None = None) -> bool:
        return self._ended.wait(timeout)

    @property
    def dropped(self) -> int:
        """Output items the frames() reader missed because it fell behind."""
        return self._out.dropped

    @property
    def frames_published(self) -> int:
        return self.frame

    @property
    def talking(self) -> bool:
        return self.segment is not None

    def add_sink(self, sink: Sink) -> None:
        """Attach a sink from now on (opened here); it receives what is published after this."""
        pc = self.models.config
        sink.open(pc.out_hw[1], pc.out_hw[0], pc.fps, pc.sample_rate)
        with self._sinks_lock:
            self._sinks.append(sink)

    def remove_sink(self, sink: Sink) -> None:
        with self._sinks_lock:
            if sink not in self._sinks:
                return
            self._sinks.remove(sink)
        _close_sink(sink, ok=True)

    # -- input -----------------------------------------------------------------------------------
    def push_audio(self, audio: bytes | np.ndarray, *, timeout: float | None = None) -> bool:
        """Queue speech: PCM16 mono bytes or float32 samples at the model's rate (16 kHz).

        Back-pressure: blocks while `max_buffer_s` of speech is already queued. With `timeout`,
        returns False if the audio could not all be queued in time (the client should slow
        down); also False once the session has ended."""
        ok = self.queue.push(as_float(audio), timeout=timeout)
        self.scheduler.notify()
        return ok

    def offer_audio(self, audio: bytes | np.ndarray) -> bool:
        """Queue the whole piece if it fits in the speech buffer now, else nothing (never blocks)."""
        ok = self.queue.offer(as_float(audio))
        if ok:
            self.scheduler.notify()
        return ok

    def say(self, samples: np.ndarray) -> bool:
        """Queue one whole utterance (e.g. from TTS); False if the script queue is full."""
        ok = self.queue.say(samples)
        self.scheduler.notify()
        return ok

    def end_of_speech(self) -> None:
        """The current utterance is complete: queued speech plays out, then the avatar listens."""
        self.queue.end_of_speech()
        self.scheduler.notify()

    def clear_buffer(self) -> float:
        """Interrupt: drop queued speech; the avatar stops speaking within one chunk.

        Returns the seconds of speech dropped."""
        dropped = self.queue.clear()
        self._emit("cleared", dropped_s=round(dropped, 3), media_s=round(self.frame / self.fps, 3))
        self.scheduler.notify()
        return dropped

    def keep_alive(self) -> None:
        """Reset the idle timeout."""
        self.queue.keep_alive()

    def listen(self, on: bool) -> None:
        """The user started (True) or stopped (False) speaking. With no speech queued the idle
        frames blend into attentive motion (nods, the head turned to the viewer, closed mouth)
        and back; the session does not time out while the user talks; a `listening` event.
        Speech already queued still plays: cutting it is `clear_buffer`."""
        on = bool(on)
        self.queue.keep_alive()
        if on != self.listening:
            self.listening = on
            self._emit("listening", on=on, media_s=round(self.frame / self.fps, 3))

    @property
    def buffered_seconds(self) -> float:
        return self.queue.buffered_seconds

    # -- output ----------------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, **fields}
        self.events.append(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 - a listener must not break the session
                log.debug("event listener failed", exc_info=True)

    def _sinks_now(self) -> list[Sink]:
        with self._sinks_lock:
            return list(self._sinks)

    def put_video(self, frames: np.ndarray, start_frame: int, fps: int) -> None:
        ease = self._ease
        if ease is not None and start_frame == ease[1] and len(frames):  # a segment's first frames
            self._ease = None
            self.put_video(self.idle.frames(ease[0], ease[1] - ease[0], into=frames[0]), ease[0], fps)
        self._last_video = frames[-1] if len(frames) else self._last_video
        if self.models.config.watermark:  # every sink gets marked frames (provenance/watermark.py)
            frames = embed(frames, start_frame)
        chunk = VideoChunk(frames=frames, start_frame=start_frame, fps=fps)
        with self._write_lock:
            for s in self._sinks_now():
                s.write_video(chunk)
            self.frame = max(self.frame, chunk.end_frame)

    def put_audio(self, samples: np.ndarray, start_sample: int, sample_rate: int) -> None:
        chunk = AudioChunk(samples=np.asarray(samples, np.float32), start_sample=start_sample,
                           sample_rate=sample_rate)
        with self._write_lock:
            for s in self._sinks_now():
                s.write_audio(chunk)
            self.sample = max(self.sample, chunk.end_sample)

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

    # -- scheduler side (the scheduler thread only) ---------------------------------------------
    @property
    def finished(self) -> bool:
        return self.queue.closed

    def poll(self, now: float) -> tuple[ChunkRecord, TalkSegment] | None:
        """Do the cheap work that is due (idle frames, starting/ending an utterance) and return
        the next talk chunk if one can be generated now. Sets `due` for the scheduler."""
        assert self.origin is not None
        c = self.config
        self.due = None
        if self.listening:  # the user is talking: that is no idle session
            self.queue.keep_alive()
        self.queue.check_idle()
        wall_media = now - self.origin
        if self.segment is None:
            # A microphone keeps sending silence between utterances: that is no reason to talk.
            packet = round(c.packet_s * self.sample_rate)
            self.queue.drop_silence(packet, c.silence_rms)
            q = self.queue
            if q.buffered >= packet or (q.buffered and q.ended):
                self._start_segment()
            else:
                self._idle(wall_media)
                return None
        seg = self.segment
        assert seg is not None
        # frames made so far: published, or handed to the scheduler's decode thread
        made = max(self.frame, seg.start_frame + seg.state.frames_emitted)
        if made / self.fps - wall_media > c.lead_s:  # far enough ahead: wait
            self.due = self.origin + made / self.fps - c.lead_s
            return None
        try:
            rec = seg.plan()
        except NotReady as e:
            self.due = e.due
            return None
        if rec is None:
            self._end_segment()
            return None
        return rec, seg

    def chunk_done(self, seg: TalkSegment) -> None:
        if seg.done and seg is self.segment:
            self._end_segment()

    def _idle(self, wall_media: float) -> None:
        c = self.config
        target = int((wall_media + c.lead_s) * self.fps)
        if target > self.frame:
            n = max(c.idle_group, target - self.frame)
            self._publish_idle(n)
        assert self.origin is not None
        self.due = self.origin + (self.frame + 1) / self.fps - c.lead_s

    def _publish_idle(self, n: int) -> None:
        start = self.frame
        # the animator's mode follows `listening` from the next frame on
        self.idle.set_mode("listening" if self.listening else "idle", start)
        self._align_audio()
        self.put_audio(np.zeros(n * self.spf, np.float32), start * self.spf, self.sample_rate)
        self.put_video(self.idle.frames(start, n), start, self.fps)

    def _align_audio(self) -> None:
        """Keep audio on the video's frame boundary (silence up to it) between segments."""
        gap = self.frame * self.spf - self.sample
        if gap > 0:
            self.put_audio(np.zeros(gap, np.float32), self.sample, self.sample_rate)

    def _start_segment(self) -> None:
        c = self.config
        self._align_audio()
        # ease the idle motion out to the still reference; the frames are made with the first
        # chunk (put_video), dissolving into its first frame; silence meanwhile
        start = self.frame + max(1, round(c.ease_s * self.fps))
        self.idle.set_mode("rest", self.frame, frames=start - self.frame)
        self._ease = (self.frame, start)
        self.put_audio(np.zeros((start - self.frame) * self.spf, np.float32), self.sample,
                       self.sample_rate)
        assert self.prepared is not None and self._text is not None and self.origin is not None
        audio = UtteranceAudio(self.queue, start_sample=start * self.spf, origin=self.origin,
                               lead_s=c.lead_s, packet_s=c.packet_s, hangover_s=c.hangover_s,
                               samples_per_frame=self.spf, silence_rms=c.silence_rms,
                               now=self.now)
        self.segment = TalkSegment(self.models, self.prepared, self._text[0], self._text[1], audio,
                                   self, start_frame=start)
        self.segments += 1
        self._emit("speech_started", media_s=round(start / self.fps, 4), frame=start,
                   segment=self.segments)

    def _end_segment(self) -> None:
        seg = self.segment
        self.segment = None
        if seg is None:
            return
        self.scheduler.wait_decoded()  # its last frames are out before anything that follows
        ease, self._ease = self._ease, None
        if ease is not None:  # the segment made no frame: its ease frames go out alone
            self.put_video(self.idle.frames(ease[0], ease[1] - ease[0]), ease[0], self.fps)
        if self._last_video is not None:  # the idle frames dissolve out of the last one
            self.idle.fade_from(self._last_video, self.frame)
        self._align_audio()
        self._emit("speech_ended", media_s=round(self.frame / self.fps, 4), frame=self.frame,
                   segment=self.segments, interrupted=seg.audio.interrupted,
                   speech_s=round(seg.audio.speech / self.sample_rate, 3))

    def finalize(self, error: BaseException | None = None) -> None:
        """Close the sinks (the scheduler calls this once, when it drops the session)."""
        self.error = error
        self.segment = None
        self.end_reason = ("error" if error is not None else
                           "idle_timeout" if self.queue.idle_expired else "stopped")
        for s in self._sinks_now():
            _close_sink(s, ok=error is None or s.durable_frames > 0)
        detail = {} if error is None else {
            "error": str(error) if isinstance(error, AvatarStreamError) else "internal error"}
        self._emit("session_ended", reason=self.end_reason,
                   media_s=round(self.frame / self.fps, 3), **detail)
        self._ended.set()


def _close_sink(sink: Sink, *, ok: bool) -> None:
    try:
        sink.close() if ok else sink.abort()
    except Exception as e:  # noqa: BLE001 - one failing sink must not hide the others
        # a user-facing error (disk full) is one line; anything else keeps its traceback
        log.warning("closing sink %r failed: %s", sink, e,
                    exc_info=not isinstance(e, AvatarStreamError))


_NOTHING = object()
