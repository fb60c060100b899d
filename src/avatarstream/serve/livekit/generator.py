"""SessionVideoGenerator: LiveKit Agents' `VideoGenerator` over one live session.

    gen = SessionVideoGenerator(host)           # opens (admits) a session on the host's scheduler
    await gen.push_audio(rtc.AudioFrame)         # the agent's speech, any rate, any channels
    # (SessionVideoGenerator(host, sample_rate=48000): the rate of the audio yielded)
    await gen.push_audio(AudioSegmentEnd())      # the utterance is complete
    gen.clear_buffer()                           # interrupt
    async for item in gen: ...                   # rtc.AudioFrame | rtc.VideoFrame | AudioSegmentEnd

In: each frame is mixed to mono and resampled to the model's rate (LiveKit's own resampler), then
offered to the session's speech queue. A resampler holds back its last tens of ms until it sees
what follows; it is flushed (and the next frame starts a fresh one) at the end of an utterance and
when no audio has arrived for `flush_after_s` (an agent whose TTS pauses), so no speech waits
behind a pause. Offering never blocks the event loop; while the queue is full (the agent sends
faster than real time) the frame waits, and an interrupt in the meantime drops it.

Out: the session publishes on one timeline (video frame i at i / fps, audio sample s at s / 16000)
through `_Outbox`, a sink that hands the items and the session's speech markers to the event
loop in publishing order. The audio yielded is not the session's 16 kHz copy but the agent's own
audio at the output rate (`sample_rate`: the room's; by default the rate of the agent's first
frame, later utterances at another rate resampled to it), placed where the session put the
16 kHz copy of the same samples (audio.py: the queue's mirror; a span it cannot vouch for is the
16 kHz audio upsampled, counted in `fallback_samples`). Session sample s is output sample
s * rate / 16000, exactly at every frame boundary. While the avatar talks, each video frame is
preceded by exactly its 40 ms of audio (rate / 25 samples: 960 at 24 kHz, 1920 at 48 kHz): the
runner's AV synchroniser then plays them together. While it listens, only video is yielded
(idle frames; no audio, so LiveKit's playback position counts speech only). An interrupt
(`clear_buffer`) drops both copies at the same place: what the session took is heard, nothing
after it.

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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import AudioSegmentEnd, VideoGenerator

from avatarstream.live.session import LiveSession
from avatarstream.live.speech import SpeechQueue
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.serve.livekit.audio import AgentAudio, Run, Timeline
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
Placer = Callable[[AudioChunk], tuple[int, np.ndarray] | None]


class _Outbox:
    """A sink (and marker queue) from the scheduler's threads to one event loop, in order.

    Bounded: past `max_items` the oldest item is dropped (counted), so a reader that stops (a
    room nobody subscribes to yet) never holds generation up."""

    def __init__(self, loop: asyncio.AbstractEventLoop, place: Placer, max_items: int = 2000) -> None:
        self.loop, self.place, self.max_items = loop, place, max_items
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
        placed = self.place(chunk)  # the room's audio for it: (output position, int16 samples)
        if placed is not None:
            self.put(("audio", *placed))

    def close(self) -> None:
        self.put(_CLOSED)

    def abort(self) -> None:
        self.close()


def to_mono_int16(frame: rtc.AudioFrame) -> np.ndarray:
    """The frame's samples as int16 mono [N] (channels averaged)."""
    x = np.frombuffer(frame.data, np.int16)
    if frame.num_channels > 1:
        x = x.reshape(-1, frame.num_channels).mean(axis=1).round().astype(np.int16)
    return x


