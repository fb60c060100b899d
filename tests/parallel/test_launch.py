"""Timestep-forcing pipeline parallelism under real `torchrun --standalone` processes (gloo, CPU).

Each rank is a `python -m avatarstream.parallel.launch generate ...` process joined by `env://`.
Equality with single-process generation: the decoded frames of the two MP4 files (the same
frames through the same deterministic encoder) differ by at most 1 level of 8 bits (expected and
measured: 0; the ranks run the same float32 ops at one thread each).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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


def signed(path) -> bool:  # noqa: ANN001
    import c2pa

    try:
        with c2pa.Reader(str(path)) as r:
            return r.get_validation_state() == "Valid"
    except c2pa.C2paError:  # no manifest
        return False


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
    out.write_bytes(b"an older video")  # replaced by the new one, complete
    r = torchrun(nproc, *job["args"], *extra, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in job["dir"].glob(f"tpp{nproc}*")) == [out.name]  # no partial, no lock
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
    first); the run is not reported as done (exit status, no summary). The video already at
    --out is untouched, byte for byte; what the publishing rank had published stays in a playable
    partial file beside it, named in its message; when it had published nothing yet (a busy
    machine) there is no partial: in both cases nothing else is left beside it (no lock, no empty
    file), and no file claims the whole video."""
    out = job["dir"] / "crash" / "crash.mp4"
    out.parent.mkdir()
    old = (job["dir"] / "seq.mp4").read_bytes()  # an earlier video at --out
    out.write_bytes(old)
    r = torchrun(3, *job["args"], "--out", str(out), env={"AVATARSTREAM_TPP_FAULT": "0:3"})
    assert r.returncode != 0
    assert not any(ln.lstrip().startswith("{") for ln in r.stdout.splitlines())  # no summary
    for rank, peer in ((1, 0), (2, 1)):
        assert (f"rank {rank}: lost latents from rank {peer}" in r.stderr
                or f"rank {rank}: stopped by the launcher" in r.stderr), r.stderr[-3000:]
    assert out.read_bytes() == old
    left = sorted(p.name for p in out.parent.iterdir() if p != out)
    assert len(left) <= 1 and all(n.startswith("crash.partial-") and n.endswith(".mp4") for n in left), left
    if left:  # a playable prefix of the video (at least one fragment), never all of it
        partial = out.parent / left[0]
        assert f"kept in {partial} (playable); {out} is unchanged" in r.stderr, r.stderr[-3000:]
        got = decoded(partial)
        assert signed(partial)  # AI-made: signed like a single process's kept partial
        assert 1 <= got.shape[0] < job["seq"].shape[0] == 38
        assert np.abs(got.astype(int) - job["seq"][: got.shape[0]]).max() <= 1


def test_publishing_rank_killed_keeps_a_playable_file(media, job):
    """The publishing rank itself is killed (SIGKILL: no chance to close its file) when it starts
    block 6 of 7 (3 s of speech): every fragment written before stays playable (at least block
    0's 9 frames: the publisher queue lags by a bounded number of chunks), equal to the
    single-process frames. They are in the partial file: the video already at --out is
    untouched, byte for byte (the killed rank leaves its lock file; the next run takes it over)."""
    out = job["dir"] / "killed" / "killed.mp4"
    out.parent.mkdir()
    old = (job["dir"] / "seq.mp4").read_bytes()  # an earlier video at --out
    out.write_bytes(old)
    args = [a if a != job["args"][job["args"].index("--audio") + 1] else str(media["wav_3s"])
            for a in job["args"]]
    r = torchrun(3, *args, "--out", str(out), env={"AVATARSTREAM_TPP_FAULT": "2:6"})
    assert r.returncode != 0
    assert out.read_bytes() == old
    partials = list(out.parent.glob("killed.partial-*.mp4"))
    assert len(partials) == 1, sorted(p.name for p in out.parent.iterdir())
    got = decoded(partials[0])
    seq = decoded(job["dir"] / "seq3.mp4") if (job["dir"] / "seq3.mp4").exists() else None
    if seq is None:
        done = run_cli("generate", *args, "--out", str(job["dir"] / "seq3.mp4"))
        assert done.returncode == 0, done.stderr
        seq = decoded(job["dir"] / "seq3.mp4")
    assert 9 <= got.shape[0] < seq.shape[0] == 75, got.shape
    assert np.abs(got.astype(int) - seq[: got.shape[0]]).max() <= 1


def _default_signals() -> None:
    """In the child: SIGINT and SIGTERM at their defaults, as a shell starts a command (an ignored
    disposition in the test process would otherwise be inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # a blocked mask is inherited too


def test_signing_in_a_torchrun_rank_holds_sigterm():
    """The publishing rank of a torchrun job signs and renames its file inside `interrupt.held()`
    (`ReservedOutput.close`), as a single process does. A rank keeps SIGTERM's default action
    (`install()` leaves it: the launcher must stop it inside a collective), so held() takes it for
    the block: SIGINT and SIGTERM there are recorded, and SIGTERM has its default again after.
    (Before, the SIGTERM ended the rank in the middle of signing.)"""
    code = """if True:
        import os, signal, time
        from avatarstream.publish import interrupt
        interrupt.install()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        with interrupt.held() as got:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(500):  # Python runs the handlers at its next chance: wait for both
                if len(got) == 2:
                    break
                time.sleep(0.01)
        print(interrupt.names(got), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    """
    env = {**os.environ, "RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                       preexec_fn=_default_signals)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["SIGTERM", "and", "SIGINT", "True"]


def test_sigterm_while_the_publishing_rank_signs(job):
    """SIGTERM sent to the publishing rank while it signs the finished video (a pause inside the
    signing step, `PAUSE_FOR_TESTS`, as in tests/publish/test_signals.py): the signing and the
    rename finish, the run succeeds and says so, --out is the new video, signed, and nothing is
    left beside it. (Before, the SIGTERM killed the rank in the middle of signing.)"""
    from avatarstream.provenance.credentials import PAUSE_FOR_TESTS

    d = job["dir"] / "signal"
    d.mkdir()
    out = d / "talk.mp4"
    out.write_bytes(b"an older video")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "avatarstream.parallel.launch", "generate", *job["args"], "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", PAUSE_FOR_TESTS: "2.0"})
    try:
        deadline = time.monotonic() + 120
        while not (copies := sorted(d.glob("talk.*signing-*.mp4"))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        os.kill(int(copies[0].name[: -len(".mp4")].rpartition(".signing-")[2]), signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert (f"SIGTERM came while the video was being signed: that was finished first; {out} is "
            "complete and signed") in stderr, stderr[-3000:]
    assert f"wrote {out}" in stdout
    assert sorted(p.name for p in d.iterdir()) == ["talk.mp4"]  # no partial, signing copy or lock
    assert signed(out) and decoded(out).shape[0] == 38
