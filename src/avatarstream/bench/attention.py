"""`bench attention`: how the DiT's per-step cost grows with the reference length.

For R reference latent frames (1, 2, 4, ..., 64) we time one denoising step of the DiT:
- sparse: `dit(x, sigma, cond, ref_cache)` with the reference K/V cached (what every sampler step
  runs; `encode_reference` is done once per request and is *not* in the per-step time);
- dense: `dit.forward_dense(...)`: one concatenated [ref ; gen] sequence with the asymmetric
  block mask, reference tokens recomputed (the plain implementation).

What is fitted: the least-squares slope of log(best-of-repeats ms) against log(R) over the reference
lengths R >= --fit-min (default 8), where the reference part of the cost is no longer negligible
next to the fixed cost of the chunk's own tokens. Sparse attention makes each generation token
attend to R*P + T*P keys (linear in R), so its exponent is <= 1 (below 1 while the fixed cost
still weighs); the dense sequence has (R+T)*P tokens attending to each other, so its exponent
climbs towards 2 as R grows. The fit over all R is reported too (`*_exponent_all`).

Model: `DiTConfig.small()` widths (dim 192, 3 heads, FFN 768, latent 16x16, chunk 8) with
--depth layers (default 2) so the sweep runs in about a minute on 2 cores; random weights.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import time

import torch

from avatarstream.hardware import bf16_is_fast

HELP = "DiT per-step time vs reference length: sparse (cached) vs dense attention exponents"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny model, R in 1,2,4 (tests)")
    parser.add_argument("--depth", type=int, default=2, help="layers of the small()-width model")
    parser.add_argument("--max-ref", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=8, help="latent frames per chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fit-min", type=int, default=8, help="smallest R in the fit")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: bf16 where this CPU runs it fast (AVX512-bf16/AMX), else fp32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch default). Default 1: on a shared machine a "
                             "parallel region stalls whenever another process holds a core")


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sxx if sxx else 0.0


def _min_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Best of `repeats` timed calls after one warm-up (the minimum filters out the time slices
    lost to other processes on a shared machine)."""
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return min(ts)


def make_inputs(cfg, chunk: int, latent: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """Random chunk inputs: x [1,C,T,h,w], sigma [1,T], DiTCondition."""
    from avatarstream.models.transformer import DiTCondition

    g = torch.Generator().manual_seed(seed)
    t = chunk
    x = torch.randn(1, cfg.in_channels, t, latent, latent, generator=g)
    sigma = torch.full((1, t), 0.5)
    cond = DiTCondition(motion=torch.randn(1, t, cfg.motion_dim, generator=g),
                        audio=torch.randn(1, t, cfg.audio_tokens, cfg.audio_dim, generator=g),
                        text=torch.randn(1, 8, cfg.text_dim, generator=g),
                        text_mask=torch.ones(1, 8, dtype=torch.bool),
                        t_pos=torch.arange(t, dtype=torch.float32))
    return x, sigma, cond


def random_dit(args: argparse.Namespace, cfg):  # type: ignore[no-untyped-def]
    """The DiT the model benchmarks time, set up as their `--threads` and `--dtype` ask.

    Returns (dit, dtype, autocast): random weights from seed 0 (the same model on every run, so
    runs compare), `dtype` with "auto" resolved (bf16 where this CPU runs it fast, else fp32), and
    the autocast context to time it under.
    """
    from avatarstream.models.dit import VideoRefDiT

    threads = int(getattr(args, "threads", 0) or 0)
    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(args, "dtype", "auto")
    if dtype == "auto":
        dtype = "bf16" if bf16_is_fast("cpu") else "fp32"
    torch.manual_seed(0)
    dit = VideoRefDiT(cfg).eval()
    dit.init_random_(0)
    ac = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16"
          else contextlib.nullcontext())
    return dit, dtype, ac


def run(args: argparse.Namespace) -> dict:
    from avatarstream.models.dit import DiTConfig

    quick = bool(getattr(args, "quick", False))
    if quick:
        cfg, latent, chunk, max_ref, repeats, fit_min = DiTConfig.tiny(), 4, 4, 4, 1, 1
    else:
        cfg = dataclasses.replace(DiTConfig.small(), depth=int(getattr(args, "depth", 2)))
        latent, chunk = 16, int(getattr(args, "chunk", 8))
        max_ref, repeats = int(getattr(args, "max_ref", 64)), int(getattr(args, "repeats", 5))
        fit_min = int(getattr(args, "fit_min", 8))
    dit, dtype, ac = random_dit(args, cfg)
    x, sigma, cond = make_inputs(cfg, chunk, latent)
    refs = [r for r in (1, 2, 4, 8, 16, 32, 64, 128) if r <= max_ref]
    sparse_ms, dense_ms = [], []
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode(), ac:
        for r in refs:
            lat = torch.randn(1, cfg.in_channels, r, latent, latent, generator=g)
            t_pos = torch.full((r,), -8.0)
            cache = dit.encode_reference(lat, None, t_pos)
            sparse_ms.append(_min_ms(lambda: dit(x, sigma, cond, cache), repeats))
            dense_ms.append(_min_ms(lambda: dit.forward_dense(x, sigma, cond, lat, None, t_pos),
                                       repeats))
    sel = [i for i, r in enumerate(refs) if r >= fit_min]
    if len(sel) < 2:
        sel = list(range(len(refs)))
    fx = [float(refs[i]) for i in sel]
    return {
        "sparse_exponent": round(fit_exponent(fx, [sparse_ms[i] for i in sel]), 3),
        "dense_exponent": round(fit_exponent(fx, [dense_ms[i] for i in sel]), 3),
        "sparse_exponent_all": round(fit_exponent([float(r) for r in refs], sparse_ms), 3),
        "dense_exponent_all": round(fit_exponent([float(r) for r in refs], dense_ms), 3),
        "fit_ref_frames": [refs[i] for i in sel],
        "ref_frames": refs,
        "sparse_ms": [round(v, 2) for v in sparse_ms],
        "dense_ms": [round(v, 2) for v in dense_ms],
        "fitted": "least-squares slope of log(best-of-repeats per-step ms) vs log(R) over fit_ref_frames",
        "config": {"dim": cfg.dim, "depth": cfg.depth, "heads": cfg.heads, "chunk": chunk,
                   "latent": latent, "tokens_per_frame": (latent // 2) ** 2 + 1},
        "dtype": dtype,
        "threads": torch.get_num_threads(),
    }
