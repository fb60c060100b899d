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

Other models and machines (the seam for LiveAvatar): `--model` takes any name the registry
resolves (an official folder such as `liveavatar:DIR` once its family is registered), the
reference is drawn at the model's own output geometry (`PipelineConfig.out_hw`), `--device cuda`
runs both on GPUs (one per rank), `--launcher torchrun` starts the pipeline's ranks with
`torchrun --standalone` (`parallel/launch.py`) instead of the CLI's own spawn, `--no-sequential`
skips the one-process baseline (a 14B model may not fit one GPU without offload), and
`--generate-arg=...` (repeatable) passes a model's own options to both runs.
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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where both runs put the models (cuda: one GPU per rank)")
    parser.add_argument("--launcher", choices=["cli", "torchrun"], default="cli",
                        help="who starts the pipeline's processes: `generate --workers` itself, or "
                             "torchrun --standalone (parallel/launch.py)")
    parser.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the one-process baseline (--no-sequential: skip it)")
    parser.add_argument("--generate-arg", action="append", default=[], metavar="ARG",
                        help="one more `generate` argument for both runs (repeatable; "
                             "--generate-arg=--flag)")


def _cpus(n: int | None) -> list[int]:
    have = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if n is None:
        return have
    if not 1 <= n <= len(have):
        raise ConfigError(f"--cores must be between 1 and {len(have)} here")
    return have[:n]


def _generate(args: list[str], cpus: list[int], torchrun: int = 0) -> dict:
    """One `generate` run pinned to `cpus`; torchrun: that many ranks started by torchrun."""
    cmd = [sys.executable, "-m", "avatarstream.cli", "generate", *args, "--no-progress", "--json"]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}",
               "-m", "avatarstream.parallel.launch", *cmd[3:]]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if hasattr(os, "sched_setaffinity") else None
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=pin)
    if proc.returncode != 0:
        raise RuntimeError(f"generate failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    from avatarstream.registry import model_spec_for, resolve_model

    args.model = resolve_model(args.model, causal=True)
    spec_cfg = model_spec_for(args.model).pipeline()
    steps = args.steps or spec_cfg.steps
    if not 1 <= args.workers <= steps:
        raise ConfigError(f"--workers must be between 1 and the number of steps ({steps})")
    if args.seconds < 1:
        raise ConfigError("--seconds must be at least 1")
    cpus = _cpus(args.cores)
    procs = args.workers + 1 + args.split_decode
    per_proc = max(1, len(cpus) // procs)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ref = write_png(tmp / "ref.png", face_image(max(spec_cfg.out_hw)))
        audio = write_wav(tmp / "speech.wav", speechlike(args.seconds))
        common = ["--model", args.model, "--reference", str(ref), "--audio", str(audio),
                  "--strategy", "causal", "--steps", str(steps), "--device", args.device,
                  *args.generate_arg]
        by_threads = {}
        for th in sorted({1, len(cpus)}) if args.sequential else []:
            by_threads[th] = _generate([*common, "--out", str(tmp / "seq.mp4"), "--threads", str(th)], cpus)
        pipe = _generate([*common, "--out", str(tmp / "tpp.mp4"), "--threads", str(per_proc),
                          "--workers", str(args.workers), *(["--split-decode"] if args.split_decode else [])],
                         cpus, torchrun=procs if args.launcher == "torchrun" else 0)
    out = {
        "fps_pipeline": round(pipe["fps"], 2),
        "fps_sequential": None,  # None with --no-sequential
        "speedup": None,
        "launcher": args.launcher,
        "device": args.device,
        "workers": args.workers,
        "processes": procs,
        "split_decode": args.split_decode,
        "step_shares": pipe["step_shares"],
        "rank_parts": pipe.get("rank_parts"),  # the networks each rank loaded
        "cores": len(cpus),
        "threads_per_process": per_proc,
        "model": args.model,
        "steps": steps,
        "seconds": args.seconds,
        "frames": pipe["frames"],
        "ttff_pipeline_s": round(pipe["ttff_s"] or 0.0, 3),
        "stage_ms_decode_worker": {k: round(v, 1) for k, v in pipe["stage_ms"].items()},
        "peak_rss_mb_decode_worker": round(pipe["peak_rss_mb"], 1),
    }
    if by_threads:
        best = max(by_threads, key=lambda th: by_threads[th]["fps"])
        seq = by_threads[best]
        out.update({
            "fps_sequential": round(seq["fps"], 2),
            "speedup": round(pipe["fps"] / seq["fps"], 3) if seq["fps"] else None,
            "threads_sequential": best,
            "fps_sequential_by_threads": {str(k): round(v["fps"], 2) for k, v in by_threads.items()},
            "frames": seq["frames"],
            "ttff_sequential_s": round(seq["ttff_s"] or 0.0, 3),
            "stage_ms_sequential": {k: round(v, 1) for k, v in seq["stage_ms"].items()},
            "peak_rss_mb_sequential": round(seq["peak_rss_mb"], 1),
        })
    return out
