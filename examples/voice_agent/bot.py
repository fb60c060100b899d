"""The voice agent's pipeline: offline speech in, a rule-based reply, offline speech out, our avatar.

    transport.input() -> PocketsphinxSTTService -> user aggregator (Silero VAD, turns)
        -> RuleBasedLLM -> EspeakTTSService -> AvatarstreamVideoService -> AvProbe
        -> transport.output() -> assistant aggregator

Everything runs on this machine without a network or torch:
- speech to text: PocketSphinx (`pocketsphinx` from PyPI; its US English model is inside the
  wheel), wrapped as a Pipecat `SegmentedSTTService` (Pipecat transcribes each VAD segment);
- voice activity: Pipecat's Silero VAD (onnxruntime; the model ships inside pipecat-ai);
- text to speech: espeak-ng through avatarstream's own synthesiser (`media/tts.py`), as a Pipecat
  `TTSService`;
- the "LLM": `RuleBasedLLM`, canned replies chosen by keywords. To use a real one, replace it by
  any Pipecat LLM service (one line in `build_pipeline`).

`AvProbe` (after the avatar) keeps a record of what the avatar put out, for the demo's status
endpoint and the browser test. With `beep=True` the TTS starts every sentence (after two frames
of silence) with a 60 ms 1 kHz tone and pads it to whole video frames, and the probe paints a white square into the top
left corner of the video frame that carries the tone's first sample: the browser then measures
the audio/video offset as played, per sentence.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADParams
from pipecat.frames.frames import (Frame, InterruptionFrame, LLMContextFrame, LLMFullResponseEndFrame,
                                   LLMFullResponseStartFrame, LLMTextFrame, OutputImageRawFrame,
                                   TranscriptionFrame, TTSAudioRawFrame, TTSStartedFrame,
                                   TTSStoppedFrame, UserStartedSpeakingFrame,
                                   UserStoppedSpeakingFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (LLMContextAggregatorPair,
                                                                   LLMUserAggregatorParams)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.settings import STTSettings, TTSSettings
from pipecat.services.stt_service import SegmentedSTTService
from pipecat.services.tts_service import TTSService
from pipecat.transports.base_transport import TransportParams
from pipecat.turns.user_stop.speech_timeout_user_turn_stop_strategy import \
    SpeechTimeoutUserTurnStopStrategy
from pipecat.turns.user_turn_strategies import UserTurnStrategies

from avatarstream.integrations.pipecat import AvatarstreamVideoService

RATE = 16000  # PocketSphinx's and espeak's (resampled) rate; the avatar's too
BEEP_HZ, BEEP_S, BEEP_AMP = 1000.0, 0.06, 0.5
FRAME_SAMPLES = 640  # one video frame of audio at 16 kHz and 25 fps


# -- speech to text --------------------------------------------------------------------------------
class PocketsphinxSTTService(SegmentedSTTService):
    """PocketSphinx (CMU Sphinx, BSD) on each utterance Pipecat cut out with its VAD. Small and
    fast on a CPU, and its model comes with the package; accuracy is modest (it mishears a lot),
    which a keyword-matching stand-in LLM forgives. It decodes in a worker process
    (stt_worker.py): in this one it would hold the GIL, and stall the WebRTC sending, for the
    whole decode."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(sample_rate=RATE, settings=STTSettings(model="en-us", language=None),
                         ttfs_p99_latency=0.5, **kwargs)
        import stt_worker

        self._worker = stt_worker
        self._pool = stt_worker.pool()  # started now, so the first turn does not wait for it

    @property
    def wants_wav_segments(self) -> bool:
        return False  # raw PCM16 mono at 16 kHz, what the decoder reads

    def can_generate_metrics(self) -> bool:
        return True

    async def run_stt(self, audio: bytes) -> AsyncGenerator[Frame, None]:
        await self.start_processing_metrics()
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(self._pool, self._worker.decode, audio)
        await self.stop_processing_metrics()
        if text:
            yield TranscriptionFrame(text, self._user_id, time.strftime("%Y-%m-%dT%H:%M:%S"))


# -- text to speech --------------------------------------------------------------------------------
def beep() -> np.ndarray:
    """The marker tone: 60 ms of 1 kHz with 2 ms ramps, float32 at 16 kHz."""
    t = np.arange(int(BEEP_S * RATE)) / RATE
    x = BEEP_AMP * np.sin(2 * np.pi * BEEP_HZ * t)
    ramp = int(0.002 * RATE)
    x[:ramp] *= np.linspace(0, 1, ramp)
    x[-ramp:] *= np.linspace(1, 0, ramp)
    return x.astype(np.float32)


