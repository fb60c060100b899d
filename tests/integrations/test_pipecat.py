"""The Pipecat video service with the real pipecat-ai package, in process on tiny-random (one step):
a `Pipeline([service, sink])` run by Pipecat's PipelineWorker and WorkerRunner, fed what a TTS
service emits (TTSStartedFrame, 24 kHz TTSAudioRawFrames, TTSStoppedFrame), and the user's turns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import torch

from avatarstream.media.synthetic import speechlike

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("pipecat", reason="the pipecat extra is not installed")

import soxr  # noqa: E402  (pipecat-ai's own dependency)
from pipecat.frames.frames import (EndFrame, Frame, InterruptionFrame, MetricsFrame,  # noqa: E402
                                   OutputImageRawFrame, TTSAudioRawFrame, TTSStartedFrame,
                                   TTSStoppedFrame, UserStartedSpeakingFrame,
                                   UserStoppedSpeakingFrame)
from pipecat.metrics.metrics import ProcessingMetricsData, TTFBMetricsData  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

from avatarstream.integrations.pipecat import AvatarstreamVideoService  # noqa: E402

SR_TTS = 24000  # what Pipecat's TTS services emit
FRAME_MS = 20


@pytest.fixture(scope="module")
def host():  # type: ignore[no-untyped-def]
    from avatarstream.live.session import LiveSessionConfig
    from avatarstream.registry import load_model
    from avatarstream.serve.livekit.host import AvatarHost

    models = load_model("tiny-random")
    models.config.steps = 1
    ref = torch.randint(0, 255, (1, 3, *models.config.out_hw), dtype=torch.uint8)
    h = AvatarHost(models, ref, max_sessions=2, session=LiveSessionConfig(lead_s=0.2))
    h.start()
    yield h
    h.stop()


class Sink(FrameProcessor):
    """The end of the pipeline: records (wall time, frame) of what reaches it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[tuple[float, Frame]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.got.append((time.monotonic(), frame))
        await self.push_frame(frame, direction)

    def of(self, kind: type) -> list[tuple[float, Frame]]:
        return [(t, f) for t, f in self.got if isinstance(f, kind)]

    async def until(self, cond: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)


def _speech(seconds: float) -> np.ndarray:
    x = speechlike(seconds, SR_TTS, seed=2)
    return np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)


def _tts_frames(pcm: np.ndarray) -> list[Frame]:
    n = SR_TTS * FRAME_MS // 1000
    return [TTSAudioRawFrame(audio=pcm[i : i + n].tobytes(), sample_rate=SR_TTS, num_channels=1)
            for i in range(0, pcm.size, n)]


def _resampled(pcm: np.ndarray) -> np.ndarray:
    """The input through the same soxr stream, in the same 20 ms pieces, flushed at the end."""
    r = soxr.ResampleStream(SR_TTS, 16000, 1, dtype="float32", quality="HQ")
    n, x = SR_TTS * FRAME_MS // 1000, pcm.astype(np.float32) / 32768.0
    out = [r.resample_chunk(x[i : i + n]) for i in range(0, x.size, n)]
    y = np.concatenate(out + [r.resample_chunk(np.zeros(0, np.float32), last=True)])
    return np.clip(np.round(y * 32768.0), -32768, 32767).astype(np.int16)


def _run(host, body: Callable[[PipelineWorker, Sink, AvatarstreamVideoService], Awaitable[None]],
         **options) -> tuple[Sink, AvatarstreamVideoService]:  # type: ignore[no-untyped-def]
    service = AvatarstreamVideoService(host=host, **options)
    sink = Sink()
    worker = PipelineWorker(Pipeline([service, sink]), params=PipelineParams(
        enable_metrics=True, send_initial_empty_metrics=False),
                            idle_timeout_secs=None)

    async def main() -> None:
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        run = asyncio.create_task(runner.run())
        await sink.until(lambda: bool(sink.of(OutputImageRawFrame)))  # started: the avatar idles
        await body(worker, sink, service)
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(run, 20)

    asyncio.run(asyncio.wait_for(main(), 60))
    return sink, service


