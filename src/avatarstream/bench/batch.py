"""`avatarstream bench batch`: what `avatarstream batch` gains over a shell loop of `generate`, and
that it neither loses nor repeats a row when a worker dies, nor grows its driver's memory.

Makes `--rows` rows of `--seconds` of synthetic speech each (WAV files in a temporary folder; the
reference is `examples/reference.png` when run from the repository, else a synthetic face) and,
in one run, on the same rows, runs each as a user would (separate processes, Ray started by each
`batch` for itself, so its start-up is in every batch's wall time):

- a loop of `avatarstream generate` processes, one per row (each loads the model again). To keep
  the benchmark short the loop runs on the first `loop_rows` = min(rows, --loop-rows) rows only,
  and its videos per minute are measured on those;
- `avatarstream batch` over all rows with each worker count of `--workers-list` (1 and 2);
- the kill test: a batch of `kill_rows` = min(rows, max(2, --loop-rows)) rows with 2 workers, where a
  worker process is SIGKILLed while on a row (found as tests/batch do: the renderers' event
  file; each row of this batch pauses 0.5 s while signing, so the kill lands on a row), then the
  same batch run again (the resume). `rows_lost`: rows without a finished output
  whose sha256 matches the manifest; `rows_duplicated`: rows rendered to the end more than once
  (a `done` event twice, or manifest attempts > 1). Both must be 0;
- the memory test (`--memory-rows`, 0: skipped): a batch of that many tiny-random rows of
  `--memory-seconds` of speech, the driver's RSS (/proc/PID/status VmRSS) sampled twice a second
  with the rows done so far (its manifest).

Keys (stable):
  model, rows, seconds, reference, workers_list, loop_rows
  loop_wall_s, loop_videos_per_min, loop_media_per_wall     the generate loop (on loop_rows rows)
  batchN_wall_s, batchN_videos_per_min, batchN_media_per_wall, batchN_failed   per N of --workers-list
  batch1_vs_loop, batch2_vs_batch1    ratios of videos per minute (null when a side was not run)
  target_batch1_vs_loop (1.5), meets_target
  kill_rows, kill_killed_pid, kill_mid_row (the killed worker's last event was a row's start),
  kill_first_exit, kill_resume_skipped, kill_resume_rendered, rows_lost, rows_duplicated
  memory_rows, memory_done, memory_seconds, memory_wall_s (the whole process), memory_s_per_row
  (wall seconds a row once rows are being recorded), rss_start_mb (when the first row
  was recorded: Ray and the pool up), rss_end_mb (the last sample), rss_peak_mb,
  rss_slope_mb_per_100_rows (least squares over the samples of the second half of the rows),
  rss_samples
Media per wall: seconds of video made per wall second. Progress: a bar on stderr
(`--no-progress`: none); stdout's last line is the JSON object.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from avatarstream.batch.manifest import NAME as MANIFEST
from avatarstream.batch.manifest import sha256_file
from avatarstream.batch.run import EVENTS_FOR_TESTS as EVENTS
from avatarstream.bench.soak_measure import process_rss_mb
from avatarstream.errors import ConfigError, InputError
from avatarstream.provenance.credentials import PAUSE_FOR_TESTS

HELP = ("batch vs a generate loop (videos/min, 1 and 2 workers), no row lost or repeated after a "
        "worker is killed, flat driver memory over many rows")
TARGET = 1.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=40, help="rows (videos) of the batches (default 40)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds of speech a row (default 3)")
    p.add_argument("--model", default=None, help="model (default: the registry's default)")
    p.add_argument("--workers-list", default="1,2", metavar="N,N",
                   help="the batch's worker counts to measure (default 1,2)")
    p.add_argument("--loop-rows", type=int, default=8, metavar="K",
                   help="rows the generate loop and the kill test run on (default 8)")
    p.add_argument("--memory-rows", type=int, default=1000, metavar="N",
                   help="tiny-random rows of the driver-memory test (default 1000; 0: skip it)")
    p.add_argument("--memory-seconds", type=float, default=0.2,
                   help="seconds of speech a row of the memory test (default 0.2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _workers(text: str) -> list[int]:
    try:
        ws = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ConfigError(f"--workers-list {text!r}: give worker counts like 1,2") from None
    if not ws or min(ws) < 1:
        raise ConfigError(f"--workers-list {text!r}: give worker counts of at least 1, like 1,2")
    return ws


def _write_jobs(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["reference", "audio", "out"])
        w.writerows(rows)
    return path


def _batch_cmd(jobs: Path, out: Path, model: str, workers: int) -> list[str]:
    return [sys.executable, "-m", "avatarstream.cli", "batch", str(jobs), "--out", str(out),
            "--model", model, "--workers", str(workers), "--json", "--no-progress"]


def _summary(proc: subprocess.CompletedProcess | Any, stdout: str, stderr: str) -> dict:
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        last = stderr.strip().splitlines()[-1:] or [""]
        raise InputError(f"batch failed ({proc.returncode}): {last[0]}") from None


def _run_batch(jobs: Path, out: Path, model: str, workers: int, env: dict | None = None) -> tuple[dict, float, int]:
    """One `avatarstream batch` process -> (its --json summary, process wall seconds, exit status)."""
    t0 = time.perf_counter()
    proc = subprocess.run(_batch_cmd(jobs, out, model, workers), capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    return _summary(proc, proc.stdout, proc.stderr), wall, proc.returncode


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def _manifest(out_dir: Path) -> dict[str, dict]:
    db = sqlite3.connect(f"file:{out_dir / MANIFEST}?mode=ro", uri=True, timeout=1.0)
    try:
        db.row_factory = sqlite3.Row
        return {r["out"]: dict(r) for r in db.execute("SELECT * FROM rows")}
    finally:
        db.close()


def kill_test(jobs: Path, names: list[str], out: Path, model: str, tmp: Path) -> dict[str, Any]:
    """A 2-worker batch with one worker SIGKILLed on a row, then the same batch again."""
    events = tmp / "kill-events.jsonl"
    # each row waits 0.5 s while signing: the kill lands on a row, not between two
    env = {**os.environ, EVENTS: str(events), PAUSE_FOR_TESTS: "0.5"}
    # its output into files: a pipe nobody reads while this loop polls would block it when full
    out_f, err_f = open(tmp / "kill.out", "w+"), open(tmp / "kill.err", "w+")
    proc = subprocess.Popen(_batch_cmd(jobs, out, model, 2), stdout=out_f, stderr=err_f, text=True, env=env)
    victim: dict | None = None
    while proc.poll() is None and victim is None:
        ev = _events(events)
        starts = [e for e in ev if e["event"] == "start"]
        ended = {(e["out"], e["pid"]) for e in ev if e["event"] in ("done", "adopt")}
        # the worker of the latest row still being rendered (all rows started, or two workers up)
        if len(starts) >= min(2, len(names)):
            victim = next((e for e in reversed(starts) if (e["out"], e["pid"]) not in ended), None)
            if victim is not None:
                try:
                    os.kill(victim["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    victim = None
        time.sleep(0.05)
    proc.wait()
    with out_f, err_f:
        out_f.seek(0)
        err_f.seek(0)
        first = _summary(proc, out_f.read(), err_f.read())
    second, _, _ = _run_batch(jobs, out, model, 2, {**env, PAUSE_FOR_TESTS: "0"})  # the resume
    m = _manifest(out)
    ev = _events(events)
    lost = sum(1 for n in names if not (n in m and m[n]["status"] == "done" and (out / n).is_file()
                                         and sha256_file(out / n) == m[n]["sha256"]))
    dup = sum(1 for n in names if (m.get(n, {}).get("attempts") or 0) > 1
              or sum(e["out"] == n and e["event"] == "done" for e in ev) > 1)
    mid_row = victim is not None and [e for e in ev if e["pid"] == victim["pid"]][-1]["event"] == "start"
    return {"kill_rows": len(names), "kill_killed_pid": None if victim is None else victim["pid"],
            "kill_mid_row": mid_row, "kill_first_exit": proc.returncode,
            "kill_first_done": first["done"], "kill_resume_skipped": second["skipped"],
            "kill_resume_rendered": second["done"], "rows_lost": lost, "rows_duplicated": dup}


def _done_rows(out: Path) -> int | None:
    if not (out / MANIFEST).exists():
        return None
    try:
        db = sqlite3.connect(f"file:{out / MANIFEST}?mode=ro", uri=True, timeout=0.2)
        try:
            return int(db.execute("SELECT COUNT(*) FROM rows WHERE status = 'done'").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:  # being written, or not made yet
        return None


def slope_per_100(samples: list[tuple[int, float]], rows: int) -> float | None:
    """MB per 100 rows, least squares over the samples (rows done, MB) of the second half."""
    pts = [(r, m) for r, m in samples if r >= rows / 2]
    if len({r for r, _ in pts}) < 2:
        return None
    n = len(pts)
    mx, my = sum(r for r, _ in pts) / n, sum(m for _, m in pts) / n
    sxx = sum((r - mx) ** 2 for r, _ in pts)
    return round(100.0 * sum((r - mx) * (m - my) for r, m in pts) / sxx, 3)


MEMORY_KEYS = ("memory_rows", "memory_done", "memory_seconds", "memory_wall_s", "memory_s_per_row",
               "rss_start_mb", "rss_end_mb", "rss_peak_mb", "rss_samples", "rss_slope_mb_per_100_rows")


def _s_per_row(times: list[tuple[float, int]]) -> float | None:
    """Wall seconds a row once the pool runs: from the first sample to the last."""
    if len(times) < 2 or times[-1][1] == times[0][1]:
        return None
    return round((times[-1][0] - times[0][0]) / (times[-1][1] - times[0][1]), 4)


def memory_test(jobs: Path, rows: int, out: Path, workers: int) -> dict[str, Any]:
    """One tiny-random batch of `rows` rows; the driver's RSS against the rows done."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(_batch_cmd(jobs, out, "tiny-random", workers), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    samples: list[tuple[int, float]] = []  # (rows done, MB)
    times: list[tuple[float, int]] = []  # (seconds, rows done)
    peak = 0.0
    import threading

    streams: dict[str, str] = {}
    reader = threading.Thread(target=lambda: streams.update(zip(("out", "err"), proc.communicate())))
    reader.start()  # the pipes drained while sampling
    while proc.poll() is None:
        rss, done = process_rss_mb(proc.pid), _done_rows(out)
        if rss is not None:
            peak = max(peak, rss)
            if done:  # from the first recorded row: Ray and the pool are up
                samples.append((done, rss))
                times.append((time.perf_counter() - t0, done))
        time.sleep(0.5)
    reader.join()
    wall = time.perf_counter() - t0
    summary = _summary(proc, streams.get("out", ""), streams.get("err", ""))
    return {"memory_rows": rows, "memory_done": summary["done"], "memory_wall_s": round(wall, 2),
            "memory_s_per_row": _s_per_row(times),
            "rss_start_mb": round(samples[0][1], 1) if samples else None,
            "rss_end_mb": round(samples[-1][1], 1) if samples else None,
            "rss_peak_mb": round(peak, 1), "rss_samples": len(samples),
            "rss_slope_mb_per_100_rows": slope_per_100(samples, rows)}


