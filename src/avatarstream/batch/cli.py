"""`avatarstream batch JOBS --out DIR`: one video per row of a CSV, JSONL or Parquet file, rendered
on Ray (docs/batch.md). The command line of cli.py imports this module only when batch runs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from avatarstream.errors import ConfigError, OutputError

def configure(p: argparse.ArgumentParser, rest: list[str] | None = None) -> None:
    p.add_argument("jobs", metavar="JOBS", help="a .csv, .jsonl or .parquet file: one row per video with "
                   "the columns reference, audio or text (+ voice), out, and optional model, size, "
                   "strategy, seed; any other column is a field of the text ({first_name})")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder the videos go to (made if "
                   "missing); its .batch-manifest.sqlite records each row, so a rerun resumes")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="renderers, each with its model loaded once (default 1; with --device cuda one GPU each)")
    p.add_argument("--retries", type=int, default=1, metavar="N",
                   help="try a row whose render crashed up to N more times (default 1; an input "
                        "error is not retried)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run on this Ray cluster (HEAD:6379, ray://HEAD:10001, or auto: the one "
                        "`ray start` runs on this machine); default: a local Ray for this run")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the renderers run (cuda: one GPU per worker)")
    p.add_argument("--model", default=None,
                   help="the model of rows without a `model` (default: the bundled model, else tiny-random)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object last")
    p.set_defaults(func=cmd_batch)


def _out_dir(value: str) -> Path:
    d = Path(value)
    if d.exists() and not d.is_dir():
        raise OutputError(f"--out {d} is a file; give a folder for the videos")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot make the output folder {d}: {e.strerror or e}") from e
    if not os.access(d, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write into the output folder {d}")
    return d


def cmd_batch(args: argparse.Namespace) -> int:
    from avatarstream.batch.jobs import load_jobs
    from avatarstream.registry import resolve_model

    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    if args.retries < 0:
        raise ConfigError(f"--retries must be 0 or more, got {args.retries}")
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("batch runs on Ray, which is not installed: pip install 'avatarstream[curate]'")
    if args.device == "cuda" and args.ray is None:  # on a cluster the GPUs are the workers'
        from avatarstream.hardware import check_device

        check_device("cuda")
    model = resolve_model(args.model)
    jobs, bad, n_rows = load_jobs(args.jobs, default_model=model)
    out_dir = _out_dir(args.out)
    for b in bad:  # every bad row, before any work
        print(f"avatarstream: skipping {b}", file=sys.stderr)
    from avatarstream.provenance.credentials import credentials_for

    credentials_for(model)  # a bad AVATARSTREAM_SIGN_CERT/KEY: now, not in every worker
    from avatarstream.batch.run import run_batch

    bar = _Progress(args.no_progress)
    try:
        counts = run_batch(jobs, out_dir, workers=args.workers, retries=args.retries,
                           device=args.device, address=args.ray, progress=bar.update, start=bar.start)
    finally:
        bar.close()
    summary = _summary(counts, n_rows, bad)
    adopted = f" (+{counts['adopted']} finished by an interrupted run)" if counts["adopted"] else ""
    print(f"{counts['done']} rendered{adopted}, {summary['skipped']} already done, {summary['failed']} failed, "
          f"{summary['bad_rows']} bad row(s) of {n_rows} -> {out_dir} "
          f"({summary['wall_s']:.1f} s, {summary['videos_per_min']:.1f} videos/min)")
    problems = []
    if counts["failed_rows"]:
        problems.append(f"{len(counts['failed_rows'])} row(s) failed: rows "
                        f"{_rows(counts['failed_rows'])} (errors in {out_dir}/.batch-manifest.sqlite; rerun to retry)")
    if bad:
        problems.append(f"{len(bad)} bad row(s) skipped: rows {_rows([b.row for b in bad])}")
    if problems:
        print("avatarstream: " + "; ".join(problems), file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
    return 1 if problems else 0


def _rows(rows: list[int], most: int = 20) -> str:
    shown = ", ".join(map(str, rows[:most]))
    return shown + (f" and {len(rows) - most} more" if len(rows) > most else "")


def _summary(counts: dict[str, Any], n_rows: int, bad: list) -> dict[str, Any]:
    wall = counts["wall_s"]
    done = counts["done"] + counts["adopted"]
    return {"rows": n_rows, "done": done, "skipped": counts["skipped"], "failed": counts["failed"],
            "bad_rows": len(bad), "media_s": round(counts["media_s"], 3), "wall_s": round(wall, 3),
            "videos_per_min": round(60.0 * done / wall, 2) if wall > 0 else 0.0,
            "failed_rows": counts["failed_rows"], "adopted": counts["adopted"]}


class _Progress:
    """The bar on stderr (tqdm, as generate's): rows done/failed, seconds of video per wall
    second, and tqdm's ETA over the rows left."""

    def __init__(self, off: bool) -> None:
        self.off = off
        self.bar: Any = None
        self.done = self.failed = 0
        self.media = 0.0
        self.t0 = time.perf_counter()

    def start(self, total: int) -> None:
        if self.off or total == 0:
            return
        from tqdm import tqdm

        self.t0 = time.perf_counter()
        self.bar = tqdm(total=total, unit="video", desc="rendering", file=sys.stderr,
                        dynamic_ncols=True, smoothing=0.1)

    def update(self, out: str, result: dict[str, Any]) -> None:
        if result["status"] == "done":
            self.done += 1
            self.media += result.get("media_s") or 0.0
        else:
            self.failed += 1
        if self.bar is not None:
            elapsed = time.perf_counter() - self.t0
            self.bar.update(1)
            self.bar.set_postfix(done=self.done, failed=self.failed,
                                 speed=f"{self.media / elapsed:.2f}x" if elapsed > 0 else "-")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
