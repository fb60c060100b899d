"""`bench memory`: peak memory of a short and a long generation, each in its own process.

Memory must not grow with duration: the ratio long/short is the number to watch (target <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from avatarstream.bench.inputs import face_image, speechlike, write_png, write_wav

HELP = "peak RSS of a short vs a long generation in separate processes (ratio target <= 1.05)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--short", type=float, default=10.0, help="seconds of the short run")
    parser.add_argument("--long", type=float, default=600.0, help="seconds of the long run")
    parser.add_argument("--strategy", default="prefix")


def _generate(ref: Path, audio: Path, out: Path, model: str, strategy: str) -> dict:
    cmd = [sys.executable, "-m", "avatarstream.cli", "generate", "--reference", str(ref),
           "--audio", str(audio), "--out", str(out), "--model", model, "--strategy", strategy,
           "--no-progress", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"generate failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ref = write_png(tmp / "ref.png", face_image(256))
        res = {}
        for key, seconds in (("short", args.short), ("long", args.long)):
            audio = write_wav(tmp / f"{key}.wav", speechlike(seconds))
            res[key] = _generate(ref, audio, tmp / f"{key}.mp4", args.model, args.strategy)
            (tmp / f"{key}.wav").unlink()
    short, long = res["short"]["peak_rss_mb"], res["long"]["peak_rss_mb"]
    return {
        "model": args.model,
        "strategy": args.strategy,
        "short_s": args.short,
        "long_s": args.long,
        "peak_rss_short_mb": round(short, 1),
        "peak_rss_long_mb": round(long, 1),
        "ratio": round(long / short, 4),
        "rolling_state_short_bytes": res["short"]["rolling_state_bytes"],
        "rolling_state_long_bytes": res["long"]["rolling_state_bytes"],
        "frames_long": res["long"]["frames"],
        "fps_long": round(res["long"]["fps"], 1),
    }
