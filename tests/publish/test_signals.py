"""Issue 38.9, `avatarstream generate` as a user runs it, signalled at its last step: a signal that
comes while the finished video is being signed (C2PA) lets the signing finish and says where the
signed video is; SIGTERM ends a run as Ctrl-C does (what was written is kept and named, no lock
file stays); a signing copy left by kill -9 is removed by the next run of the same output.

The signing of a 3-second tiny video takes milliseconds: these runs set
AVATARSTREAM_TEST_SIGNING_PAUSE_S (provenance/credentials.py), a wait inside the signing step with
the signed copy written, and the test sends its signal once that copy appears on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import c2pa
import pytest

from avatarstream.provenance.credentials import PAUSE_FOR_TESTS
from test_outputs import OLD, files, generate, interrupt_when


def _start(cmd: list[str], pause: float | None) -> subprocess.Popen:
    env = dict(os.environ)
    if pause is not None:
        env[PAUSE_FOR_TESTS] = str(pause)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _signing_copy(d: Path, proc: subprocess.Popen, timeout: float = 240) -> Path:
    deadline = time.monotonic() + timeout
    while True:
        copies = sorted(d.glob("talk.*signing-*.mp4"))
        if copies:
            return copies[0]
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)


def _signed(path: Path) -> bool:
    with c2pa.Reader(str(path)) as r:
        return r.get_validation_state() == "Valid"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_signing_lets_the_signing_finish(media, tmp_path, sig):
    out = tmp_path / "talk.mp4"
    proc = _start(generate(media, out), pause=2.0)
    try:
        _signing_copy(tmp_path, proc)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    name = signal.Signals(sig).name
    assert (f"{name} came while the video was being signed: that was finished first; {out} is "
            "complete and signed") in stderr and "Traceback" not in stderr
    assert f"wrote {out}" in stdout and _signed(out)
    assert files(tmp_path) == ["talk.mp4"]  # no partial, no signing copy, no lock


def test_sigterm_ends_a_run_as_ctrl_c_does(media, tmp_path):
    out = tmp_path / "talk.mp4"
    out.write_bytes(OLD)
    cmd = generate(media, out, "--events", audio="wav_60s")
    code, stderr, event = interrupt_when(cmd, lambda e: e["durable_frames"] >= 25, sig=signal.SIGTERM)
    assert code == 130, stderr
    partial = Path(event["file"])
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("avatarstream: terminated (SIGTERM); the ") and "Traceback" not in stderr
    assert f"frames written are kept in {partial} (playable); {out} is unchanged" in last
    assert out.read_bytes() == OLD and files(tmp_path) == sorted(["talk.mp4", partial.name])  # no lock
    assert _signed(partial)


def test_what_kill_9_leaves_while_signing_is_cleaned_by_the_next_run(media, tmp_path):
    out = tmp_path / "talk.mp4"
    proc = _start(generate(media, out), pause=60.0)
    try:
        copy = _signing_copy(tmp_path, proc)
        time.sleep(0.2)
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    (partial,) = (p for p in tmp_path.glob("talk.partial-*.mp4") if p != copy)
    assert files(tmp_path) == sorted([copy.name, partial.name, "talk.mp4.lock"])
    r = subprocess.run(generate(media, out), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"what it wrote is in {partial}" in r.stderr  # the killed run's video is kept and named
    assert files(tmp_path) == sorted(["talk.mp4", partial.name])  # its signing copy and lock: gone
    assert _signed(out)
