"""Datasets of synthetic clips: which clips a config asks for (`clip_specs`) and writing them (`generate`)."""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from avatarstream.data.clip import Clip, ClipSpec
from avatarstream.data.shards import ShardWriter, write_clip
from avatarstream.media.speech import SpeechSynthesizer
from avatarstream.data.splits import derive_seed, identity_seeds, voices_for
from avatarstream.errors import InputError

SCENES = 1_000_000  # scene seeds are drawn from [0, SCENES)


@dataclass(frozen=True)
class DatasetConfig:
    """`identities` people × `clips_per_identity` clips of `seconds` each. Every clip of a person is
    in its own scene (cross-scene pairs) and spoken with that person's voice, unless `voice` /
    `scene` pin one for all clips. `seed` draws identities, voices, scenes and sentences."""

    identities: int = 4
    clips_per_identity: int = 2
    seconds: float = 4.0
    seed: int = 0
    split: str = "train"
    size: int = 256
    voice: str | None = None
    scene: int | None = None


def clip_specs(cfg: DatasetConfig) -> list[ClipSpec]:
    """The clips of a dataset, grouped by identity (clips k·K … k·K + K − 1 are one person)."""
    if cfg.identities < 1 or cfg.clips_per_identity < 1:
        raise InputError("--identities and --clips-per-identity must be at least 1")
    if not 0.04 <= cfg.seconds <= 3600:
        raise InputError(f"--seconds must be between 0.04 and 3600, got {cfg.seconds}")
    if not 32 <= cfg.size <= 1024 or cfg.size % 8:
        raise InputError(f"--size must be a multiple of 8 between 32 and 1024, got {cfg.size}")
    voices = voices_for(cfg.split, cfg.voice)
    specs = []
    for ident in identity_seeds(cfg.seed, cfg.identities, cfg.split):
        voice = voices[derive_seed(cfg.seed, ident, "voice") % len(voices)].id
        scenes: list[int] = []
        for k in range(cfg.clips_per_identity):
            if cfg.scene is not None:
                scene = int(cfg.scene)
            else:
                j = 0
                while (scene := derive_seed(cfg.seed, ident, "scene", k, j) % SCENES) in scenes:
                    j += 1
            scenes.append(scene)
            specs.append(ClipSpec(identity=ident, scene=scene, voice=voice, seed=derive_seed(cfg.seed, ident, "clip", k),
                                  seconds=float(cfg.seconds), size=cfg.size, split=cfg.split))
    return specs


def generate(cfg: DatasetConfig, out: str | Path, *, shard_size: int = 64, workers: int = 1,
             progress: bool = False) -> dict[str, Any]:
    """Render every clip of `cfg` into a dataset folder; returns a summary (clips, seconds, wall_s,
    x_realtime = seconds of video made per second of wall time). `workers` > 1 renders clips in
    that many processes (one torch thread each); the dataset is the same byte for byte, in the
    same order, whatever the number of workers."""
    specs = clip_specs(cfg)
    t0 = time.perf_counter()
    seconds = 0.0
    with ShardWriter(out, shard_size) as w:  # checks the folder is writable before any work
        jobs = [(w.root, w.shard_of(i), spec) for i, spec in enumerate(specs)]
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(specs), desc="rendering clips", unit="clip")
        if workers <= 1:
            synth = SpeechSynthesizer()
            entries = (write_clip(root, shard, Clip(spec, synth)) for root, shard, spec in jobs)
            pool = None
        else:
            ctx = multiprocessing.get_context("spawn")  # no forked torch / espeak-ng state
            pool = ctx.Pool(workers, initializer=_worker_init)
            entries = pool.imap(_render_job, jobs)  # in order: the index is the same for any `workers`
        try:
            for e in entries:
                w.add(e)
                seconds += e["seconds"]
                if bar is not None:
                    bar.update(1)
        finally:
            if pool is not None:
                pool.terminate()
            if bar is not None:
                bar.close()
    wall = time.perf_counter() - t0
    return {"out": str(out), "clips": len(specs), "seconds": round(seconds, 3), "wall_s": round(wall, 2),
            "x_realtime": round(seconds / max(wall, 1e-9), 2), "split": cfg.split,
            "identities": cfg.identities, "size": cfg.size, "workers": max(1, workers)}


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)


def _render_job(job: tuple[Path, str, ClipSpec]) -> dict[str, Any]:
    root, shard, spec = job
    return write_clip(root, shard, Clip(spec))