class EspeakTTSService(TTSService):
    """espeak-ng (the voices avatarstream's own text front end speaks with), 16 kHz mono.
    `beep`: each sentence starts with two frames of silence and the marker tone, and is padded
    to whole video frames, so
    back-to-back sentences keep the tone on a frame boundary (the A/V measurement)."""

    def __init__(self, *, voice: str = "espeak:en-us+f2", beep: bool = False, **kwargs: Any) -> None:
        super().__init__(push_start_frame=True, push_stop_frames=True, sample_rate=RATE,
                         settings=TTSSettings(model=None, voice=voice, language=None), **kwargs)
        from avatarstream.media.tts import TextToSpeech

        self._tts = TextToSpeech()
        self._voice = voice
        self._beep = beep

    def can_generate_metrics(self) -> bool:
        return True

    def _speak(self, text: str) -> np.ndarray:
        x = self._tts.speak(text, self._voice)
        if self._beep:  # the tone a few frames in: its frame's speech goes out before the image
            pause = np.zeros(2 * FRAME_SAMPLES, np.float32)
            x = np.concatenate([pause, beep(), pause, x])
            x = np.pad(x, (0, -x.size % FRAME_SAMPLES))
        return x

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        if not text.strip():
            return
        await self.start_tts_usage_metrics(text)
        x = await asyncio.to_thread(self._speak, text)
        await self.stop_ttfb_metrics()
        pcm = np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)
        step = RATE // 50  # 20 ms frames, as streaming TTS services emit
        for i in range(0, pcm.size, step):
            yield TTSAudioRawFrame(audio=pcm[i : i + step].tobytes(), sample_rate=RATE,
                                   num_channels=1, context_id=context_id)


# -- the "LLM" -------------------------------------------------------------------------------------
RULES: list[tuple[str, list[str]]] = [
    (r"\b(hello|hi|hey)\b", ["Hello! It is nice to meet you.", "I am a face that runs on this "
                             "computer.", "Ask me anything you like."]),
    (r"\b(weather|rain|sun)\b", ["I cannot look outside, I am afraid.", "But I hope it is sunny "
                                 "where you are."]),
    (r"\b(bye|goodbye|stop)\b", ["Goodbye! It was nice talking to you."]),
]
FALLBACK = ["Let me tell you a short story.", "Once there was a small robot.", "It wanted to "
            "learn to talk.", "Every day it listened to people.", "Then one morning it said hello.",
            "Everybody smiled.", "And the robot smiled back.", "That is the end of my story."]


def reply_to(text: str) -> list[str]:
    """The canned sentences that answer `text` (the first rule whose pattern matches, else the
    story)."""
    for pattern, sentences in RULES:
        if re.search(pattern, text.lower()):
            return sentences
    return FALLBACK


class RuleBasedLLM(FrameProcessor):
    """A stand-in for an LLM service: on each user turn (the aggregator's LLMContextFrame) it
    answers the user's last message with canned sentences, as an LLM service streams its text
    (LLMFullResponseStartFrame, LLMTextFrames, LLMFullResponseEndFrame)."""

    def __init__(self, record: dict | None = None) -> None:
        super().__init__()
        self.record = record if record is not None else {}

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if not isinstance(frame, LLMContextFrame):
            await self.push_frame(frame, direction)
            return
        users = [m for m in frame.context.get_messages() if m.get("role") == "user"]
        content = users[-1].get("content", "") if users else ""
        heard = content if isinstance(content, str) else " ".join(
            p.get("text", "") for p in content if isinstance(p, dict))
        sentences = reply_to(heard)
        self.record.setdefault("turns", []).append(
            {"t": time.monotonic(), "heard": heard, "reply": sentences})
        await self.push_frame(LLMFullResponseStartFrame())
        for s in sentences:
            await self.push_frame(LLMTextFrame(s + " "))
        await self.push_frame(LLMFullResponseEndFrame())


# -- the probe after the avatar --------------------------------------------------------------------
def has_beep_onset(pcm: np.ndarray) -> bool:
    """Whether this frame of 16 kHz int16 audio starts with the marker tone: its first 10 ms are
    loud and almost all of their energy is at 1 kHz."""
    x = pcm[:160].astype(np.float64) / 32768.0
    energy = float(np.sum(x * x))
    if energy < 160 * (0.25 * BEEP_AMP) ** 2:
        return False
    t = np.arange(x.size) / RATE
    tone = abs(np.sum(x * np.exp(-2j * np.pi * BEEP_HZ * t))) ** 2 * 2 / x.size
    return tone > 0.8 * energy


