"""The Pipecat video service in remote mode with the real pipecat-ai package, against a real
`avatarstream serve --model tiny-random` in a child process on a free loopback port (with an API
key): the session through the server's API, the speech over its WebSocket, the video and the
session's audio back over WebRTC (aiortc)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request

import numpy as np
import pytest

from avatarstream.bench.inputs import face_image, write_png

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("pipecat", reason="the pipecat extra is not installed")
pytest.importorskip("aiortc", reason="WebRTC (aiortc) is not installed")

from pipecat.frames.frames import (EndFrame, InterruptionFrame, MetricsFrame,  # noqa: E402
                                   OutputImageRawFrame, TTSAudioRawFrame, TTSStartedFrame,
                                   TTSStoppedFrame, UserStartedSpeakingFrame,
                                   UserStoppedSpeakingFrame)
from pipecat.metrics.metrics import TTFBMetricsData  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

from avatarstream.errors import ConfigError, InputError  # noqa: E402
from avatarstream.integrations.pipecat import AvatarstreamVideoService  # noqa: E402
from avatarstream.serve.client import ServerProcess  # noqa: E402

from .test_pipecat import Sink, _resampled, _speech, _tts_frames  # noqa: E402

KEY = "remote-secret-key-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("remote")
    png = write_png(d / "face.png", face_image(96))
    with ServerProcess(d / "data", args=("--api-key", KEY, "--max-sessions", "2",
                                         "--playout-delay", "0.3")) as s:
        s.png = png
        yield s


def _state(server, sid: str) -> dict:  # type: ignore[no-untyped-def]
    req = urllib.request.Request(f"{server.url}/v1/sessions/{sid}",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def _run(server, body):  # type: ignore[no-untyped-def]
    service = AvatarstreamVideoService(url=server.url, api_key=KEY, avatar=server.png)
    sink = Sink()
    worker = PipelineWorker(Pipeline([service, sink]), params=PipelineParams(
        enable_metrics=True, send_initial_empty_metrics=False), idle_timeout_secs=None)

    async def main() -> None:
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        run = asyncio.create_task(runner.run())
        await sink.until(lambda: bool(sink.of(OutputImageRawFrame)), timeout=60)
        await body(worker, sink, service)
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(run, 30)

    asyncio.run(asyncio.wait_for(main(), 120))
    return sink, service


def test_remote_speech_in_video_and_its_audio_out_with_ttfb(server, caplog):
    caplog.set_level(logging.DEBUG, logger="avatarstream")
    pcm = _speech(2.0)
    marks: dict = {}

    async def body(worker, sink, service) -> None:  # type: ignore[no-untyped-def]
        marks["sid"] = service._stream.session_id
        marks["token"] = service._stream._s["token"]
        await worker.queue_frames([TTSStartedFrame(), *_tts_frames(pcm), TTSStoppedFrame()])
        await sink.until(lambda: bool(sink.of(TTSStoppedFrame)), timeout=30)
        await asyncio.sleep(0.5)

    sink, service = _run(server, body)
    images = sink.of(OutputImageRawFrame)
    w, h = images[0][1].size  # the model's size (the server fits the avatar to it)
    assert w > 0 and all(f.size == (w, h) and f.format == "RGB" and len(f.image) == w * h * 3
                         for _, f in images)
    seq = [f for _, f in sink.got if isinstance(f, (OutputImageRawFrame, TTSAudioRawFrame))]
    audio_at = [i for i, f in enumerate(seq) if isinstance(f, TTSAudioRawFrame)]
    # each frame's 40 ms directly after its image, one per frame, no gaps; the utterance's
    # frames (2 s at 25 fps, padded to whole frames)
    assert audio_at and all(isinstance(seq[i - 1], OutputImageRawFrame) for i in audio_at)
    assert audio_at == list(range(audio_at[0], audio_at[-1] + 1, 2))
    assert all(seq[i].sample_rate == 16000 and len(seq[i].audio) == 1280 for i in audio_at)
    # measured 50 and 55: the server's session brackets its speech with the silent dissolve
    # frames (LiveSessionConfig.ease_s, 8 frames) when its events land a little late
    assert -2 <= len(audio_at) - 50 <= 8, len(audio_at)
    # the audio is the speech sent, through Opus: correlated with it at (close to) no lag
    out = np.concatenate([np.frombuffer(seq[i].audio, np.int16) for i in audio_at]).astype(float)
    ref = _resampled(pcm).astype(float)
    n = min(out.size, ref.size)
    lags = range(-480, 481, 16)
    corr = [np.corrcoef(out[max(0, k) : n + min(0, k)], ref[max(0, -k) : n - max(0, k)])[0, 1]
            for k in lags]
    best = int(np.argmax(corr))
    assert corr[best] > 0.8 and abs(list(lags)[best]) <= 160, (corr[best], list(lags)[best])
    # the stop frame after the last speaking frame
    (t_stop, stop), = sink.of(TTSStoppedFrame)
    assert sink.got.index((t_stop, stop)) > max(sink.got.index((t, f)) for t, f in
                                                sink.of(TTSAudioRawFrame))
    # frames at the server's pace
    times = np.array([t for t, _ in images])
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert 18 < rate < 32, rate
    ttfb = [d.value for _, f in sink.of(MetricsFrame) for d in f.data
            if isinstance(d, TTFBMetricsData) and d.processor == service.name]
    assert len(ttfb) == 1 and 0 < ttfb[0] < 5.0
    # neither the key nor the session's token is ever logged (here, or by the server)
    logged = caplog.text + server.log.read_text()
    assert KEY not in logged and marks["token"] not in logged
    print(f"\npipecat remote tiny-random: TTFB {ttfb[0]:.3f} s (playout delay 0.3 s), "
          f"{len(images)} frames at {rate:.1f} fps, audio corr {corr[best]:.2f} at "
          f"{list(lags)[best] / 16:.0f} ms")


def test_remote_interruption_and_listening(server):
    pcm = _speech(4.0)
    marks: dict = {}

    async def body(worker, sink, service) -> None:  # type: ignore[no-untyped-def]
        sid = service._stream.session_id
        await worker.queue_frame(UserStartedSpeakingFrame())
        await sink.until(lambda: bool(sink.of(UserStartedSpeakingFrame)))
        await asyncio.sleep(0.3)
        marks["listening"] = _state(server, sid)["state"]
        n0 = len(sink.of(OutputImageRawFrame))
        await asyncio.sleep(1.0)
        marks["listen_frames"] = len(sink.of(OutputImageRawFrame)) - n0
        await worker.queue_frame(UserStoppedSpeakingFrame())
        await asyncio.sleep(0.3)
        marks["back"] = _state(server, sid)["state"]
        await worker.queue_frames([TTSStartedFrame(), *_tts_frames(pcm)])  # no stop: cut short
        await sink.until(lambda: bool(sink.of(TTSAudioRawFrame)), timeout=30)
        await asyncio.sleep(0.4)
        marks["at"] = time.monotonic()
        await worker.queue_frame(InterruptionFrame())
        await asyncio.sleep(2.0)

    sink, _ = _run(server, body)
    assert marks["listening"] == "listening" and marks["back"] == "idle"
    assert 0.7 * 25 <= marks["listen_frames"] <= 1.5 * 25 + 4
    loud = [t for t, f in sink.of(TTSAudioRawFrame)
            if np.abs(np.frombuffer(f.audio, np.int16)).max() > 0.02 * 32767]
    assert loud and loud[-1] > marks["at"]
    stop_s = loud[-1] - marks["at"]  # wall time: the chunk + what the playout delay holds
    spoken = len(sink.of(TTSAudioRawFrame))
    assert spoken < 3.0 * 25 and stop_s < 0.64 + 0.3 + 0.3 + 0.3, (spoken, stop_s)
    print(f"\npipecat remote interrupt: last speech out {stop_s:.2f} s after the "
          f"InterruptionFrame ({spoken} of 100 frames spoken)")


def test_remote_mistakes_are_one_clear_message(server, tmp_path):
    from avatarstream.integrations.remote import RemoteStream

    with pytest.raises(ConfigError, match="http"):
        AvatarstreamVideoService(url="ws://127.0.0.1:1", avatar=server.png)
    with pytest.raises(InputError, match="avatar"):
        AvatarstreamVideoService(url=server.url)

    async def opened(stream: RemoteStream) -> None:
        try:
            await stream.open()
        finally:
            await stream.aclose()

    with pytest.raises(InputError, match="no such avatar"):  # another key's, or never made
        asyncio.run(opened(RemoteStream(server.url, api_key=KEY, avatar_id="0" * 24)))
    from avatarstream.parallel.run import free_port

    with pytest.raises(InputError, match="cannot talk to the avatarstream server"):
        asyncio.run(opened(RemoteStream(f"http://127.0.0.1:{free_port()}", api_key=KEY,
                                        avatar=server.png)))
