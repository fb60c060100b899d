"""`avatarstream batch` on a real local Ray (batch/run.py, batch/manifest.py): good rows render
and verify as AI-generated while bad and failing rows are reported, a rerun renders nothing that
is done, an edited row renders again, and a renderer killed with SIGKILL mid-row loses no row and
renders none twice. tiny-random, ~1 s of speech a row."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from avatarstream.batch.jobs import load_jobs
from avatarstream.batch.manifest import sha256_file
from avatarstream.batch.run import EVENTS_FOR_TESTS, run_batch
from avatarstream.provenance.credentials import PAUSE_FOR_TESTS
from avatarstream.provenance.verify import verify

from .helpers import manifest_rows, write_csv

pytest.importorskip("ray")

HEADER = ["reference", "audio", "text", "out", "first_name"]


def _events(path) -> list[dict]:  # type: ignore[no-untyped-def]
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def first_run(inputs, ray_address, tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("batch-csv")
    rows = [["REF", "a.wav", "", "one.mp4", ""],
            ["REF", "", "Hello {first_name}, this is your video.", "two.mp4", "Ann"],
            ["missing.png", "a.wav", "", "bad.mp4", ""],
            ["not-image.png", "b.wav", "", "fails.mp4", ""],
            ["REF", "b.wav", "", "sub/three.mp4", ""]]
    jobs_csv = write_csv(inputs["dir"] / "run.csv", HEADER, [[str(inputs["ref"]) if c == "REF" else c for c in r]
                                                            for r in rows])
    jobs, bad, n = load_jobs(jobs_csv, default_model="tiny-random")
    counts = run_batch(jobs, d / "out", workers=2, retries=1)
    return {"csv": jobs_csv, "rows": rows, "out": d / "out", "jobs": jobs, "bad": bad, "counts": counts}


def test_good_rows_render_signed_while_bad_and_failing_rows_are_reported(first_run):
    out, counts = first_run["out"], first_run["counts"]
    assert [b.row for b in first_run["bad"]] == [3]  # found before any work, never sent
    assert {k: counts[k] for k in ("done", "skipped", "failed", "failed_rows")} == \
        {"done": 3, "skipped": 0, "failed": 1, "failed_rows": [4]}
    m = manifest_rows(out)
    assert set(m) == {"one.mp4", "two.mp4", "fails.mp4", "sub/three.mp4"}
    assert m["fails.mp4"]["status"] == "failed" and "not-image.png" in m["fails.mp4"]["error"]
    assert m["fails.mp4"]["attempts"] == 1  # an input error is not retried
    for name in ("one.mp4", "two.mp4", "sub/three.mp4"):
        rec = m[name]
        assert (rec["status"], rec["attempts"]) == ("done", 1)
        assert rec["sha256"] == sha256_file(out / name) and rec["media_s"] > 0.5
        report = verify(str(out / name))
        assert report["ai_generated"] and report["content_credentials"]["valid"], report
    assert m["two.mp4"]["media_s"] > 1.0  # the spoken sentence, not a stub
    left = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert left == [".batch-manifest.sqlite", "one.mp4", "three.mp4", "two.mp4"]  # no partial, lock or temp


def test_a_rerun_renders_nothing_done_and_an_edited_row_again(first_run, inputs):
    out = first_run["out"]
    before = manifest_rows(out)
    mtimes = {n: (out / n).stat().st_mtime_ns for n in ("one.mp4", "two.mp4", "sub/three.mp4")}
    jobs, _, _ = load_jobs(first_run["csv"], default_model="tiny-random")
    counts = run_batch(jobs, out, workers=1, retries=0)
    assert (counts["done"], counts["skipped"], counts["failed"]) == (0, 3, 1)  # the failed row tried again
    after = manifest_rows(out)
    for n, t in mtimes.items():
        assert (out / n).stat().st_mtime_ns == t and after[n] == before[n]
    assert after["fails.mp4"]["attempts"] == 2
    rows = [list(r) for r in first_run["rows"]]
    rows[1][4] = "Bo"  # the personalised row edited: its key changes
    edited = write_csv(inputs["dir"] / "edited.csv", HEADER,
                       [[str(inputs["ref"]) if c == "REF" else c for c in r] for r in rows])
    jobs, _, _ = load_jobs(edited, default_model="tiny-random")
    counts = run_batch(jobs, out, workers=1, retries=0)
    assert (counts["done"], counts["skipped"]) == (1, 2)
    again = manifest_rows(out)
    assert again["two.mp4"]["key"] != before["two.mp4"]["key"]
    assert again["two.mp4"]["sha256"] != before["two.mp4"]["sha256"] == after["two.mp4"]["sha256"]
    assert (out / "one.mp4").stat().st_mtime_ns == mtimes["one.mp4"]


def test_jsonl_and_parquet_rows_render(inputs, ray_address, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    jsonl = tmp_path / "jobs.jsonl"
    jsonl.write_text(json.dumps({"reference": str(inputs["ref"]), "text": "Hi {who}", "who": "you",
                                 "out": "j.mp4", "seed": 3}) + "\n")
    parquet = tmp_path / "jobs.parquet"
    pq.write_table(pa.Table.from_pylist([{"reference": str(inputs["ref"]), "audio": str(inputs["a"]),
                                          "out": "p.mp4", "size": "64x32"}]), parquet)
    jobs = [j for p in (jsonl, parquet) for j in load_jobs(p, default_model="tiny-random")[0]]
    counts = run_batch(jobs, tmp_path / "out", workers=2, retries=0)
    assert (counts["done"], counts["failed"]) == (2, 0)
    for name in ("j.mp4", "p.mp4"):
        assert verify(str(tmp_path / "out" / name))["ai_generated"]
    import av

    with av.open(str(tmp_path / "out" / "p.mp4")) as c:
        s = c.streams.video[0]
        assert (s.width, s.height) == (64, 32)  # the row's size


def test_a_renderer_killed_mid_row_loses_no_row_and_renders_none_twice(inputs, ray_address, tmp_path,
                                                                        monkeypatch):
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(EVENTS_FOR_TESTS, str(events))
    monkeypatch.setenv(PAUSE_FOR_TESTS, "0.7")  # each row waits while signing: a kill lands mid-row
    names = [f"k{i}.mp4" for i in range(4)]
    jobs_csv = write_csv(tmp_path / "kill.csv", ["reference", "audio", "out"],
                         [[str(inputs["ref"]), str(inputs["a"]), n] for n in names])
    jobs, _, _ = load_jobs(jobs_csv, default_model="tiny-random")
    killed: list[int] = []

    def kill_the_second_row() -> None:  # the renderer that started the second row, while on it
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            starts = [e for e in _events(events) if e["event"] == "start"]
            if len(starts) >= 2:
                time.sleep(0.3)
                os.kill(starts[1]["pid"], signal.SIGKILL)
                killed.append(starts[1]["pid"])
            time.sleep(0.05)

    t = threading.Thread(target=kill_the_second_row)
    t.start()
    try:
        counts = run_batch(jobs, tmp_path / "out", workers=1, retries=0)
    finally:
        t.join()
    assert killed, "no renderer was killed"
    ev = _events(events)
    assert (counts["done"], counts["failed"]) == (4, 0)
    m = manifest_rows(tmp_path / "out")
    for n in names:
        assert (m[n]["status"], m[n]["attempts"]) == ("done", 1)
        assert m[n]["sha256"] == sha256_file(tmp_path / "out" / n)
        finished = [e for e in ev if e["out"] == n and e["event"] in ("done", "adopt")]
        assert len(finished) == 1, (n, ev)  # finished once: no row lost, none rendered twice
    victim = [e for e in ev if e["pid"] == killed[0]]
    assert victim[-1]["event"] == "start"  # it died on a row, which another renderer then made
    assert sum(e["event"] == "start" for e in ev if e["out"] == victim[-1]["out"]) == 2
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert left == [".batch-manifest.sqlite", *names]  # the dead renderer's partial file is gone