class AvProbe(FrameProcessor):
    """Records the avatar's output (images, speaking audio, turns, interruptions) in `record`,
    and with `mark` paints the frame whose speech starts with the marker tone.

    Marking: the tone's frame is known from its audio. Paced (the avatar's
    `video_out_framerate`), a frame's speech goes out before or with its image, so the image is
    painted as it passes (every repeat of it). Not paced, each image goes out just before its
    speech: it is held until the next frame arrives (its audio, at once) so it can be marked
    before it goes on. The order of images and audio is unchanged either way."""

    def __init__(self, avatar: AvatarstreamVideoService, record: dict, *, mark: bool = False) -> None:
        super().__init__()
        self.avatar, self.record, self.mark = avatar, record, mark
        self._held: OutputImageRawFrame | None = None
        self._last_beep = False
        self._to_mark: set[int] = set()  # frames whose speech starts with the tone
        for key in ("events", "speech_frames", "markers"):
            record.setdefault(key, [])
        record.setdefault("images", 0)

    def _event(self, name: str, **kw: Any) -> None:
        self.record["events"].append({"t": time.monotonic(), "type": name, **kw})

    async def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            await self.push_frame(held)

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction != FrameDirection.DOWNSTREAM:
            await self.push_frame(frame, direction)
            return
        if isinstance(frame, OutputImageRawFrame):
            await self._release()
            self.record["images"] += 1
            if frame.sync_with_audio:
                self._held = frame
                return
            if self.mark and frame.metadata.get("avatarstream_frame") in self._to_mark:
                self._paint(frame)
            await self.push_frame(frame, direction)
            return
        if isinstance(frame, TTSAudioRawFrame):
            pcm = np.frombuffer(frame.audio, np.int16)
            onset = has_beep_onset(pcm)
            index = frame.metadata.get("avatarstream_frame")
            self.record["speech_frames"].append((time.monotonic(), index))
            if onset and not self._last_beep:
                self.record["markers"].append({"t": time.monotonic(), "frame": index})
                if self.mark and self._held is not None:
                    self._paint(self._held)
                elif self.mark and index is not None:
                    self._to_mark = {i for i in self._to_mark if i > index - 100} | {index}
            self._last_beep = onset
            await self._release()
            await self.push_frame(frame, direction)
            return
        await self._release()
        if isinstance(frame, UserStartedSpeakingFrame):
            self._event("user_started", listening=self.avatar.listening)
        elif isinstance(frame, UserStoppedSpeakingFrame):
            self._event("user_stopped", listening=self.avatar.listening)
        elif isinstance(frame, InterruptionFrame):
            self._event("interruption")
        elif isinstance(frame, TTSStartedFrame):
            self._event("tts_started")
        elif isinstance(frame, TTSStoppedFrame):
            self._event("tts_stopped")
        await self.push_frame(frame, direction)

    @staticmethod
    def _paint(image: OutputImageRawFrame) -> None:
        w, h = image.size
        rgb = np.frombuffer(image.image, np.uint8).reshape(h, w, 3).copy()
        s = max(16, min(w, h) // 8)
        rgb[:s, :s] = 255
        image.image = rgb.tobytes()


# -- the pipeline ----------------------------------------------------------------------------------
VIDEO_FPS = 30  # aiortc stamps the k-th image written k / 30 s: 30 images a second, on time
# Speech handed to WebRTC 100 ms at a time (Pipecat's default: 40 ms). Pipecat writes the next
# piece only when the last one is being sent, so a stall of the event loop longer than a piece
# makes WebRTC send silence and the rest of the reply plays that much later than its frames.
AUDIO_CHUNKS = 10


def transport_params(width: int, height: int) -> TransportParams:
    """Live video at 30 fps: the avatar (`video_out_framerate=VIDEO_FPS`) writes one image per
    slot of a 30 fps grid on the clock of its speech, and SmallWebRTC's aiortc track stamps
    each image by its count (k / 30 s), so the browser lines the face up with the voice."""
    return TransportParams(audio_in_enabled=True, audio_out_enabled=True, audio_out_sample_rate=RATE,
                           audio_out_10ms_chunks=AUDIO_CHUNKS,
                           video_out_enabled=True, video_out_is_live=True,
                           video_out_framerate=VIDEO_FPS, video_out_width=width,
                           video_out_height=height)


def build_pipeline(transport: Any, avatar: AvatarstreamVideoService, record: dict, *,
                   beep: bool = False) -> Pipeline:
    """The whole agent as a Pipecat user writes it; `record` collects what the demo reports."""
    stt = PocketsphinxSTTService()
    llm = RuleBasedLLM(record)  # a real LLM: llm = OpenAILLMService(api_key=..., model=...)
    tts = EspeakTTSService(beep=beep)
    context = LLMContext([{"role": "system", "content": "You are a friendly talking face."}])
    vad = SileroVADAnalyzer(params=VADParams(stop_secs=0.3))
    pair = LLMContextAggregatorPair(context, user_params=LLMUserAggregatorParams(
        vad_analyzer=vad, user_turn_strategies=UserTurnStrategies(
            stop=[SpeechTimeoutUserTurnStopStrategy(user_speech_timeout=0.4)])))
    probe = AvProbe(avatar, record, mark=beep)
    return Pipeline([transport.input(), stt, pair.user(), llm, tts, avatar, probe,
                     transport.output(), pair.assistant()])