class SessionVideoGenerator(VideoGenerator):
    def __init__(self, host: AvatarHost, *, sample_rate: int | None = None, poll_s: float = 0.02,
                 flush_after_s: float = 0.1) -> None:
        """Open a session for one room on `host` (AdmissionError if it cannot be served).
        sample_rate: the rate of the audio yielded (the room's audio source); None: the rate of
        the first audio the agent sends."""
        c = host.models.config
        self.fps, self.sample_rate = c.fps, c.sample_rate
        self.spf = c.sample_rate // c.fps
        self.poll_s, self.flush_after_s = poll_s, flush_after_s
        self._flush_timer: asyncio.TimerHandle | None = None
        self._feed_lock = asyncio.Lock()
        self._tasks: set[asyncio.Future] = set()
        self.video_pts: float | None = None
        self._agent = AgentAudio(c.sample_rate, sample_rate)
        self._run: Run | None = None  # the agent's audio since the resamplers were last flushed
        self._speech: SpeechQueue | None = None
        self._outbox = _Outbox(asyncio.get_running_loop(), self._place)
        self._lock = threading.Lock()  # the end-of-speech bookkeeping (loop and scheduler threads)
        self._in_segment = False
        self._end_pending = False
        self._epoch = 0  # bumped by clear_buffer: audio waiting to be queued is dropped
        self.session: LiveSession = host.open(sinks=[self._outbox], on_event=self._on_event)
        self._speech = self.session.queue

    @property
    def dropped(self) -> int:
        """Items the reader missed because it stopped reading (the outbox is bounded)."""
        return self._outbox.dropped

    @property
    def fallback_samples(self) -> int:
        """16 kHz samples the room heard upsampled, not as the agent sent them (audio.py)."""
        return self._agent.fallback_samples

    # -- in --------------------------------------------------------------------------------------
    async def push_audio(self, frame: rtc.AudioFrame | AudioSegmentEnd) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if isinstance(frame, AudioSegmentEnd):
            await self._end_run()
            self._request_end()
            return
        if self._run is not None and self._run.rate != frame.sample_rate:
            await self._end_run()  # the agent changed its rate
        if self._run is None:
            self._run = self._agent.run(frame.sample_rate)
        run = self._run
        await self._feed(run, *run.push(to_mono_int16(frame)))
        if run.holds_back and run is self._run:
            self._flush_timer = asyncio.get_running_loop().call_later(
                self.flush_after_s, self._flush_later)

    def _flush_later(self) -> None:
        task = asyncio.ensure_future(self._end_run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _end_run(self) -> None:
        """Queue what the resamplers hold back; the next frame starts a new run."""
        run, self._run = self._run, None
        if run is not None:
            await self._feed(run, *run.flush())

    async def _feed(self, run: Run, k0: int, x: np.ndarray) -> None:
        """Queue int16 samples at the model's rate (16 kHz samples k0.. of `run`): at once if
        they fit, else when they do. The mirror notes them first: the scheduler may take them
        as soon as they are queued."""
        if not x.size:
            return
        samples = x.astype(np.float32) / 32768.0  # as PCM16 is read everywhere (pcm16_to_float)
        epoch = self._epoch
        async with self._feed_lock:  # in call order: a flushed tail never overtakes or lags
            while self.session.running and epoch == self._epoch:
                self._agent.reserve(run, k0, x)
                if self.session.offer_audio(samples):
                    return
                self._agent.cancel()
                await asyncio.sleep(self.poll_s)

    def _place(self, chunk: AudioChunk) -> tuple[int, np.ndarray] | None:  # the scheduler thread
        taken = 0 if self._speech is None else self._speech.taken  # None: still opening
        return self._agent.place(chunk, taken)

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
        self._run = None
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        with self._lock:
            self._end_pending = False
        self.session.clear_buffer()
        # the queue is empty now and only this thread fills it: `taken` is where it was cut
        self._agent.cleared(self.session.queue.taken)

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
        audio = Timeline()
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
                    a, b = (self._agent.out_index(f * self.spf) for f in (n, n + 1))
                    pcm = audio.take(a, b)
                    if talk_from is not None and n >= talk_from:
                        yield self._audio_frame(pcm, a)
                    self.video_pts = n / self.fps
                    yield rtc.VideoFrame(rgb.shape[1], rgb.shape[0], rtc.VideoBufferType.RGB24,
                                         np.ascontiguousarray(rgb).tobytes())

    def _audio_frame(self, pcm: np.ndarray, start: int) -> rtc.AudioFrame:
        rate = self._agent.out_rate or self.sample_rate
        return rtc.AudioFrame(pcm.tobytes(), rate, 1, pcm.size, userdata={"pts": start / rate})

    async def aclose(self) -> None:
        """End the session (its scheduler slot is freed)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        await asyncio.to_thread(self.session.stop, 10.0)
