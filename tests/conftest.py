"""Shared fixtures: media files made on the fly (nothing binary committed for tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from avatarstream.media.image import write_png
from avatarstream.media.synthetic import face_image, speechlike, write_wav


def write_audio(path: Path, seconds: float, rate: int, channels: int, codec: str) -> Path:
    """Speech-like audio encoded with `codec` (mp3, aac, flac, libvorbis) at `rate`/`channels`."""
    x = speechlike(seconds, sample_rate=rate)
    layout = "stereo" if channels == 2 else "mono"
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=rate)
        s.layout = layout
        pcm = np.stack([x] * channels).astype(np.float32)  # [channels, samples] planar float
        frame = av.AudioFrame.from_ndarray(pcm, format="fltp", layout=layout)
        frame.sample_rate = rate
        for p in s.encode(frame):  # PyAV converts the format and re-frames to the codec's size
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def write_video(path: Path, frames: int = 30, size: int = 96, fps: int = 25) -> Path:
    img = face_image(size)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width = s.height = size
        s.pix_fmt = "yuv420p"
        for i in range(frames):
            f = np.roll(img, i, axis=1)
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


@pytest.fixture(scope="session", autouse=True)
def config_dir(tmp_path_factory) -> Path:
    """avatarstream's config folder for the whole run (the local signing certificate every
    output is signed with goes there, not into the user's ~/.config); subprocesses inherit it."""
    import os

    d = tmp_path_factory.mktemp("config")
    os.environ["AVATARSTREAM_CONFIG_DIR"] = str(d)
    # compiled decode packages (models/aot.py): none from the user's cache, so every run decodes
    # as the test expects (eager unless a test builds a package into its own folder)
    os.environ["AVATARSTREAM_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    for key in ("AVATARSTREAM_SIGN_CERT", "AVATARSTREAM_SIGN_KEY", "AVATARSTREAM_VAE_BACKEND"):
        os.environ.pop(key, None)
    return d


@pytest.fixture(scope="session")
def media(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("media")
    return {
        "png": write_png(d / "ref.png", face_image(128)),
        "mp4": write_video(d / "ref.mp4"),
        "mp3_7s": write_audio(d / "speech.mp3", 7.0, 44100, 2, "mp3"),
        "wav_3s": write_wav(d / "speech.wav", speechlike(3.0)),
        "wav_60s": write_wav(d / "long.wav", speechlike(60.0)),
        "dir": d,
    }


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "avatarstream.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def stream_two_seconds(models) -> np.ndarray:  # noqa: ANN001
    """Run a 64 px model's pipeline on a random reference and 2 s of noise; assert every frame
    came out (50) and moves; return the frames `[50, 64, 64, 3]`."""
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.eval.benchmark import CollectSink

    g = torch.Generator().manual_seed(0)
    ref = (torch.rand(1, 3, 64, 64, generator=g) * 255).to(torch.uint8)
    wave = 0.1 * torch.randn(16000 * 2, generator=g)
    sink = CollectSink()
    summary = Pipeline(models).run(ref, iter(wave.split(3200)), [sink])
    frames = np.stack(sink.frames)
    assert frames.shape[1:] == (64, 64, 3) and summary.frames == 50
    assert frames.std(axis=0).mean() > 0  # the frames move
    return frames


@pytest.fixture
def one_thread():
    """One torch thread for the test: on a shared 2-core CPU, threads only add contention to the
    tiny matmuls of tiny configs (use with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _signal_dispositions_restored():
    """Each test leaves SIGINT and SIGTERM as it found them: a library that takes them in-process
    (an event loop's signal handlers, an agent framework) and leaves them ignored would be
    inherited by every later test's subprocess, which then cannot be stopped with Ctrl-C."""
    import signal as _signal

    saved = {s: _signal.getsignal(s) for s in (_signal.SIGINT, _signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        if handler is not None and _signal.getsignal(s) is not handler:
            _signal.signal(s, handler)
