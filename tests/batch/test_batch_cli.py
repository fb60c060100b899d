"""`avatarstream batch` as a user runs it: mistakes are one line and an exit code, the summary is
the last stdout line, and a driver killed with SIGKILL mid-batch is resumed by a rerun with every
row done exactly once (the rows it had finished neither rendered again nor changed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from avatarstream.batch.manifest import sha256_file
from avatarstream.batch.run import EVENTS_FOR_TESTS
from avatarstream.cli import main
from avatarstream.provenance.credentials import PAUSE_FOR_TESTS

from .helpers import manifest_rows, write_csv


def test_user_mistakes_are_one_line_and_a_nonzero_exit(inputs, tmp_path, capsys):
    jobs = write_csv(tmp_path / "jobs.csv", ["reference", "audio", "out"], [[str(inputs["ref"]), str(inputs["a"]), "a.mp4"]])
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [(["batch", str(tmp_path / "none.csv"), "--out", str(tmp_path / "o")], "does not exist"),
             (["batch", str(tmp_path / "jobs.xlsx"), "--out", str(tmp_path / "o")], "unknown JOBS format"),
             (["batch", str(jobs), "--out", str(a_file)], "is a file; give a folder"),
             (["batch", str(jobs), "--out", str(tmp_path / "o"), "--model", "nope"], "unknown model"),
             (["batch", str(jobs), "--out", str(tmp_path / "o"), "--workers", "0"], "--workers must be")]
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_only_bad_rows_exit_1_naming_them_without_starting_ray(inputs, tmp_path, capsys):
    jobs = write_csv(tmp_path / "jobs.csv", ["reference", "audio", "out"],
                     [["missing.png", str(inputs["a"]), "a.mp4"], [str(inputs["ref"]), str(inputs["a"]), "/abs.mp4"]])
    assert main(["batch", str(jobs), "--out", str(tmp_path / "o"), "--json", "--model", "tiny-random"]) == 1
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert {k: summary[k] for k in ("rows", "done", "skipped", "failed", "bad_rows")} == \
        {"rows": 2, "done": 0, "skipped": 0, "failed": 0, "bad_rows": 2}
    assert "skipping row 1: reference missing.png not found" in err and "skipping row 2: out /abs.mp4" in err
    assert "2 bad row(s) skipped: rows 1, 2" in err.strip().splitlines()[-1]


def _batch(jobs, out, address, env):  # type: ignore[no-untyped-def]
    return subprocess.Popen([sys.executable, "-m", "avatarstream.cli", "batch", str(jobs), "--out", str(out),
                             "--ray", address, "--model", "tiny-random", "--workers", "2", "--json",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_a_driver_killed_mid_batch_is_resumed_with_every_row_done_once(inputs, ray_address, tmp_path):
    pytest.importorskip("ray")
    names = [f"d{i}.mp4" for i in range(5)]
    jobs = write_csv(tmp_path / "jobs.csv", ["reference", "audio", "out"],
                     [[str(inputs["ref"]), str(inputs["b"]), n] for n in names])
    out = tmp_path / "out"
    events = tmp_path / "events.jsonl"
    env = {**os.environ, EVENTS_FOR_TESTS: str(events), PAUSE_FOR_TESTS: "0.5", "OMP_NUM_THREADS": "1"}
    first = _batch(jobs, out, ray_address, env)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and first.poll() is None:
            if (out / ".batch-manifest.sqlite").exists() and any(
                    r["status"] == "done" for r in manifest_rows(out).values()):
                break
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    before = manifest_rows(out)
    finished = {n: r for n, r in before.items() if r["status"] == "done"}
    assert finished and len(finished) < len(names), before  # killed mid-batch
    mtimes = {n: (out / n).stat().st_mtime_ns for n in finished}

    second = _batch(jobs, out, ray_address, {**env, PAUSE_FOR_TESTS: "0"})
    stdout, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["rows"] == 5 and summary["failed"] == 0 and summary["skipped"] == len(finished)
    assert summary["skipped"] + summary["done"] == 5
    after = manifest_rows(out)
    for n in names:
        assert (after[n]["status"], after[n]["attempts"]) == ("done", 1), after[n]
        assert after[n]["sha256"] == sha256_file(out / n)
    for n, rec in finished.items():  # the rows done before the kill: untouched
        assert after[n]["sha256"] == rec["sha256"] and (out / n).stat().st_mtime_ns == mtimes[n]
    ev = [json.loads(line) for line in events.read_text().splitlines()]
    for n in names:  # rendered to the end once each (a render the kill interrupted restarts)
        assert sum(e["out"] == n and e["event"] == "done" for e in ev) <= 1, (n, ev)
        assert any(e["out"] == n and e["event"] in ("done", "adopt") for e in ev), (n, ev)
    assert sorted(p.name for p in out.iterdir()) == [".batch-manifest.sqlite", *names]
