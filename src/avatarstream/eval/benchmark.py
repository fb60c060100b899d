"""`avatarstream eval benchmark`: run a model (or a baseline) on held-out synthetic cases and score it.

A case is two clips of one identity from `clip_specs` of the split (seed = --seed): clip 0 gives
the driving audio and the ground-truth render, clip 1 (another scene, other sentences) is the
reference video — the cross-scene setup of Avatar V §7.1. `--seed` re-draws identities, voices,
scenes and sentences. Models:
- `ground-truth`: the renders themselves (the level a model is held to);
- `static-frame`: the reference's first frame held still for the length of the audio;
- any registry model: `Pipeline(load_model(name)).run(reference, audio chunks, [sink])`, with FPS
  and time-to-first-frame from the run (Live Avatar §10 definitions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from avatarstream.data import Clip, DatasetConfig, clip_specs
from avatarstream.data.splits import check_split
from avatarstream.errors import ConfigError, InputError
from avatarstream.eval.experts import Experts, load_experts
from avatarstream.eval.metrics import evaluate
from avatarstream.eval.report import frame_strip, plot_case, write_report
from avatarstream.media.frames import AudioChunk, VideoChunk

BASELINES = ("ground-truth", "static-frame")
NOMINAL_CHUNK = 32  # frames: seams assumed for baselines, which have no chunks of their own


class CollectSink:
    """In-process sink keeping every published frame and the start frame of each chunk."""

    def __init__(self) -> None:
        self.frames: list[np.ndarray] = []
        self.chunk_starts: list[int] = []
        self.durable_frames = 0

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        self.fps = fps

    def write_video(self, chunk: VideoChunk) -> None:
        self.chunk_starts.append(int(chunk.start_frame))
        self.frames.extend(np.asarray(chunk.frames))
        self.durable_frames += int(chunk.frames.shape[0])

    def write_audio(self, chunk: AudioChunk) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


@dataclass
class Generated:
    """frames [F, H, W, 3] uint8; chunk_starts; fps / ttff_s of the run (None for baselines)."""

    frames: np.ndarray
    chunk_starts: list[int]
    fps: float | None = None
    ttff_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def run_model(name: str, models: Any, reference: np.ndarray, audio: np.ndarray, frames: int,
              gt: np.ndarray) -> Generated:
    """Generate `frames` frames for `audio` [N] from `reference` [F_r, S, S, 3] uint8."""
    if name == "ground-truth":
        return Generated(gt, list(range(0, frames, NOMINAL_CHUNK)))
    if name == "static-frame":
        return Generated(np.repeat(reference[:1], frames, 0), list(range(0, frames, NOMINAL_CHUNK)))
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.media.reference import square_resize, usable_frame_count

    cfg = models.config
    k = usable_frame_count(min(len(reference), cfg.ref_pixel_frames))
    ref = torch.stack([square_resize(f, cfg.hr_size) for f in reference[:k]])  # [k, 3, hr, hr]
    step = cfg.sample_rate // 5
    chunks = iter([torch.from_numpy(audio[i:i + step].copy()) for i in range(0, len(audio), step)])
    sink = CollectSink()
    summary = Pipeline(models).run(ref, chunks, [sink])
    out = np.stack(sink.frames[:frames]) if sink.frames else np.zeros((0, cfg.hr_size, cfg.hr_size, 3), np.uint8)
    if len(out) < frames:  # a model that stops short is scored on a held last frame
        pad = np.repeat(out[-1:] if len(out) else reference[:1, :cfg.hr_size, :cfg.hr_size], frames - len(out), 0)
        out = np.concatenate([out, pad])
    return Generated(out, sink.chunk_starts, fps=summary.fps, ttff_s=summary.ttff_s,
                     extra={"rtf": summary.rtf, "frames_generated": summary.frames})


def _mean(vals: list[Any]) -> float | None:
    v = [float(x) for x in vals if x is not None]
    return float(np.mean(v)) if v else None


def run_benchmark(model: str, split: str, *, seconds: float = 10.0, clips: int = 3, seed: int = 0,
                  out: Path | None = None, experts: Experts | None = None, plots: bool = True) -> dict[str, Any]:
    """Score `model` on `clips` cases of `split`; writes OUT/report.{json,md} and PNGs when `out`
    is given; returns the summary (stable keys + per-case metrics)."""
    check_split(split)
    if split == "train":
        raise InputError("benchmark splits are heldout-identity and heldout-voice (train is what the models saw)")
    if clips < 1:
        raise InputError("--clips must be at least 1")
    if not 1.0 <= seconds <= 600:
        raise InputError("--seconds must be between 1 and 600")
    models = None
    if model not in BASELINES:
        from avatarstream.registry import MODELS, available_models, load_model

        if model not in MODELS:
            raise ConfigError(f"unknown model {model!r}; available: {', '.join(BASELINES + tuple(available_models()))}")
        models = load_model(model)
    ex = experts or load_experts()
    specs = clip_specs(DatasetConfig(identities=clips, clips_per_identity=2, seconds=seconds, seed=seed, split=split))
    cases: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i in range(clips):
        target, ref_spec = specs[2 * i], specs[2 * i + 1]
        clip, ref_clip = Clip(target), Clip(ref_spec)
        gt, reference = clip.frames(), ref_clip.frames()
        gen = run_model(model, models, reference, clip.audio, len(gt), gt)
        ev = evaluate(gen.frames, clip.audio, reference, ex, ground_truth=gt, chunk_starts=gen.chunk_starts)
        m = ev.metrics
        m.update(fps=gen.fps, ttff_s=gen.ttff_s, **gen.extra)
        name = f"case{i}"
        case = {"name": name, "identity": target.identity, "voice": target.voice, "scene": target.scene,
                "reference_scene": ref_spec.scene, "text": clip.texts, "metrics": m, "drift": ev.drift}
        if out is not None and plots:
            out.mkdir(parents=True, exist_ok=True)
            gt_tr = None
            if model != "ground-truth":
                gt_ev = evaluate(gt, clip.audio, reference[:1], ex)
                gt_tr = gt_ev.tracks
            case["plots"] = plot_case(out, name, ev.tracks, gt_tr)
            case["plots"].append(frame_strip(out, name, [gen.frames, gt, reference]))
        cases.append(case)
    keys = ("sync_c", "sync_d", "face_sim", "style_error", "silence_mouth_closed", "boundary_smoothness", "psnr",
            "ssim", "fps", "ttff_s")
    summary: dict[str, Any] = {k: _mean([c["metrics"].get(k) for c in cases]) for k in keys}
    offs = [c["metrics"]["offset_frames"] for c in cases if c["metrics"]["offset_frames"] is not None]
    summary["offset_frames"] = int(np.median(offs)) if offs else None
    summary.update(model=model, split=split, seed=seed, clips=clips, seconds=seconds,
                   wall_s=round(time.perf_counter() - t0, 2),
                   cases=[{k: v for k, v in c.items() if k not in ("plots",)} for c in cases])
    if out is not None:
        path = write_report(out, summary, cases, f"Benchmark: {model} on {split} (seed {seed}, {clips} × {seconds:g} s)")
        summary["report"] = str(path)
    return summary

