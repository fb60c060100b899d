"""`avatarstream synth`: render a synthetic talking-head dataset with exact ground truth."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from avatarstream.data.generate import DatasetConfig, generate
from avatarstream.data.splits import SPLITS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="dataset folder (index.json + shard-NNNNN/)")
    p.add_argument("--identities", type=int, default=4, help="number of people")
    p.add_argument("--clips-per-identity", type=int, default=2, help="clips per person, each in its own scene")
    p.add_argument("--seconds", type=float, default=4.0, help="length of each clip")
    p.add_argument("--seed", type=int, default=0, help="draws identities, voices, scenes and sentences")
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--voice", help="one voice for every clip (e.g. espeak:de+m2, flite:slt)")
    p.add_argument("--scene", type=int, help="one scene seed for every clip")
    p.add_argument("--size", type=int, default=256, help="frame size in pixels (square)")
    p.add_argument("--shard-size", type=int, default=64, help="clips per shard folder")
    p.add_argument("--workers", type=int, default=1, help="processes rendering clips (one core each)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = DatasetConfig(identities=args.identities, clips_per_identity=args.clips_per_identity,
                        seconds=args.seconds, seed=args.seed, split=args.split, size=args.size,
                        voice=args.voice, scene=args.scene)
    return generate(cfg, Path(args.out), shard_size=args.shard_size, workers=args.workers, progress=not args.json)
