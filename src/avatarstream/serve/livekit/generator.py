"""SessionVideoGenerator: LiveKit Agents' `VideoGenerator` over one live session.

    gen = SessionVideoGenerator(host)           # opens (admits) a session on the host's scheduler
    await gen.push_audio(rtc.AudioFrame)         # the agent's speech, any rate, any channels
    await gen.push_audio(AudioSegmentEnd())      # the utterance is complete
    gen.clear_buffer()                           # interrupt
    async for item in gen: ...                   # rtc.AudioFrame | rtc.VideoFrame | AudioSegmentEnd

In: each frame is mixed to mono and resampled to the model's rate (LiveKit's own resampler), then
offered to the session's speech queue. A resampler holds back its last ~10 ms until it sees what
follows; it is flushed (and the next frame starts a fresh one) at the end of an utterance and when
no audio has arrived for `flush_after_s` (an agent whose TTS pauses), so no speech waits behind a
pause. Offering never blocks the event loop; while the queue is full (the agent sends
faster than real time) the frame waits, and an interrupt in the meantime drops it.

Out: the session publishes on one timeline (video frame i at i / fps, audio sample s at s / rate)
through `_Outbox`, a sink that hands the items and the session's speech markers to the event
loop in publishing order. While the avatar talks, each video frame is preceded by exactly its
40 ms of audio (samples [i, i + 1) * rate / fps, as int16 frames at the model's rate): the
runner's AV synchroniser then plays them together. While it listens, only video is yielded
(idle frames; no audio, so LiveKit's playback position counts speech only).

End of speech: `AudioSegmentEnd` is yielded after the last frame of the utterance the agent
completed (the session's `speech_ended` marker, which comes after that segment's last frame),
or at once if everything it sent has already been spoken. An interrupted utterance yields none:
the runner reports the interruption itself. Two utterances sent back to back without a pause are
spoken as one segment: one AudioSegmentEnd comes, after the second (LiveKit's AvatarRunner
reports only one of two overlapping utterances in any case; docs/livekit.md).

Every item's media time is kept: `AudioFrame.userdata["pts"]` and `video_pts` (the media time of
the video frame yielded last).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import AudioSegmentEnd, VideoGenerator

from avatarstream.live.session import LiveSession
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.serve.livekit.host import AvatarHost


@dataclass(frozen=True)
class _Start:
    frame: int  # the utterance's first video frame


@dataclass(frozen=True)
class _End:  # the utterance's last frame has been published
    segment_end: bool  # yield AudioSegmentEnd (the agent's utterance is all spoken)


class _Closed:  # the session ended: nothing follows
    pass


_CLOSED = _Closed()
Item = tuple[str, int, np.ndarray] | _Start | _End | _Closed


class _Outbox:
    """A sink (and marker queue) from the scheduler's threads to one event loop, in order.

    Bounded: past `max_items` the oldest item is dropped (counted), so a reader that stops (a
    room nobody subscribes to yet) never holds generation up."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_items: int = 2000) -> None:
        self.loop, self.max_items = loop, max_items
        self.items: deque[Item] = deque()
        self.durable_frames = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._ready = asyncio.Event()

    def put(self, item: Item) -> None:
        with self._lock:
            if len(self.items) >= self.max_items:
                self.items.popleft()
                self.dropped += 1
            self.items.append(item)
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop is closed: nobody reads any more
            pass

    async def get(self) -> Item:
        while True:
            with self._lock:
                if self.items:
                    return self.items.popleft()
                self._ready.clear()
            await self._ready.wait()

    # -- Sink ------------------------------------------------------------------------------------
    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        pass

    def write_video(self, chunk: VideoChunk) -> None:
        self.put(("video", chunk.start_frame, chunk.frames))
        self.durable_frames += len(chunk.frames)

    def write_audio(self, chunk: AudioChunk) -> None:
        self.put(("audio", chunk.start_sample, np.asarray(chunk.samples, np.float32)))

    def close(self) -> None:
        self.put(_CLOSED)

    def abort(self) -> None:
        self.close()


class _Timeline:
    """The session's audio, kept by sample index until its video frame takes it."""

    def __init__(self) -> None:
        self.pieces: deque[tuple[int, np.ndarray]] = deque()

    def add(self, start: int, samples: np.ndarray) -> None:
        self.pieces.append((start, samples))

    def take(self, a: int, b: int) -> np.ndarray:
        """Samples [a, b) (zeros where none were published); drops everything before b."""
        out = np.zeros(b - a, np.float32)
        while self.pieces:
            start, x = self.pieces[0]
            end = start + x.size
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                out[lo - a : hi - a] = x[lo - start : hi - start]
            if end > b:
                break
            self.pieces.popleft()
        return out


def to_mono_int16(frame: rtc.AudioFrame) -> np.ndarray:
    """The frame's samples as int16 mono [N] (channels averaged)."""
    x = np.frombuffer(frame.data, np.int16)
    if frame.num_channels > 1:
        x = x.reshape(-1, frame.num_channels).mean(axis=1).round().astype(np.int16)
    return x