def _bar(total: int, off: bool):  # noqa: ANN202 - a tqdm bar
    from tqdm import tqdm

    bar = tqdm(total=total, desc="bench batch", unit="step", file=sys.stderr, disable=off,
               dynamic_ncols=True, bar_format="{desc}: {n}/{total} steps [{elapsed}<{remaining}{postfix}]")
    bar.refresh()
    return bar


def run(args: argparse.Namespace) -> dict[str, Any]:
    from avatarstream.bench.inputs import face_image, speechlike, write_png, write_wav
    from avatarstream.bench.realtime import generate_once
    from avatarstream.registry import model_spec_for, resolve_model

    if args.rows < 1 or args.loop_rows < 1 or args.memory_rows < 0:
        raise ConfigError("--rows and --loop-rows must be at least 1, --memory-rows 0 or more")
    if not 0 < args.seconds <= 600 or not 0 < args.memory_seconds <= 60:
        raise ConfigError("--seconds must be in (0, 600], --memory-seconds in (0, 60]")
    workers_list = _workers(args.workers_list)
    model = resolve_model(args.model)
    model_spec_for(model)  # an unknown model: ConfigError now
    k = min(args.rows, args.loop_rows)
    res: dict[str, Any] = {"model": model, "rows": args.rows, "seconds": args.seconds,
                           "workers_list": workers_list, "loop_rows": k}
    bar = _bar(k + len(workers_list) + 1 + (1 if args.memory_rows else 0), args.no_progress)
    with tempfile.TemporaryDirectory(prefix="avatarstream-bench-batch-") as d:
        tmp = Path(d)
        example = Path("examples/reference.png")
        ref = example.resolve() if example.is_file() else write_png(tmp / "ref.png", face_image(256))
        res["reference"] = "examples/reference.png" if example.is_file() else "synthetic"
        names = [f"v{i:04d}.mp4" for i in range(args.rows)]
        wavs = [write_wav(tmp / f"s{i:04d}.wav", speechlike(args.seconds, seed=i)) for i in range(args.rows)]
        jobs = _write_jobs(tmp / "jobs.csv", [(str(ref), str(w), n) for w, n in zip(wavs, names)])

        media, t0 = 0.0, time.perf_counter()
        for i in range(k):
            bar.set_postfix_str(f"generate loop, row {i + 1}/{k}")
            summary, _, out = generate_once(model, str(ref), str(wavs[i]))
            media += summary["duration_s"]
            out.unlink(missing_ok=True)
            out.parent.rmdir()
            bar.update(1)
        wall = time.perf_counter() - t0
        res.update(loop_wall_s=round(wall, 2), loop_videos_per_min=round(60.0 * k / wall, 2),
                   loop_media_per_wall=round(media / wall, 3))

        for w in workers_list:
            bar.set_postfix_str(f"batch of {args.rows} rows, {w} worker(s)")
            s, wall, _ = _run_batch(jobs, tmp / f"batch{w}", model, w)
            res.update({f"batch{w}_wall_s": round(wall, 2),
                        f"batch{w}_videos_per_min": round(60.0 * s["done"] / wall, 2),
                        f"batch{w}_media_per_wall": round(s["media_s"] / wall, 3),
                        f"batch{w}_failed": s["failed"] + s["bad_rows"]})
            bar.update(1)
        vpm = {w: res[f"batch{w}_videos_per_min"] for w in workers_list}
        res["batch1_vs_loop"] = round(vpm[1] / res["loop_videos_per_min"], 3) if 1 in vpm else None
        res["batch2_vs_batch1"] = round(vpm[2] / vpm[1], 3) if 1 in vpm and 2 in vpm else None
        res["target_batch1_vs_loop"] = TARGET
        res["meets_target"] = res["batch1_vs_loop"] is not None and res["batch1_vs_loop"] >= TARGET

        kr = min(args.rows, max(2, k))
        bar.set_postfix_str(f"kill test: {kr} rows, 2 workers, one SIGKILLed, then resumed")
        kill_jobs = _write_jobs(tmp / "kill.csv", [(str(ref), str(w), n) for w, n in zip(wavs[:kr], names[:kr])])
        res.update(kill_test(kill_jobs, names[:kr], tmp / "kill", model, tmp))
        bar.update(1)

        if args.memory_rows:
            bar.set_postfix_str(f"memory: {args.memory_rows} tiny-random rows")
            short = write_wav(tmp / "short.wav", speechlike(args.memory_seconds, seed=7))
            tiny_ref = write_png(tmp / "tiny-ref.png", face_image(64))
            mem_jobs = _write_jobs(tmp / "memory.csv", [(str(tiny_ref), str(short), f"m{i:05d}.mp4")
                                                        for i in range(args.memory_rows)])
            res.update(memory_test(mem_jobs, args.memory_rows, tmp / "memory", max(workers_list)))
            res["memory_seconds"] = args.memory_seconds
            bar.update(1)
        else:
            res.update(dict.fromkeys(MEMORY_KEYS), memory_rows=0)
    bar.close()
    return res
