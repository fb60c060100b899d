"""`bench engine`: one generation through the full chunk loop into a real fMP4 file.

Reports time-to-first-frame, fps, real-time factor, per-stage ms, the share of the chunk loop's
wall time spent outside model forwards (`overhead_share`, target <= 0.10), and the DiT's FLOPs
utilisation: achieved GFLOP/s inside DiT forwards over this machine's measured matmul GFLOP/s in
the same dtype (measured in the same process, since timings swing run to run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from avatarstream.bench.inputs import face_image, speechlike

HELP = "full chunk loop into an fMP4 file: ttff, fps, per-stage ms, overhead share, DiT utilisation"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of speech to generate")
    parser.add_argument("--strategy", default="prefix")
    parser.add_argument("--steps", type=int, default=None)


def matmul_gflops(dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def dit_forward_flops(models, cfg, ref_frames: int) -> int:  # type: ignore[no-untyped-def]
    """FLOPs of one DiT forward at the chunk's shape (FlopCounterMode: matmuls and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    from avatarstream.models.transformer import DiTCondition

    dit = models.dit.model
    h = cfg.lr_size // 8
    t = cfg.chunk
    x = torch.randn(1, cfg.latent_channels, t, h, h)
    with torch.inference_mode():
        ref = dit.encode_reference(torch.randn(1, cfg.latent_channels, ref_frames, h, h), None,
                                   torch.full((ref_frames,), cfg.ref_t_position))
        text, mask = models.text.model.encode([""])
        a = dit.config.audio_tokens
        cond = DiTCondition(motion=torch.randn(1, t, cfg.motion_dim),
                            audio=torch.randn(1, t, a, dit.config.audio_dim), text=text,
                            text_mask=mask, t_pos=torch.arange(t, dtype=torch.float32))
        with FlopCounterMode(display=False) as fc:
            dit(x, torch.full((1, t), 0.5), cond, ref)
    return int(fc.get_total_flops())


def run(args: argparse.Namespace) -> dict:
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.publish.file import FragmentedMP4Sink
    from avatarstream.registry import load_model

    models = load_model(args.model)
    cfg = models.config
    cfg.strategy = args.strategy
    if args.steps:
        cfg.steps = args.steps
    ref = torch.from_numpy(face_image(cfg.hr_size)).permute(2, 0, 1).unsqueeze(0)  # [1, 3, H, W]
    audio = torch.from_numpy(speechlike(args.seconds))
    chunks = iter(audio.split(cfg.sample_rate // 5))
    with tempfile.TemporaryDirectory() as d:
        sink = FragmentedMP4Sink(Path(d) / "out.mp4")
        sink.open(cfg.hr_size, cfg.hr_size, cfg.fps, cfg.sample_rate)
        summary = Pipeline(models).run(ref, chunks, [sink])
        sink.close()
    dit = models.dit
    flops = dit_forward_flops(models, cfg, ref_frames=2 if cfg.strategy == "prefix" else 1)
    achieved = flops * dit.calls / dit.forward_seconds / 1e9 if dit.forward_seconds else 0.0
    dtype = dit.autocast_dtype or torch.float32
    peak = matmul_gflops(dtype)
    return {
        "model": args.model,
        "strategy": cfg.strategy,
        "steps": cfg.steps,
        "resolution": cfg.hr_size,
        "seconds": args.seconds,
        "ttff_s": round(summary.ttff_s or 0.0, 3),
        "fps": round(summary.fps, 2),
        "rtf": round(summary.rtf, 3),
        "overhead_share": round(summary.overhead_share, 4),
        "stage_ms": {k: round(v, 2) for k, v in summary.stage_ms.items()},
        "module_s": {k: round(v, 3) for k, v in summary.module_s.items()},
        "reference_ms": round(summary.reference_ms, 1),
        "peak_rss_mb": round(summary.peak_rss_mb, 1),
        "dit_gflop_per_forward": round(flops / 1e9, 4),
        "dit_achieved_gflops": round(achieved, 2),
        "matmul_peak_gflops": round(peak, 1),
        "dit_utilisation": round(achieved / peak, 4) if peak else 0.0,
        "compute_dtype": str(dtype).replace("torch.", ""),
    }
