"""`bench synth`: how fast the synthetic domain is made, on one core.

Renders `--clips` training clips of `--seconds` each at `--size` px, one thread, and times the three
parts of making a clip: speech (espeak-ng / flite + phone timings), annotation (visemes, motion,
face states), then rendering and writing the shard (lossless H.264 RGB + PCM + JSON); `render_fps` is
the renderer alone. The fastest of `--repeats` whole runs is reported (this machine's timings swing
2-3x between runs).
`x_realtime_per_core` = seconds of video made per second of wall time (issue 4 target: >= 20).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

HELP = "synthetic data generation speed on one core (x real time; target >= 20)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="whole runs; the fastest is reported")


def run(args: argparse.Namespace) -> dict:
    import torch

    from avatarstream.data.generate import DatasetConfig, clip_specs

    torch.set_num_threads(1)
    specs = clip_specs(DatasetConfig(identities=args.clips, clips_per_identity=1, seconds=args.seconds,
                                     seed=args.seed, size=args.size))
    best: dict[str, float] = {}
    for _ in range(max(1, args.repeats)):
        r = _once(specs)
        if not best or r["wall_s"] < best["wall_s"]:
            best = r
    seconds = sum(s.frames for s in specs) / 25
    return {"clips": len(specs), "seconds": round(seconds, 2), "size": args.size, "threads": 1,
            "x_realtime_per_core": round(seconds / best["wall_s"], 2), "repeats": max(1, args.repeats),
            **{k: round(v, 3) for k, v in best.items()}}


def _once(specs: list) -> dict[str, float]:
    """One pass over the clips: speech + annotation, then render + encode + write; then the
    renderer alone on the last clip."""
    from avatarstream.data.clip import Clip
    from avatarstream.data.shards import ShardWriter
    from avatarstream.media.speech import SpeechSynthesizer

    synth = SpeechSynthesizer(cache_size=0)  # no memo: every sentence is synthesised
    t_clip = t_write = 0.0
    with tempfile.TemporaryDirectory() as d:
        w = ShardWriter(Path(d) / "ds")
        for spec in specs:
            a = time.perf_counter()
            clip = Clip(spec, synth)
            b = time.perf_counter()
            w.write(clip)  # render + encode + write
            t_clip += b - a
            t_write += time.perf_counter() - b
        w.close()
        t = time.perf_counter()
        n = len(clip.frames())
        render_fps = n / (time.perf_counter() - t)
    return {"wall_s": t_clip + t_write, "speech_and_annotation_s": t_clip, "render_and_write_s": t_write,
            "render_fps": render_fps}
