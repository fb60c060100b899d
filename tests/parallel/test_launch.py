"""Timestep-forcing pipeline parallelism under real `torchrun --standalone` processes (gloo, CPU).

Each rank is a `python -m avatarstream.parallel.launch generate ...` process joined by `env://`.
Equality with single-process generation: the decoded frames of the two MP4 files (the same
frames through the same deterministic encoder) differ by at most 1 level of 8 bits (expected and
measured: 0; the ranks run the same float32 ops at one thread each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import av
import numpy as np
import pytest

from avatarstream.bench.inputs import speechlike, write_wav

from conftest import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


def torchrun(nproc: int, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "avatarstream.parallel.launch", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def decoded(path) -> np.ndarray:  # noqa: ANN001
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


@pytest.fixture(scope="module")
def job(media, tmp_path_factory):  # noqa: ANN001
    """1.5 s of speech (4 causal blocks: the sink hand-over of block 1 included) and the
    single-process MP4 of it."""
    d = tmp_path_factory.mktemp("launch")
    wav = write_wav(d / "speech.wav", speechlike(1.5))
    args = ["--model", "tiny-random", "--reference", str(media["png"]), "--audio", str(wav),
            "--strategy", "causal", "--threads", "1", "--no-progress", "--json"]
    r = run_cli("generate", *args, "--out", str(d / "seq.mp4"))
    assert r.returncode == 0, r.stderr
    return {"args": args, "dir": d, "seq": decoded(d / "seq.mp4")}


@pytest.mark.parametrize("nproc, extra, shares", [
    (2, [], [[0, 1, 2, 3]]),
    (3, ["--split-decode"], [[0, 1, 2, 3]]),  # 1 denoise, 1 refine, 1 publish rank
    (5, [], [[0], [1], [2], [3]]),
])
def test_torchrun_tpp_equals_single_process(job, nproc, extra, shares):
    out = job["dir"] / f"tpp{nproc}.mp4"
    r = torchrun(nproc, *job["args"], *extra, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["processes"] == nproc and s["step_shares"] == shares and s["frames"] == 38
    # each rank loaded only what it runs: the DiT on denoise ranks, no refiner there, no DiT after
    parts = s["rank_parts"]
    assert all(p == ["dit", "vae", "audio", "text"] for p in parts[: len(shares)])
    assert all("dit" not in p for p in parts[len(shares):]) and "refiner" in parts[len(shares)]
    if extra:
        assert parts[-1] == ["vae", "audio", "text"]
    got = decoded(out)
    assert got.shape == job["seq"].shape == (38, 64, 64, 3)
    assert np.abs(got.astype(int) - job["seq"]).max() <= 1


def test_world_size_that_does_not_match_the_plan(job):
    """--workers 2 needs 3 processes: a rank refuses with one line, nothing is written. (The
    first rank to exit makes torchrun SIGTERM the other, so the second line may never come.)"""
    out = job["dir"] / "bad.mp4"
    r = torchrun(2, *job["args"], "--workers", "2", "--out", str(out))
    assert r.returncode != 0
    line = "the launcher started 2 processes, the plan needs 3"
    assert 1 <= r.stderr.count(line) <= 2, r.stderr[-3000:]  # at most one per rank
    frames = [ln for ln in r.stderr.splitlines() if ln.lstrip().startswith("File ")]
    assert not any("avatarstream/" in ln for ln in frames)  # torchrun's traceback only, not ours
    assert not out.exists()


def test_rank_that_dies_mid_stream(job):
    """Rank 0 is killed (SIGKILL) when it starts block 3 of 4: the others stop with one line
    each, naming the rank they lost or saying torchrun stopped them (whichever reaches them
    first); the run is not reported as done (exit status, no summary). What the publishing rank
    had published stays in a playable file; when it had published nothing yet (a busy machine)
    there is no file: in both cases nothing else is left beside it, and no file claims the whole
    video."""
    out = job["dir"] / "crash" / "crash.mp4"
    out.parent.mkdir()
    r = torchrun(3, *job["args"], "--out", str(out), env={"AVATARSTREAM_TPP_FAULT": "0:3"})
    assert r.returncode != 0
    assert not any(ln.lstrip().startswith("{") for ln in r.stdout.splitlines())  # no summary
    for rank, peer in ((1, 0), (2, 1)):
        assert (f"rank {rank}: lost latents from rank {peer}" in r.stderr
                or f"rank {rank}: stopped by the launcher" in r.stderr), r.stderr[-3000:]
    left = sorted(p.name for p in out.parent.iterdir())
    assert left in ([], ["crash.mp4"]), left  # no temporary, partial or empty file beside it
    if left:  # a playable prefix of the video (at least one fragment), never all of it
        got = decoded(out)
        assert 1 <= got.shape[0] < job["seq"].shape[0] == 38
        assert np.abs(got.astype(int) - job["seq"][: got.shape[0]]).max() <= 1


def test_publishing_rank_killed_keeps_a_playable_file(media, job):
    """The publishing rank itself is killed (SIGKILL: no chance to close its file) when it starts
    block 6 of 7 (3 s of speech): every fragment written before stays playable (at least block
    0's 9 frames: the publisher queue lags by a bounded number of chunks), equal to the
    single-process frames."""
    out = job["dir"] / "killed.mp4"
    args = [a if a != job["args"][job["args"].index("--audio") + 1] else str(media["wav_3s"])
            for a in job["args"]]
    r = torchrun(3, *args, "--out", str(out), env={"AVATARSTREAM_TPP_FAULT": "2:6"})
    assert r.returncode != 0
    got = decoded(out)
    seq = decoded(job["dir"] / "seq3.mp4") if (job["dir"] / "seq3.mp4").exists() else None
    if seq is None:
        done = run_cli("generate", *args, "--out", str(job["dir"] / "seq3.mp4"))
        assert done.returncode == 0, done.stderr
        seq = decoded(job["dir"] / "seq3.mp4")
    assert 9 <= got.shape[0] < seq.shape[0] == 75, got.shape
    assert np.abs(got.astype(int) - seq[: got.shape[0]]).max() <= 1