class SessionVideoGenerator(VideoGenerator):
    def __init__(self, host: AvatarHost, *, poll_s: float = 0.02, flush_after_s: float = 0.1) -> None:
        """Open a session for one room on `host` (AdmissionError if it cannot be served)."""
        c = host.models.config
        self.fps, self.sample_rate = c.fps, c.sample_rate
        self.spf = c.sample_rate // c.fps
        self.poll_s, self.flush_after_s = poll_s, flush_after_s
        self._flush_timer: asyncio.TimerHandle | None = None
        self._feed_lock = asyncio.Lock()
        self._tasks: set[asyncio.Future] = set()
        self.video_pts: float | None = None
        self._outbox = _Outbox(asyncio.get_running_loop())
        self._lock = threading.Lock()  # the end-of-speech bookkeeping (loop and scheduler threads)
        self._in_segment = False
        self._end_pending = False
        self._epoch = 0  # bumped by clear_buffer: audio waiting to be queued is dropped
        self._resampler: rtc.AudioResampler | None = None
        self._resampler_rate = 0
        self.session: LiveSession = host.open(sinks=[self._outbox], on_event=self._on_event)

    @property
    def dropped(self) -> int:
        """Items the reader missed because it stopped reading (the outbox is bounded)."""
        return self._outbox.dropped

    # -- in --------------------------------------------------------------------------------------
    async def push_audio(self, frame: rtc.AudioFrame | AudioSegmentEnd) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if isinstance(frame, AudioSegmentEnd):
            await self._flush_resampler()
            self._request_end()
            return
        x = to_mono_int16(frame)
        if self._resampler is not None and self._resampler_rate != frame.sample_rate:
            await self._flush_resampler()  # the agent changed its rate
        if frame.sample_rate != self.sample_rate:
            if self._resampler is None:
                self._resampler = rtc.AudioResampler(frame.sample_rate, self.sample_rate,
                                                     quality=rtc.AudioResamplerQuality.HIGH)
                self._resampler_rate = frame.sample_rate
            mono = rtc.AudioFrame(x.tobytes(), frame.sample_rate, 1, x.size)
            x = self._resampled(self._resampler.push(mono))
        await self._feed(x)
        if self._resampler is not None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                self.flush_after_s, self._flush_later)

    def _flush_later(self) -> None:
        task = asyncio.ensure_future(self._flush_resampler())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush_resampler(self) -> None:
        """Queue what the resampler holds back; the next frame starts a fresh one."""
        r, self._resampler = self._resampler, None
        if r is not None:
            await self._feed(self._resampled(r.flush()))

    @staticmethod
    def _resampled(frames: list[rtc.AudioFrame]) -> np.ndarray:
        if not frames:
            return np.zeros(0, np.int16)
        return np.concatenate([np.frombuffer(f.data, np.int16) for f in frames])

    async def _feed(self, x: np.ndarray) -> None:
        """Queue int16 samples at the model's rate: at once if they fit, else when they do."""
        if not x.size:
            return
        samples = x.astype(np.float32) / 32768.0  # as PCM16 is read everywhere (pcm16_to_float)
        epoch = self._epoch
        async with self._feed_lock:  # in call order: a flushed tail never overtakes or lags
            while self.session.running and epoch == self._epoch:
                if self.session.offer_audio(samples):
                    return
                await asyncio.sleep(self.poll_s)

    def _request_end(self) -> None:
        with self._lock:
            self.session.end_of_speech()
            if self._in_segment or self.session.queue.buffered:
                self._end_pending = True  # yielded at the segment's end
            else:  # all of it was spoken already
                self._outbox.put(_End(True))

    def clear_buffer(self) -> None:
        """Interrupt: the queued speech is dropped; the avatar stops within one chunk."""
        self._epoch += 1
        self._resampler = None
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        with self._lock:
            self._end_pending = False
        self.session.clear_buffer()

    def _on_event(self, event: dict) -> None:  # the scheduler thread
        kind = event["type"]
        if kind == "speech_started":
            with self._lock:
                self._in_segment = True
                self._outbox.put(_Start(event["frame"]))
        elif kind == "speech_ended":
            with self._lock:
                self._in_segment = False
                done = (self._end_pending and not event["interrupted"]
                        and not self.session.queue.buffered)
                if done or event["interrupted"]:
                    self._end_pending = False
                self._outbox.put(_End(done))

    # -- out -------------------------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        audio = _Timeline()
        talk_from: int | None = None  # first frame of the utterance being spoken
        while True:
            item = await self._outbox.get()
            if item is _CLOSED:
                return
            if isinstance(item, _Start):
                talk_from = item.frame
            elif isinstance(item, _End):
                talk_from = None
                if item.segment_end:
                    yield AudioSegmentEnd()
            elif isinstance(item, tuple) and item[0] == "audio":
                audio.add(item[1], item[2])
            elif isinstance(item, tuple):
                _, start, frames = item
                for i, rgb in enumerate(frames):
                    n = start + i
                    pcm = audio.take(n * self.spf, (n + 1) * self.spf)
                    if talk_from is not None and n >= talk_from:
                        yield self._audio_frame(pcm, n * self.spf)
                    self.video_pts = n / self.fps
                    yield rtc.VideoFrame(rgb.shape[1], rgb.shape[0], rtc.VideoBufferType.RGB24,
                                         np.ascontiguousarray(rgb).tobytes())

    def _audio_frame(self, samples: np.ndarray, start: int) -> rtc.AudioFrame:
        pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)
        return rtc.AudioFrame(pcm.tobytes(), self.sample_rate, 1, pcm.size,
                              userdata={"pts": start / self.sample_rate})

    async def aclose(self) -> None:
        """End the session (its scheduler slot is freed)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        await asyncio.to_thread(self.session.stop, 10.0)
