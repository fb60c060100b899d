"""AvatarstreamVideoService: the avatar as a Pipecat video service, the model in the agent's process.

    from avatarstream.integrations.pipecat import AvatarstreamVideoService

    avatar = AvatarstreamVideoService(avatar="face.jpg")        # model: the registry's default
    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts, avatar,
                         transport.output(), assistant_agg])

It sits where Pipecat's Tavus, Simli and HeyGen services sit, after the TTS and before the output
transport, and takes the same frames:
- `TTSAudioRawFrame` (any rate, any channels): mixed to mono, resampled to the model's 16 kHz
  (soxr, a stream per utterance, flushed at its end) and queued in the service's live session; the
  frame itself goes no further. `TTSStartedFrame` passes; `TTSStoppedFrame` ends the utterance and
  is passed on after the utterance's last frame (so the transport's "bot stopped speaking" comes
  when the face stops, not when the TTS did).
- `InterruptionFrame`: the queued speech is dropped; the session stops speaking within one chunk.
- `UserStartedSpeakingFrame` / `UserStoppedSpeakingFrame`: the listening state (`listening`), and
  passed on. With no speech queued the session shows its idle frames: the reference's closed mouth
  with small natural motion (live/idle.py), no model call and no audio. So while the user speaks
  the avatar listens, alive, and it speaks again from the next frame when speech is queued.
  Speech already queued when the user starts still plays: whether the user interrupts the agent
  is the agent stack's decision, and it says so with an `InterruptionFrame`.
- everything else passes through.

Out: one `OutputImageRawFrame` (RGB, the model's size) per video frame at the model's fps, each
with `sync_with_audio` set (the output transport shows it in its audio queue's order). While the
avatar speaks, each image is followed by that frame's speech as a `TTSAudioRawFrame` at 16 kHz
(640 samples at 25 fps: the session's copy, the agent's 16 kHz samples bit for bit; the transport
resamples to its own rate). Audio is never pushed before its frame exists, so the transport plays
them together. While it listens, images only, released at their media time (the session renders
up to `lead_s` ahead).

Several services in one process share one host per (model, avatar, device): one model, one
scheduler batching every pipeline's chunks (`local.acquire_host`), or pass `host=` yourself.

Remote mode, `AvatarstreamVideoService(url="http://gpu-box:8000", avatar="face.jpg",
api_key=KEY)` (or `avatar_id=` of one uploaded before): the model runs in an `avatarstream serve`
(`remote.RemoteStream`: a session through its API, the speech over its WebSocket, the video and
the session's audio back over WebRTC). The same frames come out; the audio is the server's copy
as WebRTC carries it (Opus, resampled to 16 kHz), and every frame comes at its playout time.

Metrics, the Pipecat way (`PipelineParams(enable_metrics=True)`): TTFB from the utterance's first
`TTSAudioRawFrame` in to its first speaking video frame out; processing time from that same audio
frame to the utterance's last frame out. `ttfb_s` keeps the TTFBs measured.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.errors import ConfigError, InputError
from avatarstream.integrations.local import Frame, SegmentEnd, SessionStream, acquire_host, release_host
from avatarstream.integrations.pacing import Pacer

try:
    import soxr
    from pipecat.frames.frames import (CancelFrame, EndFrame, InterruptionFrame, OutputImageRawFrame,
                                       StartFrame, TTSAudioRawFrame, TTSStoppedFrame,
                                       UserStartedSpeakingFrame, UserStoppedSpeakingFrame)
    from pipecat.frames.frames import Frame as PipecatFrame
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.ai_service import AIService
    from pipecat.services.settings import ServiceSettings
except ImportError as e:  # the extra is not installed: one line that says what to do
    raise ConfigError(f"the Pipecat video service needs pipecat-ai ({e.name or e} is missing): "
                      "pip install 'avatarstream[pipecat]'") from None

__all__ = ["AvatarstreamVideoService"]

POLL_S = 0.02  # while the session's speech buffer is full, retry this often


class AvatarstreamVideoService(AIService):
    def __init__(self, *, model: str | None = None, avatar: str | Path | None = None,
                 device: str = "cpu", max_sessions: int | None = None,
                 seconds_per_chunk: float | None = None, lead_s: float = 0.3,
                 host: Any = None, url: str | None = None, api_key: str = "avatarstream-pipecat",
                 avatar_id: str | None = None, video_out_framerate: int | None = None,
                 **kwargs: Any) -> None:
        """model: a registered model name (default: the bundled model); avatar: an image or video
        of the person (default: a drawn test face); max_sessions: the shared host's admission
        (None: measured at start, as `serve` does: a minute or so); host: an already started
        `AvatarHost` to open the session on (model/avatar/device are then ignored).
        Remote mode: url of an `avatarstream serve`, api_key its bearer key (any name on a
        server without keys; never logged), avatar a file to upload or avatar_id one uploaded
        with the same key; the server's model is used (model/device/host are ignored).
        video_out_framerate: for a transport with `video_out_is_live=True` and this
        `video_out_framerate` (30 for SmallWebRTCTransport): the images go out on one clock
        with the speech, one per slot at this rate (`pacing.Pacer`). None: each image as soon
        as it is made, marked `sync_with_audio`, for `video_out_is_live=False`.
        Raises ConfigError for an unknown model or a URL that is not http(s), InputError for an
        avatar file that is not there or a remote service without an avatar."""
        from avatarstream.registry import resolve_model

        if avatar is not None and not Path(avatar).is_file():
            raise InputError(f"avatar file not found: {avatar}")
        if url is not None:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"url must be the server's http(s) address, e.g. "
                                  f"http://127.0.0.1:8000 (got {url!r})")
            if avatar is None and avatar_id is None:
                raise InputError("a remote avatar needs avatar= (a file to upload) or avatar_id=")
            name = "remote"
        else:
            name = host.models.name if host is not None else resolve_model(model)
        if video_out_framerate is not None and not 1 <= video_out_framerate <= 120:
            raise ConfigError(f"video_out_framerate must be the transport's frame rate, 1 to 120 "
                              f"(got {video_out_framerate})")
        super().__init__(settings=ServiceSettings(model=name), **kwargs)
        self._rate = video_out_framerate
        self._pacer: Pacer | None = None
        self._last_image: Frame | None = None  # the last image pushed, paced
        self._remote = None if url is None else dict(url=url, api_key=api_key, avatar_id=avatar_id,
                                                     avatar=None if avatar is None else Path(avatar))
        self._host_args = dict(model=name, avatar=avatar, device=device, max_sessions=max_sessions,
                               seconds_per_chunk=seconds_per_chunk, lead_s=lead_s)
        self._given_host = host
        self._host: Any = None
        self._stream: Any = None  # SessionStream | RemoteStream
        self._out_task: asyncio.Task | None = None
        self._resampler: soxr.ResampleStream | None = None
        self._in_rate = 0
        self._measuring = False  # an utterance's TTFB / processing time is being measured
        self._waiting_first_frame = False
        self._first_in = 0.0
        self._held_stop: PipecatFrame | None = None  # TTSStoppedFrame, passed after the last frame
        self.listening = False
        self.ttfb_s: list[float] = []
        self.frames_out = 0

    def can_generate_metrics(self) -> bool:
        return True

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        if self._remote is not None:
            from avatarstream.integrations.remote import RemoteStream

            stream = RemoteStream(**self._remote)
            await stream.open()
            self._stream = stream
            self._out_task = self.create_task(self._output())
            return
        if self._given_host is not None:
            self._host = self._given_host
        else:  # loads the model on first use in this process: off the event loop
            self._host = await asyncio.to_thread(lambda: acquire_host(**self._host_args))
        self._stream = SessionStream(self._host, asyncio.get_running_loop())
        self._out_task = self.create_task(self._output())

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)
        await self._close()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._close()

    async def cleanup(self) -> None:
        await super().cleanup()
        await self._close()

    async def _close(self) -> None:
        """End the session, the output task and (the last user) the shared host. Idempotent."""
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()
        if self._out_task is not None:
            await self.cancel_task(self._out_task)
            self._out_task = None
        host, self._host = self._host, None
        if host is not None and self._given_host is None:
            await asyncio.to_thread(release_host, host)

    @property
    def session(self) -> Any:
        """The live session (None before the pipeline starts or after it ends)."""
        return None if self._stream is None else self._stream.session

    # -- in --------------------------------------------------------------------------------------
    async def process_frame(self, frame: PipecatFrame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            await self._audio_in(frame)
        elif isinstance(frame, TTSStoppedFrame):
            await self._feed(self._flush())
            await self._end_utterance(frame, direction)
        elif isinstance(frame, InterruptionFrame):
            await self._interrupt()
            await self.push_frame(frame, direction)
            if self._last_image is not None:
                # Pipecat's output restarts its live video task on an interruption, and the
                # image that task holds (waiting for its slot) is lost: one image again keeps
                # the transport's frame count, and so its video clock, on the media clock.
                await self._push_image(self._last_image, sync_with_audio=False)
        elif isinstance(frame, UserStartedSpeakingFrame):
            # The user's turn. Speech already queued still plays (the agent stack decides whether
            # to interrupt it: InterruptionFrame); with none queued the session idles: listening.
            self.listening = True
            if self._stream is not None:
                await self._stream.listen(True)
            await self.push_frame(frame, direction)
        elif isinstance(frame, UserStoppedSpeakingFrame):
            self.listening = False
            if self._stream is not None:
                await self._stream.listen(False)
            await self.push_frame(frame, direction)
        else:  # TTSStartedFrame and everything else
            await self.push_frame(frame, direction)

    async def _audio_in(self, frame: TTSAudioRawFrame) -> None:
        if self._stream is None:
            return
        if not self._measuring:
            self._measuring, self._waiting_first_frame = True, True
            self._first_in = time.monotonic()
            await self.start_ttfb_metrics()
            await self.start_processing_metrics()
        # float32 as PCM16 is read everywhere (pcm16_to_float); channels averaged
        x = np.frombuffer(frame.audio, np.int16).astype(np.float32) / 32768.0
        if frame.num_channels > 1:
            x = x.reshape(-1, frame.num_channels).mean(axis=1)
        if self._resampler is not None and self._in_rate != frame.sample_rate:
            await self._feed(self._flush())  # the TTS changed its rate: a new stream
        rate = self._stream.sample_rate
        if frame.sample_rate == rate:
            await self._feed(x)
            return
        if self._resampler is None:
            # float32: soxr's int16 output is dithered (not reproducible), float32 is exact
            self._resampler = soxr.ResampleStream(frame.sample_rate, rate, 1, dtype="float32",
                                                  quality="HQ")
            self._in_rate = frame.sample_rate
        await self._feed(self._resampler.resample_chunk(x))

    def _flush(self) -> np.ndarray:
        """What the resampler holds back (the utterance's last few ms); the next audio starts a
        fresh stream."""
        r, self._resampler = self._resampler, None
        empty = np.zeros(0, np.float32)
        return empty if r is None else r.resample_chunk(empty, last=True)

    async def _feed(self, x: np.ndarray) -> None:
        """Queue float32 16 kHz samples in the session: at once if they fit, else when they do (the
        TTS runs ahead of real time; an interrupt cancels the wait with this frame's processing)."""
        stream = self._stream
        if stream is None or not x.size:
            return
        while stream.running and not await stream.offer(x):
            await asyncio.sleep(POLL_S)

    async def _end_utterance(self, frame: PipecatFrame, direction: FrameDirection) -> None:
        """The TTS finished: the session plays out what is queued; the stop frame goes downstream
        after the utterance's last frame (at once if it has all been shown)."""
        stream = self._stream
        if stream is None:
            await self.push_frame(frame, direction)
            return
        await stream.end_of_speech()
        held, self._held_stop = self._held_stop, None
        if held is not None:  # two stops without a segment end between them: let the first go
            await self.push_frame(held, direction)
        if await stream.more_to_come(talking=True) or self._pacer_holds_speech():
            self._held_stop = frame
        else:
            self._measuring = False
            await self.push_frame(frame, direction)

    def _pacer_holds_speech(self) -> bool:
        return self._pacer is not None and self._pacer.speech_pending

    async def _interrupt(self) -> None:
        self._resampler = None
        if self._pacer is not None:
            self._pacer.clear_speech(time.monotonic())
        if self._stream is not None:
            await self._stream.clear()
        self._measuring = self._waiting_first_frame = False
        held, self._held_stop = self._held_stop, None
        if held is not None:
            await self.push_frame(held)

    # -- out -------------------------------------------------------------------------------------
    async def _output(self) -> None:
        """Push the session's frames (and their speech) downstream as they are made."""
        stream = self._stream
        assert stream is not None
        if self._rate is not None:
            await self._paced_output(stream)
            return
        async for item in stream:
            if isinstance(item, SegmentEnd):
                await self._segment_end(item)
                continue
            assert isinstance(item, Frame)
            if item.pcm is None and not stream.paced:  # listening: release at its media time
                delay = stream.origin + item.index / stream.fps - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            await self._push_image(item, sync_with_audio=True)
            if item.pcm is not None:
                await self._push_speech(item)

    async def _push_image(self, item: Frame, *, sync_with_audio: bool) -> None:
        assert self._stream is not None
        image = OutputImageRawFrame(image=np.ascontiguousarray(item.rgb).tobytes(),
                                    size=self._stream.size, format="RGB")
        image.sync_with_audio = sync_with_audio
        if not sync_with_audio:
            self._last_image = item
        image.metadata["avatarstream_frame"] = item.index  # its media time: index / fps
        await self.push_frame(image)
        self.frames_out += 1

    async def _push_speech(self, item: Frame) -> None:
        assert self._stream is not None and item.pcm is not None
        if self._waiting_first_frame:
            self._waiting_first_frame = False
            self.ttfb_s.append(time.monotonic() - self._first_in)
            await self.stop_ttfb_metrics()
        audio = TTSAudioRawFrame(audio=item.pcm.tobytes(), sample_rate=self._stream.sample_rate,
                                 num_channels=1)
        audio.metadata["avatarstream_frame"] = item.index
        await self.push_frame(audio)

    async def _paced_output(self, stream: Any) -> None:
        """The frames on one clock with the speech (`pacing.Pacer`): a reader takes the
        session's output as it is made, this loop pushes what is due, one image per slot."""
        origin = stream.origin if isinstance(stream, SessionStream) else None
        pacer = self._pacer = Pacer(stream.fps, self._rate, origin)
        wake = asyncio.Event()

        async def read() -> None:
            async for item in stream:
                pacer.add(item, time.monotonic())
                wake.set()
            wake.set()

        reader = self.create_task(read())
        try:
            while not reader.done():
                for kind, item in pacer.step(time.monotonic()):
                    if kind == "image":
                        await self._push_image(item, sync_with_audio=False)
                    elif kind == "audio":
                        await self._push_speech(item)
                    else:
                        await self._segment_end(item)
                wait = pacer.next_time(time.monotonic()) - time.monotonic()
                if wait > 0:
                    wake.clear()
                    try:
                        await asyncio.wait_for(wake.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
        finally:
            await self.cancel_task(reader)

    async def _segment_end(self, end: SegmentEnd) -> None:
        stream = self._stream
        if self._measuring and not end.interrupted:
            await self.stop_processing_metrics()
        if self._held_stop is not None and (stream is None or not (
                await stream.more_to_come(talking=False) or self._pacer_holds_speech())):
            stop, self._held_stop = self._held_stop, None
            self._measuring = False
            await self.push_frame(stop)
