"""`avatarstream curate VIDEOS... --out DIR`: real footage -> shards, manifest.json, pairs.json."""

from __future__ import annotations

import argparse
from typing import Any

from avatarstream.data.curate.pipeline import CurateConfig, curate
from avatarstream.data.curate.stretch import StretchOptions
from avatarstream.data.curate.faces import default_model_dir


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = CurateConfig(identity_threshold=args.identity_threshold, scene_threshold=args.scene_threshold,
                       stretch=StretchOptions(size=args.size, max_frames=max(1, int(round(args.max_seconds * 25)))))
    return curate(args.videos, args.out, default_model_dir(), cfg, workers=args.workers, ray_address=args.ray)
