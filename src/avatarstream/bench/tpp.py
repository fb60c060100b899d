"""`bench tpp`: timestep-forcing pipeline parallelism against sequential causal generation on the
same cores.

Both runs are real `avatarstream generate --strategy causal` processes over the same speech, each
pinned (CPU affinity) to the same `--cores` CPUs:
- sequential: one process, every step of every block in turn, with 1 and with `cores` torch
  threads; the faster counts (on a shared machine many threads on few free cores can be far
  slower than one: OpenMP threads wait for each other);
- pipeline: `--workers N` denoise processes + 1 decode process (+ 1 refine process with
  `--split-decode`), started by the CLI, the cores' threads shared among them
  (`max(1, cores // processes)` each).
fps is the decode process's published frames over its wall time (start to last frame), as in
`generate`; speedup = fps_pipeline / fps_sequential. With fewer cores than processes the workers
time-share the cores and the speedup is bounded by cores / (work per frame), not by N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from avatarstream.bench.inputs import face_image, speechlike, write_png, write_wav
from avatarstream.errors import ConfigError

HELP = "causal generation: --workers N pipeline (TPP) vs one sequential process on the same cores"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="denoise worker processes (+1 decode)")
    parser.add_argument("--model", default=None,
                        help="model name or weights folder (default: the bundled causal student, "
                             "avatarstream-small-causal, where it ships)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of speech to generate")
    parser.add_argument("--cores", type=int, default=None,
                        help="CPUs both runs are pinned to (default: all this process may use)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--split-decode", action="store_true",
                        help="SR refiner and VAE decode in two processes (workers + 2 in all)")


def _cpus(n: int | None) -> list[int]:
    have = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if n is None:
        return have
    if not 1 <= n <= len(have):
        raise ConfigError(f"--cores must be between 1 and {len(have)} here")
    return have[:n]


def _generate(args: list[str], cpus: list[int]) -> dict:
    cmd = [sys.executable, "-m", "avatarstream.cli", "generate", *args, "--no-progress", "--json"]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if hasattr(os, "sched_setaffinity") else None
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=pin)
    if proc.returncode != 0:
        raise RuntimeError(f"generate failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    from avatarstream.registry import model_spec_for, resolve_model

    args.model = resolve_model(args.model, causal=True)
    steps = args.steps or model_spec_for(args.model).pipeline().steps
    if not 1 <= args.workers <= steps:
        raise ConfigError(f"--workers must be between 1 and the number of steps ({steps})")
    if args.seconds < 1:
        raise ConfigError("--seconds must be at least 1")
    cpus = _cpus(args.cores)
    procs = args.workers + 1 + args.split_decode
    per_proc = max(1, len(cpus) // procs)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ref = write_png(tmp / "ref.png", face_image(256))
        audio = write_wav(tmp / "speech.wav", speechlike(args.seconds))
        common = ["--model", args.model, "--reference", str(ref), "--audio", str(audio),
                  "--strategy", "causal", "--steps", str(steps)]
        by_threads = {}
        for th in sorted({1, len(cpus)}):
            by_threads[th] = _generate([*common, "--out", str(tmp / "seq.mp4"), "--threads", str(th)], cpus)
        best = max(by_threads, key=lambda th: by_threads[th]["fps"])
        seq = by_threads[best]
        pipe = _generate([*common, "--out", str(tmp / "tpp.mp4"), "--threads", str(per_proc),
                          "--workers", str(args.workers), *(["--split-decode"] if args.split_decode else [])],
                         cpus)
    return {
        "fps_pipeline": round(pipe["fps"], 2),
        "fps_sequential": round(seq["fps"], 2),
        "speedup": round(pipe["fps"] / seq["fps"], 3) if seq["fps"] else None,
        "workers": args.workers,
        "processes": procs,
        "split_decode": args.split_decode,
        "step_shares": pipe["step_shares"],
        "cores": len(cpus),
        "threads_sequential": best,
        "fps_sequential_by_threads": {str(k): round(v["fps"], 2) for k, v in by_threads.items()},
        "threads_per_process": per_proc,
        "model": args.model,
        "steps": steps,
        "seconds": args.seconds,
        "frames": seq["frames"],
        "ttff_pipeline_s": round(pipe["ttff_s"] or 0.0, 3),
        "ttff_sequential_s": round(seq["ttff_s"] or 0.0, 3),
        "stage_ms_sequential": {k: round(v, 1) for k, v in seq["stage_ms"].items()},
        "stage_ms_decode_worker": {k: round(v, 1) for k, v in pipe["stage_ms"].items()},
        "peak_rss_mb_sequential": round(seq["peak_rss_mb"], 1),
        "peak_rss_mb_decode_worker": round(pipe["peak_rss_mb"], 1),
    }
