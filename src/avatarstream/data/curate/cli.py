"""`avatarstream curate VIDEOS... --out DIR`: real footage -> shards, manifest.json, pairs.json.

What it is doing goes to stderr, a line per stage, input, window and shard (`--no-progress`: none);
stdout keeps the summary."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from avatarstream.data.curate.faces import default_model_dir
from avatarstream.data.curate.normalise import Bounds
from avatarstream.data.curate.pipeline import CurateConfig, curate
from avatarstream.data.curate.stretch import StretchOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("videos", nargs="+", help="input videos (any format PyAV reads)")
    p.add_argument("--out", required=True, help="new dataset folder (index.json, shard-NNNNN/, manifest.json, pairs.json)")
    p.add_argument("--workers", type=int, default=1, help="Ray workers (CPUs of the local Ray; concurrency on a cluster)")
    p.add_argument("--ray", metavar="ADDRESS", help="a running Ray cluster (default: a local Ray for this run)")
    p.add_argument("--size", type=int, default=256, help="head crop size in pixels (the shards' frame size)")
    p.add_argument("--max-seconds", type=float, default=10.0, help="longest stretch: longer shots are read in equal windows of at most this")
    p.add_argument("--identity-threshold", type=float, default=0.5, help="dlib descriptor distance for one person")
    p.add_argument("--scene-threshold", type=float, default=0.75,
                   help="background descriptor distance for one scene (shots of one place never pair)")
    p.add_argument("--max-input-seconds", type=float, default=Bounds.max_seconds,
                   help="read at most this much of each input (the manifest says where one was cut; default %(default)g)")
    p.add_argument("--max-frame-gap", type=float, default=Bounds.max_gap_s, metavar="SECONDS",
                   help="the longest one source frame may be shown: a longer timestamp gap (or frame interval) "
                        "ends the input there, recorded in the manifest (default %(default)g)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def _say(line: str) -> None:
    print(f"avatarstream curate: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = CurateConfig(identity_threshold=args.identity_threshold, scene_threshold=args.scene_threshold,
                       stretch=StretchOptions(size=args.size, max_frames=max(1, int(round(args.max_seconds * 25)))),
                       bounds=Bounds(max_seconds=args.max_input_seconds, max_gap_s=args.max_frame_gap))
    return curate(args.videos, args.out, default_model_dir(), cfg, workers=args.workers, ray_address=args.ray,
                  progress=None if args.no_progress else _say)
