"""Timestep-forcing pipeline parallelism: real processes over gloo, started by the code under test.

The output must equal single-process causal generation with the same seeds. Tolerance: at most 1
level of 8 bits on any pixel (the processes run the same float32 ops at one thread each, so the
frames are expected to be identical; measured: identical).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import av
import numpy as np
import pytest

from avatarstream.parallel.run import read_frames
from avatarstream.parallel.start import run_tpp
from avatarstream.parallel.tpp import TPPJob, split_steps

from conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


def single_process_frames(media: dict, seconds_file: str, **overrides: object) -> np.ndarray:
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.eval.benchmark import CollectSink
    from avatarstream.media.audio import AudioReader
    from avatarstream.media.reference import load_reference
    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    for k, v in overrides.items():
        setattr(models.config, k, v)
    cfg = models.config
    ref = load_reference(str(media["png"]), size=cfg.hr_size, max_frames=cfg.ref_pixel_frames)
    sink = CollectSink()
    Pipeline(models).run(ref.frames, iter(AudioReader(media[seconds_file])), [sink])
    return np.stack(sink.frames)


def decoded(path) -> np.ndarray:  # noqa: ANN001
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def test_split_steps():
    assert split_steps(4, 4) == [[0], [1], [2], [3]]
    assert split_steps(4, 3) == [[0, 1], [2], [3]]
    assert split_steps(4, 1) == [[0, 1, 2, 3]]
    from avatarstream.errors import ConfigError

    with pytest.raises(ConfigError, match="between 1 and the number of steps"):
        split_steps(4, 5)


def test_tpp_equals_single_process_uneven_shares_stochastic(media, tmp_path):
    """3 denoise workers own steps [0, 1], [2], [3], then a refine and a decode worker
    (split_decode); stochastic sampler: the fresh noise of (block, step) is drawn where that
    step runs and must match."""
    over = {"strategy": "causal", "sampler": "stochastic", "seed": 3}
    job = TPPJob(model="tiny-random", reference=str(media["png"]), audio=str(media["wav_3s"]),
                 workers=3, split_decode=True, frames_out=str(tmp_path / "frames.u8"), overrides=over,
                 threads=1)
    summary = run_tpp(job)
    got = read_frames(tmp_path / "frames.u8", 64)
    want = single_process_frames(media, "wav_3s", **over)
    assert got.shape == want.shape == (75, 64, 64, 3)
    assert np.abs(got.astype(int) - want).max() <= 1
    assert summary["frames"] == 75 and summary["step_shares"] == [[0, 1], [2], [3]]
    assert summary["processes"] == 5 and summary["split_decode"]


def test_tpp_stream_of_one_block_finishes(media, tmp_path):
    """0.2 s of speech is one block: no block 1, so no Adaptive-Attention-Sink hand-over to wait
    for (that once left the last worker sending to processes that had finished)."""
    from avatarstream.bench.inputs import speechlike, write_wav

    wav = write_wav(tmp_path / "short.wav", speechlike(0.2))
    job = TPPJob(model="tiny-random", reference=str(media["png"]), audio=str(wav), workers=2,
                 frames_out=str(tmp_path / "f.u8"), overrides={"strategy": "causal"}, threads=1,
                 timeout_s=60)
    assert run_tpp(job)["frames"] == 5
    assert read_frames(tmp_path / "f.u8", 64).shape == (5, 64, 64, 3)


def test_cli_generate_workers_equals_single_process(media, tmp_path):
    """`generate --strategy causal --workers 2`, launched by the CLI itself, writes the same
    video as `generate --strategy causal` (decoded frames of two H.264 encodes of equal input),
    here with `--history-level next` (each worker's extra forward for its cache stays local);
    the test above covers "same". The file already at --out is replaced, and nothing is left
    beside it. Then the decode process is killed (SIGKILL) at block 6 of 7: that run fails, the
    new video at --out is untouched, and the frames it had published are kept in the partial file
    its message names."""
    args = ["--model", "tiny-random", "--reference", str(media["png"]), "--audio", str(media["wav_3s"]),
            "--strategy", "causal", "--history-level", "next", "--threads", "1", "--no-progress", "--json"]
    out = tmp_path / "tpp.mp4"
    out.write_bytes(b"an older video")
    r1 = run_cli("generate", *args, "--out", str(tmp_path / "seq.mp4"))
    r2 = run_cli("generate", *args, "--out", str(out), "--workers", "2")
    assert r1.returncode == 0, r1.stderr
    assert r2.returncode == 0, r2.stderr
    assert sorted(p.name for p in tmp_path.glob("tpp*")) == ["tpp.mp4"]  # no partial, no lock
    s = json.loads(r2.stdout.strip().splitlines()[-1])
    assert s["workers"] == 2 and s["step_shares"] == [[0, 1], [2, 3]] and s["frames"] == 75
    a, b = decoded(tmp_path / "seq.mp4"), decoded(out)
    assert a.shape == b.shape and np.abs(a.astype(int) - b).max() <= 1

    done = out.read_bytes()
    r3 = subprocess.run([sys.executable, "-m", "avatarstream.cli", "generate", *args, "--out", str(out),
                         "--workers", "2"], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "AVATARSTREAM_TPP_FAULT": "2:6"})
    assert r3.returncode != 0 and not r3.stdout.strip().startswith("{")
    assert out.read_bytes() == done
    partials = list(tmp_path.glob("tpp.partial-*.mp4"))
    assert len(partials) == 1, sorted(p.name for p in tmp_path.iterdir())
    assert f"kept in {partials[0]} (playable); {out} is unchanged" in r3.stderr, r3.stderr[-3000:]
    got = decoded(partials[0])
    assert 9 <= got.shape[0] < a.shape[0] and np.abs(got.astype(int) - a[: got.shape[0]]).max() <= 1
    assert not (tmp_path / "tpp.mp4.lock").exists()  # the launching process held it and let it go


@pytest.mark.parametrize("extra, message", [
    (["--model", "tiny-random", "--workers", "2"], "causal strategy only"),  # a prefix model
    (["--strategy", "causal", "--workers", "5"], "between 1 and the number of steps"),
    (["--strategy", "causal", "--workers", "0"], "between 1 and the number of steps"),
    (["--strategy", "causal", "--split-decode"], "add --workers"),
])
def test_cli_workers_user_errors(media, tmp_path, extra, message):
    r = run_cli("generate", "--reference", str(media["png"]), "--audio", str(media["wav_3s"]),
                "--out", str(tmp_path / "x.mp4"), "--no-progress", *extra)
    assert r.returncode == 2 and message in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "x.mp4").exists()


def test_worker_errors_are_reported_not_hung(media, tmp_path):
    """Mistakes found before or inside the worker processes come back as the user error they
    are; the remaining workers are stopped instead of waiting for latents forever."""
    from avatarstream.errors import ConfigError, InputError

    job = TPPJob(model="tiny-random", reference=str(media["png"]), audio=str(media["wav_3s"]),
                 workers=2, overrides={"strategy": "prefix"}, threads=1)
    with pytest.raises(ConfigError, match="causal"):
        run_tpp(job)  # refused before any process starts
    job = TPPJob(model="tiny-random", reference=str(tmp_path / "missing.png"), audio=str(media["wav_3s"]),
                 workers=2, overrides={"strategy": "causal"}, threads=1)
    with pytest.raises(InputError, match="missing.png"):
        run_tpp(job)  # every worker finds it; the launcher reports it once
