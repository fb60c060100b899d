"""Issue 30, `avatarstream generate` as a user runs it: a failed, interrupted or refused run never
loses the file already at --out; a second run writing the same path is refused; a file-size limit
(what a full disk does to a writer) ends the run with the OS's words and a whole last fragment;
inputs over the limits are refused before they are decoded; a blank reference of any colour is
refused."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import c2pa
import numpy as np
import pytest
import torch

from avatarstream.cli import build_parser
from avatarstream.engine.stages.reference import frame_validity
from avatarstream.media.image import write_png
from avatarstream.publish.output import OutputLock
from media.test_limits import write_big_png
from publish.test_atomic import OLD, top_level_boxes
from test_cli import probe


def generate(media: dict, out: Path, *extra: str, reference: Path | None = None,
             audio: str = "wav_3s") -> list[str]:
    """The command line of a tiny-random run (the conftest's media)."""
    return [sys.executable, "-m", "avatarstream.cli", "generate", "--model", "tiny-random",
            "--reference", str(reference or media["png"]), "--audio", str(media[audio]),
            "--out", str(out), "--no-progress", *extra]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("avatarstream: error:") and "Traceback" not in stderr, stderr
    return lines[0]


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture
def old_output(tmp_path) -> Path:
    out = tmp_path / "talk.mp4"
    out.write_bytes(OLD)
    return out


# -- bug 1 and bug 6 -----------------------------------------------------------------------------
@pytest.mark.parametrize("colour", [(128, 128, 128), (0, 128, 255)], ids=["grey", "blue"])
def test_a_failed_run_leaves_the_old_output(media, old_output, colour):
    """A blank reference is found after the output opened: the old file used to be deleted (bug
    1); a uniform non-grey one used to pass the check and replace it (bug 6)."""
    blank = write_png(old_output.parent / "blank.png", np.full((96, 96, 3), colour, np.uint8))
    r = run(generate(media, old_output, reference=blank))
    assert r.returncode == 2 and "blank" in one_error_line(r.stderr)
    assert old_output.read_bytes() == OLD
    assert files(old_output.parent) == ["blank.png", "talk.mp4"]  # no partial, no lock


def test_frame_validity_takes_the_spread_per_channel():
    flat = torch.tensor([0.0, 128.0, 255.0]).view(3, 1, 1, 1).expand(3, 2, 16, 16) / 127.5 - 1  # [3, F, H, W]
    assert not frame_validity(flat).any()  # the channels differ, but each is uniform: blank
    ramp = flat.clone()
    ramp[0, 1] = torch.linspace(-1, 1, 16)  # red varies across the second frame only
    assert frame_validity(ramp).tolist() == [False, True]


def interrupt_when(cmd: list[str], ready, timeout: float = 240,  # noqa: ANN001
                   sig: int = signal.SIGINT) -> tuple[int, str, dict]:
    """Run `cmd`, send `sig` (SIGINT) once `ready(event)` holds for a --events line (or, for ready taking
    None, as soon as it holds while polling); return (exit code, stderr, the last event)."""
    # a shell's background job starts with SIGINT ignored, and Python then never turns it into
    # KeyboardInterrupt: give the run the default disposition, as a terminal's Ctrl-C finds it
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    event: dict = {}
    deadline = time.time() + timeout
    try:
        if "--events" in cmd:
            for line in proc.stderr:
                if line.startswith("{"):
                    event = json.loads(line)
                    if ready(event):
                        break
                assert time.time() < deadline
        else:
            while not ready(None):
                assert proc.poll() is None and time.time() < deadline, "ended before it was interrupted"
                time.sleep(0.01)
        proc.send_signal(sig)
        rest = proc.stderr.read()
        return proc.wait(timeout=120), rest, event
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigint_after_frames_keeps_them_beside_the_old_output(media, old_output):
    cmd = generate(media, old_output, "--events", audio="wav_60s")
    code, stderr, event = interrupt_when(cmd, lambda e: e["durable_frames"] >= 25)
    assert code == 130, stderr
    assert old_output.read_bytes() == OLD
    partial = Path(event["file"])
    assert partial.parent == old_output.parent and partial.name.startswith("talk.partial-")
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("avatarstream: interrupted; the ") and "Traceback" not in stderr
    assert f"frames written are kept in {partial} (playable); {old_output} is unchanged" in last
    assert probe(partial)["frames"] >= event["durable_frames"]
    assert files(old_output.parent) == sorted(["talk.mp4", partial.name])  # the lock is gone
    with c2pa.Reader(str(partial)) as r:  # what was kept says it is AI-made, as a whole run's file
        assert r.get_validation_state() == "Valid"


def test_sigint_before_the_first_frame_leaves_the_old_output(media, old_output):
    d = old_output.parent

    def opened(_: None) -> bool:  # the new output exists (the old code truncated --out itself)
        return any(d.glob("talk.partial-*.mp4")) or old_output.stat().st_size != len(OLD)

    code, stderr, _ = interrupt_when(generate(media, old_output, audio="wav_60s"), opened)
    assert code == 130 and "Traceback" not in stderr, stderr
    assert old_output.exists() and old_output.read_bytes() == OLD
    kept = sorted(d.glob("talk.partial-*.mp4"))
    if kept:  # SIGINT came after the first frames after all: they are kept and named
        assert f"kept in {kept[0]}" in stderr and probe(kept[0])["frames"] > 0
    assert files(d) == sorted(["talk.mp4", *(k.name for k in kept)])


# -- bug 2 ---------------------------------------------------------------------------------------
def test_a_second_writer_is_refused(media, old_output):
    """Two runs with one --out used to both exit 0 with a mixed file. This process holds the
    lock the way a running `generate` does; the CLI run is refused before any model loads."""
    lock = OutputLock(old_output)
    lock.acquire()
    try:
        r = run(generate(media, old_output))
    finally:
        lock.release()
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert f"{old_output} is being written by another avatarstream run (pid {os.getpid()})" in line
    assert old_output.read_bytes() == OLD and files(old_output.parent) == ["talk.mp4"]


# -- bug 5 ---------------------------------------------------------------------------------------
def test_a_file_size_limit_ends_the_run_with_a_whole_last_fragment(media, old_output):
    """The process may write 120 kB per file (RLIMIT_FSIZE: writes past it fail with EFBIG, as
    ENOSPC on a full disk; tests/publish/test_atomic.py injects ENOSPC itself). The error names
    the file and the reason, not "Error in PyAV callback"; the kept file ends on a whole fragment."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (120_000, 120_000))

    r = run(generate(media, old_output), preexec_fn=limit)
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    (partial,) = old_output.parent.glob("talk.partial-*.mp4")
    assert f"cannot write {partial} (the new {old_output}): file too large" in line
    assert "PyAV callback" not in line and f"frames written are kept in {partial}" in line
    assert [kind for kind, _ in top_level_boxes(partial)][-1] == b"mdat"  # no cut fragment
    frames = int(line.split("; the ")[-1].split(" frames")[0])
    assert 0 < frames < 75 and probe(partial)["frames"] == frames
    assert old_output.read_bytes() == OLD


# -- bug 3 (the CLI side) ------------------------------------------------------------------------
def test_an_oversized_reference_is_refused_with_the_setting_named(media, tmp_path):
    big = write_big_png(tmp_path / "big.png", 8000, 8000)
    r = run(generate(media, tmp_path / "out.mp4", reference=big))
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert "8000x8000 pixels (64.0 MP), over the limit of 40.0 MP" in line and "--max-megapixels" in line
    assert files(tmp_path) == ["big.png"]


def test_help_states_the_limits_and_where_the_output_is_written():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["generate"].format_help().split())
    assert "--max-megapixels MP" in text and "(default 40)" in text
    assert "over 5% of the file" in text and ".partial-PID.mp4" in text and "index.m3u8 when complete" in text
