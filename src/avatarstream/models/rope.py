"""3-axis rotary position embedding (time, height, width), Wan-style.

The head dimension `hd` is split into `hd / 2` rotation pairs; the height and width axes get
`(hd / 2) // 3` pairs each and time gets the rest. Positions are *float* tensors, so temporal
positions can be shifted or rolled (a reference placed at t = -8, a rolling sink, ...) without
changing the relative geometry: attention scores depend only on position differences.

Shapes:
- positions: `t, h, w` each `[N]` float (one entry per token).
- tables: `cos, sin` each `[N, hd/2]` float32.
- q / k: `[B, heads, N, hd]`; `apply_rope` returns the same shape and dtype.
"""

from __future__ import annotations

import torch


def axis_pairs(head_dim: int) -> tuple[int, int, int]:
    """Rotation pairs per axis (time, height, width); they sum to head_dim // 2."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    half = head_dim // 2
    hw = half // 3
    return half - 2 * hw, hw, hw


def _axis_freqs(pairs: int, theta: float) -> torch.Tensor:
    """[pairs] float64 inverse frequencies theta^(-2i / (2*pairs))."""
    if pairs == 0:
        return torch.zeros(0, dtype=torch.float64)
    return theta ** (-torch.arange(pairs, dtype=torch.float64) / pairs)


def rope_tables(t: torch.Tensor, h: torch.Tensor, w: torch.Tensor, head_dim: int,
                theta: float = 10000.0, *, fp16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[N, hd/2]` float32 for tokens at float positions t, h, w (each `[N]`).

    Angles are computed in float64 so large temporal offsets keep their precision. `fp16`: cos
    and sin rounded to float16 straight from float64, as a complex32 table holds them (Wan2.2-S2V
    rotates by such a table; emulating it is what fp32 parity with that code needs).
    """
    pt, ph, pw = axis_pairs(head_dim)
    ang = torch.cat([
        t.double()[:, None] * _axis_freqs(pt, theta)[None],
        h.double()[:, None] * _axis_freqs(ph, theta)[None],
        w.double()[:, None] * _axis_freqs(pw, theta)[None],
    ], dim=1)  # [N, hd/2]
    if fp16:
        return ang.cos().half().float(), ang.sin().half().float()
    return ang.cos().float(), ang.sin().float()


def grid_positions(t_pos: torch.Tensor, h: int, w: int, *, extra_tokens: int = 0,
                   extra_hw: float = -1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token positions for a frame-major layout `[T, P]` with `P = h*w + extra_tokens`.

    Each frame holds its `h*w` patch tokens in row-major order followed by `extra_tokens`
    tokens (the motion token) placed at spatial position (extra_hw, extra_hw).
    t_pos: `[T]` float. Returns t, h, w positions, each `[T * P]` float32.
    """
    t_pos = t_pos.float()
    T = t_pos.shape[0]
    hh = torch.arange(h, dtype=torch.float32).repeat_interleave(w)  # [h*w]
    ww = torch.arange(w, dtype=torch.float32).repeat(h)  # [h*w]
    if extra_tokens:
        fill = torch.full((extra_tokens,), float(extra_hw))
        hh, ww = torch.cat([hh, fill]), torch.cat([ww, fill])
    p = hh.shape[0]
    tt = t_pos.to("cpu")[:, None].expand(T, p).reshape(-1)
    return tt, hh.repeat(T), ww.repeat(T)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x `[B, heads, N, hd]` by tables `[N, hd/2]` (or `[B, 1, N, hd/2]`).

    Computed in float32, returned in x's dtype.
    """
    dt = x.dtype
    xf = x.float().unflatten(-1, (-1, 2))  # [B, H, N, hd/2, 2]: pairs (x1, x2) = x1 + i·x2
    if torch.compiler.is_compiling():  # inductor has no complex kernels; it fuses the real form
        x1, x2 = xf[..., 0], xf[..., 1]
        cos, sin = cos.to(x.device), sin.to(x.device)
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(dt)
    if xf.stride(-1) != 1 or xf.storage_offset() % 2 or any(s % 2 for s in xf.stride()[:-1]):
        xf = xf.contiguous()
    cis = torch.complex(cos.to(x.device, torch.float32), sin.to(x.device, torch.float32))
    # (x1 + i·x2)(cos + i·sin) = (x1·cos − x2·sin) + i(x1·sin + x2·cos): one complex multiply,
    # ≈ 10x faster than the four real products and the stack on the DiT's shapes
    return torch.view_as_real(torch.view_as_complex(xf) * cis).flatten(-2).to(dt)


def shift_time(x: torch.Tensor, delta: float, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Move keys already rotated by RoPE by `delta` along the time axis: x `[B, heads, N, hd]`.

    A rotation by a at position p followed by one by delta is the rotation at p + delta, so
    `shift_time(apply_rope(k, tables(t)), d) == apply_rope(k, tables(t + d))` up to float32
    rounding; height and width are untouched (their pairs rotate by angle 0). This is how a
    cached key moves in time without re-running the layers that made it (Rolling RoPE).
    """
    one = torch.zeros(1, dtype=torch.float64)
    cos, sin = rope_tables(one + float(delta), one, one, head_dim, theta)  # [1, hd/2]
    return apply_rope(x, cos, sin)


class Rope3D:
    """Convenience holder: `Rope3D(head_dim)(t_pos, h, w, extra_tokens)` -> (cos, sin) `[T*P, hd/2]`."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        self.head_dim, self.theta = head_dim, theta

    def __call__(self, t_pos: torch.Tensor, h: int, w: int, extra_tokens: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        tt, hh, ww = grid_positions(t_pos, h, w, extra_tokens=extra_tokens)
        return rope_tables(tt, hh, ww, self.head_dim, self.theta)
