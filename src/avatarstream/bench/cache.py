"""`bench cache`: attention-level reference KV caching (Avatar V sec. 4.3) on one chunk.

One full few-step chunk (4 denoising steps, chunk of 8 latent frames) of `DiTConfig.small()` with
a 16-frame reference, under bf16 autocast (as the engine runs small models):
- cached: 4 x `dit(x, sigma, cond, cache)` with the reference cache the request computed once
  (context + attention-level cache: every chunk of a stream after the first pays only this);
- first chunk: `encode_reference` + the same 4 steps (what the request's first chunk pays);
- uncached: 4 x `dit.forward_uncached(...)` (the reference is re-encoded at every step).
Each variant is timed --repeats times (interleaved); the minimum wall time of each is reported.
`speedup = uncached_ms / cached_ms` (steady state, the number the stream's throughput follows);
`speedup_first_chunk = uncached_ms / first_chunk_ms`.
"""

from __future__ import annotations

import argparse
import time

import torch

HELP = "one 4-step chunk with a 16-frame reference: cached reference K/V vs recomputed each step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny model (tests)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--ref-frames", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: bf16 where this CPU runs it fast (AVX512-bf16/AMX), else fp32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch default). Default 1: on a shared machine a "
                             "parallel region stalls whenever another process holds a core")


def run(args: argparse.Namespace) -> dict:
    from avatarstream.bench.attention import make_inputs, random_dit
    from avatarstream.models.dit import DiTConfig

    quick = bool(getattr(args, "quick", False))
    steps = int(getattr(args, "steps", 4))
    if quick:
        cfg, latent, chunk, nref, repeats = DiTConfig.tiny(), 4, 4, 4, 1
    else:
        cfg, latent = DiTConfig.small(), 16
        chunk, nref = int(getattr(args, "chunk", 8)), int(getattr(args, "ref_frames", 16))
        repeats = int(getattr(args, "repeats", 5))
    dit, dtype, ac = random_dit(args, cfg)
    x, _, cond = make_inputs(cfg, chunk, latent)
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(1, cfg.in_channels, nref, latent, latent, generator=g)
    valid = torch.ones(1, nref, dtype=torch.bool)
    t_pos = torch.full((nref,), -8.0)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)[:-1].tolist()

    def encode() -> object:
        return dit.encode_reference(lat, valid, t_pos)

    def cached(ref: object) -> torch.Tensor:
        y = x
        for s in sigmas:
            y = y - 0.25 * dit(y, torch.full((1, chunk), s), cond, ref).velocity.float()
        return y

    def uncached() -> torch.Tensor:
        y = x
        for s in sigmas:
            out = dit.forward_uncached(y, torch.full((1, chunk), s), cond, lat, valid, t_pos)
            y = y - 0.25 * out.velocity.float()
        return y

    tc, te, tu = [], [], []
    with torch.inference_mode(), ac:
        cached(encode()), uncached()  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            ref = encode()
            te.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cached(ref)
            tc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            uncached()
            tu.append(time.perf_counter() - t0)
    c_ms, e_ms, u_ms = min(tc) * 1e3, min(te) * 1e3, min(tu) * 1e3
    return {
        "speedup": round(u_ms / c_ms, 3),
        "speedup_first_chunk": round(u_ms / (c_ms + e_ms), 3),
        "cached_ms": round(c_ms, 1),
        "encode_reference_ms": round(e_ms, 1),
        "uncached_ms": round(u_ms, 1),
        "steps": steps,
        "chunk": chunk,
        "ref_frames": nref,
        "model": "tiny" if quick else "small",
        "dtype": dtype,
        "threads": torch.get_num_threads(),
    }
