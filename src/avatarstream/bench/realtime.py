"""`avatarstream bench realtime`: can a user's machine generate as fast as it plays?

Runs `avatarstream generate` exactly as a user would (a separate process, the real reference and
speech files, mp3 decoding, audio features, every network, H.264 + AAC encoding into the
fragmented MP4) and reports, from that run:

- `rtf`: real-time factor = media seconds produced / wall seconds of generation (≥ 1: at least
  as fast as playback). Note: `generate --json`'s own `rtf` is the inverse (wall per media
  second, < 1 is fast); this benchmark reports the user-facing direction the targets use.
- `ttff_s`: from the start of generation (model loaded; the reference is encoded inside it) to
  the first published frame.
- `fps`: frames published per wall second.
- `process_s` / `load_s`: the whole command, and what it spent before generation (imports, model
  weights, reading the reference).
- `profile`: each chunk-loop stage's share of a chunk's time, and `limit`: the largest (what to
  make faster first).
- the invisible watermark's cost (on by default in `generate`, so every key above is measured
  with it): each repeat also runs `generate --no-watermark` (after it, or before: alternating),
  and `rtf_no_watermark` (the best of those), `watermark_rtf_ratio` (rtf / rtf_no_watermark: 1.0
  means it costs nothing; it runs on the publisher's thread) and `watermark_ms_per_frame`
  (marking one frame of this size in this process, the median of 5 chunks) report it from the
  same run. On a shared machine the ratio is as noisy as the two rtfs: use `--repeat`.

Defaults: the default model (the bundled one when present), `examples/reference.png`,
`examples/speech.mp3` (a held-out identity and a held-out voice), all CPU cores.

Progress: a bar on stderr (tqdm: runs done of 2 x --repeat, what runs now, the last rtf;
`--no-progress`: none); stdout keeps the JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from avatarstream.engine.config import SIZE_HELP, parse_size
from avatarstream.errors import ConfigError, InputError

HELP = "end-to-end generation speed of a real `generate` run: rtf (media/wall), ttff_s, fps"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name (default: the registry's default)")
    p.add_argument("--reference", default="examples/reference.png")
    p.add_argument("--audio", default="examples/speech.mp3")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--strategy", default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where generate runs the models (cuda: the first GPU; an error when there is none)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: generate's own: all cores, all but one for causal)")
    p.add_argument("--repeat", type=int, default=1, help="runs; the fastest is reported")
    p.add_argument("--size", default=None, metavar="WxH", help=SIZE_HELP)
    p.add_argument("--decode-inline", action="store_true",
                   help="decode in the generating thread (the A/B of the overlapped decode)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def generate_once(model: str, reference: str, audio: str, *, steps: int | None = None,
                  strategy: str | None = None, threads: int | None = None,
                  extra: list[str] | None = None) -> tuple[dict, float, Path]:
    """One `avatarstream generate` process -> (its --json summary, process wall seconds, out
    file). The output lives in a temporary folder the caller removes (returned path's parent)."""
    out = Path(tempfile.mkdtemp(prefix="avatarstream-bench-")) / "out.mp4"
    cmd = [sys.executable, "-m", "avatarstream.cli", "generate", "--reference", reference, "--audio", audio,
           "--out", str(out), "--model", model, "--json", "--no-progress"]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if strategy is not None:
        cmd += ["--strategy", strategy]
    if threads:  # else generate's own default (hardware.generation_threads)
        cmd += ["--threads", str(threads)]
    cmd += extra or []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise InputError(f"generate failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:] or ''}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall, out


def summarise(summary: dict, process_s: float) -> dict:
    """The benchmark's keys from one generate summary."""
    stage = summary.get("stage_ms", {})
    chunk_ms = sum(stage.values()) or 1.0
    profile = {k: round(v / chunk_ms, 3) for k, v in stage.items()}
    return {
        "rtf": round(summary["duration_s"] / summary["wall_s"], 3) if summary["wall_s"] else 0.0,
        "ttff_s": round(summary["ttff_s"] or 0.0, 3),
        "fps": round(summary["fps"], 2),
        "frames": summary["frames"],
        "media_s": round(summary["duration_s"], 2),
        "wall_s": round(summary["wall_s"], 2),
        "process_s": round(process_s, 2),
        "load_s": round(process_s - summary["wall_s"], 2),
        "stage_ms": {k: round(v, 1) for k, v in stage.items()},
        "reference_ms": round(summary.get("reference_ms", 0.0), 1),
        "profile": profile,
        "limit": max(profile, key=profile.get) if profile else None,
        "peak_rss_mb": round(summary.get("peak_rss_mb", 0.0), 1),
    }


def run(args: argparse.Namespace) -> dict:
    from avatarstream.hardware import check_device
    from avatarstream.registry import model_spec_for, resolve_model

    check_device(args.device)
    model = resolve_model(args.model)
    for p in (args.reference, args.audio):
        if not Path(p).is_file():
            raise InputError(f"{p}: not found (run from the repository root, or pass --reference/--audio)")
    if args.repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    pipe = model_spec_for(model).pipeline()
    if args.size is not None:  # checked here, before a generate process is started
        pipe = pipe.with_size(*parse_size(args.size))
    size_args = [] if args.size is None else ["--size", args.size]
    best = None
    best_off = 0.0  # rtf without the watermark, measured beside each marked run
    bar = _bar(2 * args.repeat, getattr(args, "no_progress", False))
    for i in range(args.repeat):
        for marked in ((True, False) if i % 2 == 0 else (False, True)):  # neither always first
            bar.set_postfix_str(f"generate {model}, watermark {'on' if marked else 'off'}")
            summary, process_s, out = generate_once(
                model, args.reference, args.audio, steps=args.steps, strategy=args.strategy,
                threads=args.threads, extra=["--device", args.device, *size_args]
                + (["--decode-inline"] if args.decode_inline else []) + ([] if marked else ["--no-watermark"]))
            out.unlink(missing_ok=True)
            out.parent.rmdir()
            r = summarise(summary, process_s)
            r["threads"] = summary["threads"]  # what generate used (its own default unless --threads)
            bar.update(1)
            bar.set_postfix_str(f"last rtf {r['rtf']:.2f} (watermark {'on' if marked else 'off'})")
            if not marked:
                best_off = max(best_off, r["rtf"])
            elif best is None or r["rtf"] > best["rtf"]:
                best = r
    bar.close()
    assert best is not None
    return {**best, "model": model, "steps": args.steps or pipe.steps, "strategy": args.strategy or pipe.strategy,
            "threads": best["threads"], "resolution": pipe.hr_size, "size": f"{pipe.out_hw[1]}x{pipe.out_hw[0]}",
            "decode_overlap": not args.decode_inline, "device": args.device,
            "watermark": True, "rtf_no_watermark": best_off,
            "watermark_rtf_ratio": round(best["rtf"] / best_off, 3) if best_off else None,
            "watermark_ms_per_frame": round(embed_ms_per_frame(*pipe.out_hw), 3)}


def _bar(total: int, off: bool):  # noqa: ANN202 - a tqdm bar
    """The progress bar on stderr (disabled: draws nothing)."""
    import sys

    from tqdm import tqdm

    bar = tqdm(total=total, desc="bench realtime", unit="run", file=sys.stderr, disable=off,
               dynamic_ncols=True, bar_format="{desc}: {n}/{total} runs [{elapsed}<{remaining}{postfix}]")
    bar.refresh()  # at once: the first run takes a while
    return bar


def embed_ms_per_frame(height: int, width: int, frames: int = 8, repeats: int = 5) -> float:
    """Milliseconds to watermark one height x width frame (median of `repeats` chunks of `frames`)."""
    import numpy as np

    from avatarstream.provenance.watermark import embed

    x = np.random.default_rng(0).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    embed(x)  # the pattern and the interpolation matrices are built once per size
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        embed(x)
        times.append((time.perf_counter() - t0) * 1000 / frames)
    return float(np.median(times))
