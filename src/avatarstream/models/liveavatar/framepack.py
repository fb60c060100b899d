"""FramePack motion conditioning (key `frame_packer`): the last motion latents as a few tokens.

The newest `buckets[0]` latents are patchified like the noisy latents (`proj`, patch p), the next
`buckets[1]` at 2× compression in every axis (`proj_2x`, kernel 2p), the oldest `buckets[2]` at 4×
(`proj_4x`, kernel 4p). With the released (1, 2, 16) and patch 1×2×2 that is the last 19 latents as
P + P/4 + 4·P/16 tokens for P patches per frame (fewer than 19 latents: zeros in front).

Positions (`framepack_positions`): bucket k sits at negative times counted back from the newest
latent (-1; -3; -19, -14, -9, -4 for the released buckets), its compressed grid spread over the
patch grid with `numpy.linspace(0, n - 1, n / s).astype(int)` (s = 2, 4), as the official code
samples its table. Negative times rotate by the negative angle. These tokens never move in time:
only the reference does (the rolling rule in `sink.py`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

SCALES = (1, 2, 4)  # compression of the three buckets, newest first


class FramePack(nn.Module):
    def __init__(self, channels: int, dim: int, patch: tuple[int, int, int],
                 buckets: tuple[int, int, int]) -> None:
        super().__init__()
        self.buckets = buckets
        pt, ph, pw = patch
        for name, s in zip(("proj", "proj_2x", "proj_4x"), SCALES):
            kernel = (pt * s, ph * s, pw * s)
            self.add_module(name, nn.Conv3d(channels, dim, kernel_size=kernel, stride=kernel))

    @property
    def frames(self) -> int:
        """Motion latents read (the newest ones)."""
        return sum(self.buckets)

    def forward(self, motion: torch.Tensor) -> torch.Tensor:
        """motion `[B, C, T_m, H, W]` -> tokens `[B, N_m, D]`, ordered newest bucket first."""
        b, c, t, hh, ww = motion.shape
        n = self.frames
        padded = motion.new_zeros(b, c, n, hh, ww)
        keep = min(n, t)
        if keep:
            padded[:, :, n - keep:] = motion[:, :, t - keep:]
        oldest_first = padded.split(list(self.buckets[::-1]), dim=2)  # 4x, 2x, 1x latents
        projs = (self.proj, self.proj_2x, self.proj_4x)
        toks = [proj(lat).flatten(2).transpose(1, 2) for proj, lat in zip(projs, oldest_first[::-1])]
        return torch.cat(toks, dim=1)


def _spread(grid: int, count: int) -> np.ndarray:
    """`count` integer positions spread over `0 .. grid - 1` (the official table sampling)."""
    return np.linspace(0, grid - 1, count).astype(int)


def framepack_positions(buckets: tuple[int, int, int], patch: tuple[int, int, int], lat_h: int,
                        lat_w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t, h, w `[N_m]` float64 RoPE positions of `FramePack` tokens for motion latents of
    lat_h × lat_w, in the token order of `FramePack.forward`."""
    _, ph, pw = patch
    gh, gw = lat_h // ph, lat_w // pw  # the patch grid of one latent frame
    ts, hs, ws = [], [], []
    back = 0
    for size, s in zip(buckets, SCALES):
        back += size
        frames = size // s
        # times -back .. -(back - size + 1), `frames` of them, sampled as the official table is
        times = -np.linspace(back, back - size + 1, frames).astype(int)
        rows, cols = _spread(gh, lat_h // (ph * s)), _spread(gw, lat_w // (pw * s))
        t3, h3, w3 = np.meshgrid(times, rows, cols, indexing="ij")  # [frames, rows, cols]
        ts.append(t3.ravel())
        hs.append(h3.ravel())
        ws.append(w3.ravel())
    t, h, w = (torch.from_numpy(np.concatenate(a).astype(np.float64)) for a in (ts, hs, ws))
    return t, h, w