def test_speech_in_video_and_the_same_audio_out_with_ttfb(host):
    c = host.models.config
    pcm = _speech(1.5)

    async def body(worker, sink, service) -> None:  # type: ignore[no-untyped-def]
        await worker.queue_frames([TTSStartedFrame(), *_tts_frames(pcm), TTSStoppedFrame()])
        await sink.until(lambda: bool(sink.of(TTSStoppedFrame)))
        await asyncio.sleep(0.5)  # listening again afterwards

    sink, service = _run(host, body)
    images = sink.of(OutputImageRawFrame)
    w, h = c.out_hw[1], c.out_hw[0]
    assert all(f.size == (w, h) and f.format == "RGB" and len(f.image) == w * h * 3 for _, f in images)
    # every speech frame directly follows its image: audio never goes before its frame
    seq = [f for _, f in sink.got if isinstance(f, (OutputImageRawFrame, TTSAudioRawFrame))]
    audio_at = [i for i, f in enumerate(seq) if isinstance(f, TTSAudioRawFrame)]
    assert audio_at and all(isinstance(seq[i - 1], OutputImageRawFrame) for i in audio_at)
    assert audio_at == list(range(audio_at[0], audio_at[-1] + 1, 2))  # one per frame, no gaps
    # the audio out is the audio in (at 16 kHz, bit for bit), padded to whole frames
    out = np.concatenate([np.frombuffer(seq[i].audio, np.int16) for i in audio_at])
    assert all(seq[i].sample_rate == 16000 for i in audio_at)
    ref = _resampled(pcm)
    assert np.array_equal(out[: ref.size], ref) and not out[ref.size :].any()
    assert 0 <= out.size - ref.size < 16000 // c.fps
    assert len(audio_at) == -(-ref.size // (16000 // c.fps))  # 1.5 s -> 38 frames at 25 fps
    # the stop frame comes after the utterance's last frame, not when the TTS stopped
    (t_stop, stop), = sink.of(TTSStoppedFrame)
    assert sink.got.index((t_stop, stop)) > max(sink.got.index((t, f)) for t, f in sink.of(TTSAudioRawFrame))
    # video at the model's fps over the run: frames neither pile up nor stall
    times = np.array([t for t, _ in images])
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert 0.7 * c.fps < rate < 1.5 * c.fps, rate
    # metrics, the Pipecat way: TTFB (first audio in -> first speaking frame out), processing time
    data = [d for _, f in sink.of(MetricsFrame) for d in f.data]
    ttfb = [d.value for d in data if isinstance(d, TTFBMetricsData) and d.processor == service.name]
    proc = [d.value for d in data if isinstance(d, ProcessingMetricsData) and d.processor == service.name]
    assert len(ttfb) == 1 and 0 < ttfb[0] < 5.0 and abs(ttfb[0] - service.ttfb_s[0]) < 0.05
    assert len(proc) == 1 and proc[0] > ttfb[0]
    print(f"\npipecat tiny-random: TTFB {ttfb[0]:.3f} s, processing {proc[0]:.3f} s, "
          f"{len(images)} frames at {rate:.1f} fps")


def test_paced_output_for_a_live_transport_keeps_every_sample_and_the_stops(host):
    """video_out_framerate=30 (a transport with video_out_is_live): one image per 1/30 s slot,
    the speech whole and in order, each utterance's stop after its last audio, also when the
    TTS stops only after the avatar has finished speaking."""
    pcm = _speech(1.0)

    async def body(worker, sink, service) -> None:  # type: ignore[no-untyped-def]
        await worker.queue_frames([TTSStartedFrame(), *_tts_frames(pcm), TTSStoppedFrame()])
        await sink.until(lambda: len(sink.of(TTSStoppedFrame)) == 1)
        await worker.queue_frames([TTSStartedFrame(), *_tts_frames(pcm)])
        await sink.until(lambda: len(sink.of(TTSAudioRawFrame)) * 640 >= 2 * _resampled(pcm).size)
        await asyncio.sleep(0.5)  # all spoken: the stop arrives after the last frame went out
        await worker.queue_frame(TTSStoppedFrame())
        await sink.until(lambda: len(sink.of(TTSStoppedFrame)) == 2)

    sink, _ = _run(host, body, video_out_framerate=30)
    audio = [f for _, f in sink.of(TTSAudioRawFrame)]
    out = np.concatenate([np.frombuffer(f.audio, np.int16) for f in audio])
    ref = _resampled(pcm)
    assert np.count_nonzero(out) >= 2 * np.count_nonzero(ref) - 2  # both utterances, whole
    stops = [sink.got.index(x) for x in sink.of(TTSStoppedFrame)]
    last_audio = max(sink.got.index(x) for x in sink.of(TTSAudioRawFrame))
    assert stops[1] > last_audio
    times = np.array([t for t, _ in sink.of(OutputImageRawFrame)])
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert 20 < rate < 40, rate


def test_interruption_stops_speech_and_lips_within_one_chunk(host):
    c = host.models.config
    chunk_s = 4 * c.chunk / c.fps
    pcm = _speech(3.0)
    marks: dict[str, float] = {}

    async def body(worker, sink, service) -> None:  # type: ignore[no-untyped-def]
        await worker.queue_frames([TTSStartedFrame(), *_tts_frames(pcm)])  # no stop: cut short
        await sink.until(lambda: bool(sink.of(TTSAudioRawFrame)))
        await asyncio.sleep(0.4)
        marks["at"] = time.monotonic()
        marks["shown"] = (marks["at"] - service.session.origin) * c.fps  # the frame on screen
        await worker.queue_frame(InterruptionFrame())
        await asyncio.sleep(chunk_s + 1.0)
        marks["frame"] = service.session.frame

    sink, service = _run(host, body)
    spoken = [(t, f) for t, f in sink.of(TTSAudioRawFrame) if np.frombuffer(f.audio, np.int16).any()]
    assert len(spoken) < 2.5 * c.fps  # most of the 3 s was never spoken
    # the last speaking frame is at most one chunk (+ the lead) of media after the interrupt
    seq = [f for _, f in sink.got if isinstance(f, (OutputImageRawFrame, TTSAudioRawFrame))]
    images = [f for f in seq if isinstance(f, OutputImageRawFrame)]
    last_audio = max(i for i, f in enumerate(seq) if isinstance(f, TTSAudioRawFrame))
    last_speaking = images.index(seq[last_audio - 1])
    first_index = images[0].metadata["avatarstream_frame"]
    latency = (first_index + last_speaking + 1 - marks["shown"]) / c.fps
    assert latency <= chunk_s + 0.2 + 0.1, latency
    # and the avatar goes on, listening: frames keep coming after the speech stopped
    assert len(images) - last_speaking > c.fps * 0.5
    print(f"\npipecat interrupt: speech and lips stopped {latency:.2f} s of media after the "
          f"InterruptionFrame (chunk {chunk_s:.2f} s)")


def test_user_speaking_the_avatar_listens_alive_and_silent(host):
    c = host.models.config
    marks: dict[str, int] = {}

    async def body(worker, sink, service) -> None:  # type: ignore[no-untyped-def]
        await worker.queue_frame(UserStartedSpeakingFrame())
        await sink.until(lambda: bool(sink.of(UserStartedSpeakingFrame)))
        assert service.listening
        marks["from"] = len(sink.got)
        await asyncio.sleep(1.2)
        marks["to"] = len(sink.got)
        await worker.queue_frame(UserStoppedSpeakingFrame())
        await sink.until(lambda: bool(sink.of(UserStoppedSpeakingFrame)))
        assert not service.listening

    sink, _ = _run(host, body)
    during = sink.got[marks["from"] : marks["to"]]
    images = [f for _, f in during if isinstance(f, OutputImageRawFrame)]
    assert not [f for _, f in during if isinstance(f, TTSAudioRawFrame)]  # nothing is said
    assert 0.7 * 1.2 * c.fps <= len(images) <= 1.5 * 1.2 * c.fps + 4  # ~fps, paced
    # not frozen: the idle motion changes the picture from frame to frame
    px = [np.frombuffer(f.image, np.uint8).astype(np.int16) for f in images]
    moving = sum(np.abs(a - b).mean() > 0.05 for a, b in zip(px, px[1:]))
    assert moving >= 0.8 * (len(px) - 1), moving


def test_a_users_mistakes_are_one_clear_message(tmp_path):
    import subprocess
    import sys

    from avatarstream.errors import ConfigError, InputError

    with pytest.raises(ConfigError, match="unknown model 'no-such-model'"):
        AvatarstreamVideoService(model="no-such-model")
    with pytest.raises(InputError, match="avatar file not found"):
        AvatarstreamVideoService(model="tiny-random", avatar=tmp_path / "face.jpg")
    # without the extra: one ConfigError that says what to install
    code = ("import sys; sys.modules['pipecat'] = None\n"
            "try:\n    import avatarstream.integrations.pipecat\n"
            "except Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("ConfigError") and "pip install 'avatarstream[pipecat]'" in out.stdout


def test_two_pipelines_in_one_process_share_one_host():
    """Services built from a model name load it once per process (as `serve` shares one model
    between its sessions); both pipelines speak; the host stops when the last one ends."""
    from avatarstream.integrations import local

    services = [AvatarstreamVideoService(model="tiny-random", max_sessions=2, lead_s=0.2)
                for _ in range(2)]
    sinks = [Sink(), Sink()]
    workers = [PipelineWorker(Pipeline([s, k]), idle_timeout_secs=None) for s, k in zip(services, sinks)]
    pcm = _speech(0.5)

    async def main() -> None:
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(*workers)
        run = asyncio.create_task(runner.run())
        for k in sinks:
            await k.until(lambda k=k: bool(k.of(OutputImageRawFrame)), timeout=40)
        assert services[0].session.scheduler is services[1].session.scheduler
        assert len(local._hosts) == 1
        for w in workers:
            await w.queue_frames([TTSStartedFrame(), *_tts_frames(pcm), TTSStoppedFrame()])
        for k in sinks:
            await k.until(lambda k=k: bool(k.of(TTSStoppedFrame)), timeout=40)
        for w in workers:
            await w.queue_frame(EndFrame())
        await asyncio.wait_for(run, 20)

    asyncio.run(asyncio.wait_for(main(), 90))
    for k in sinks:
        assert sum(len(f.audio) // 2 for _, f in k.of(TTSAudioRawFrame)) >= 8000  # 0.5 s spoken
    assert not local._hosts  # the last one out stopped it
