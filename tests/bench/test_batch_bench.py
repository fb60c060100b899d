"""`avatarstream bench batch` run tiny, as a user runs it: the generate loop, a batch, the kill test
(a worker SIGKILLed on a row, then the batch resumed: no row lost, none rendered twice) and the
driver-memory samples, with every documented key in the JSON object on stdout's last line and the
progress on stderr. Each `batch` it runs starts a Ray of its own (~15 s on a 2-core machine)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from avatarstream.bench import batch as bench_batch

pytest.importorskip("ray")


def _documented_keys() -> set[str]:
    """The keys the module docstring lists (its `Keys (stable):` block)."""
    block = bench_batch.__doc__.split("Keys (stable):")[1].split("Media per wall")[0]
    keys = set(re.findall(r"\b[a-z][a-z0-9_]*[a-z0-9]\b", block.replace("batchN_", "batch1_")))
    return {k for k in keys if "_" in k or k in ("model", "rows", "seconds", "reference")}


@pytest.mark.soak  # alongside the rest in make test
@pytest.mark.slow  # three `batch` processes, each starting Ray and its renderers: ~80 s on 2 busy cores
def test_bench_batch_tiny_reports_every_key_and_loses_or_repeats_no_row(tmp_path):
    cmd = [sys.executable, "-m", "avatarstream.cli", "bench", "batch", "--rows", "2", "--seconds", "1",
           "--model", "tiny-random", "--workers-list", "1", "--loop-rows", "1", "--memory-rows", "8",
           "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert _documented_keys() - {"batch2_vs_batch1"} <= set(r), _documented_keys() - set(r)
    assert r["batch2_vs_batch1"] is None and "batch2_wall_s" not in r  # 2 was not in --workers-list
    assert (r["model"], r["rows"], r["loop_rows"], r["workers_list"], r["reference"]) == \
        ("tiny-random", 2, 1, [1], "synthetic")  # run outside the repository: no examples/
    assert r["loop_videos_per_min"] > 0 and r["batch1_videos_per_min"] > 0 and r["batch1_failed"] == 0
    assert r["batch1_vs_loop"] == pytest.approx(r["batch1_videos_per_min"] / r["loop_videos_per_min"], rel=0.01)
    assert r["loop_media_per_wall"] > 0 and r["batch1_media_per_wall"] > 0
    assert r["meets_target"] == (r["batch1_vs_loop"] >= 1.5)
    # the kill test: a worker really died on a row, and the resumed batch has every row once
    assert r["kill_killed_pid"] and r["kill_mid_row"] and r["kill_rows"] == 2
    assert r["rows_lost"] == 0 and r["rows_duplicated"] == 0
    assert r["kill_resume_skipped"] + r["kill_resume_rendered"] == 2
    assert r["memory_rows"] == r["memory_done"] == 8 and r["rss_samples"] >= 2
    assert 50 < r["rss_start_mb"] <= r["rss_peak_mb"] and r["rss_end_mb"] <= r["rss_peak_mb"]
    assert "bench batch:" in p.stderr and "kill test" in p.stderr  # the bar, on stderr


def test_bench_batch_mistakes_are_one_line(capsys):
    from avatarstream.cli import main

    for argv, words in ((["--workers-list", "1,x"], "--workers-list"), (["--rows", "0"], "--rows"),
                        (["--model", "nope"], "unknown model")):
        assert main(["bench", "batch", "--no-progress", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
