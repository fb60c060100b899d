"""Colour correction to the reference: per frame, the CIE Lab mean and standard deviation of each
channel are matched to the reference image's, then blended with the frame at a strength.

Why: a few-step distilled video model drifts in colour from chunk to chunk, and FlashHead feeds its
own decoded frames back as the next chunk's motion latents, so a small cast would compound over a
long stream. Matching the first two moments per Lab channel to the one picture that never changes
(the reference) pins global brightness and white balance every chunk; FlashHead's official loop does
it to every frame of every chunk at strength 1, before the frames are published and before the last
ones are re-encoded for the hand-off (docs/real-models.md, "The official FlashHead loop", step 4).

The colour space is sRGB (D65) -> linear RGB -> XYZ -> Lab and back, with the CIE constants
(ε = 0.008856, κ = 903.3); XYZ is clamped to [1e-8, 1] before the cube root and the output RGB to
[0, 1]. Statistics are population moments over each frame's pixels; a flat channel (σ < 1e-8) keeps
its spread (divides by 1).
"""

from __future__ import annotations

import torch

# sRGB primaries, D65 white (IEC 61966-2-1)
_XYZ_FROM_RGB = ((0.4124564, 0.3575761, 0.1804375),
                 (0.2126729, 0.7151522, 0.0721750),
                 (0.0193339, 0.1191920, 0.9503041))
_RGB_FROM_XYZ = ((3.2404542, -1.5371385, -0.4985314),
                 (-0.9692660, 1.8760108, 0.0415560),
                 (0.0556434, -0.2040259, 1.0572252))
_WHITE = (0.95047, 1.0, 1.08883)
_EPS, _KAPPA = 0.008856, 903.3


def _matrix(rows: tuple[tuple[float, ...], ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=like.dtype, device=like.device)


def rgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """`[..., 3]` sRGB in [0, 1] -> `[..., 3]` (L, a, b)."""
    lin = torch.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    xyz = lin @ _matrix(_XYZ_FROM_RGB, rgb).T / _matrix((_WHITE,), rgb)[0]
    xyz = xyz.clamp(1e-8, 1.0)
    f = torch.where(xyz > _EPS, xyz ** (1 / 3), (_KAPPA * xyz + 16) / 116)
    fx, fy, fz = f.unbind(-1)
    return torch.stack([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)], dim=-1)


def lab_to_rgb(lab: torch.Tensor) -> torch.Tensor:
    """`[..., 3]` (L, a, b) -> `[..., 3]` sRGB clamped to [0, 1]."""
    big_l, a, b = lab.unbind(-1)
    fy = (big_l + 16) / 116
    fx, fz = fy + a / 500, fy - b / 200
    x = torch.where(fx ** 3 > _EPS, fx ** 3, (116 * fx - 16) / _KAPPA)
    y = torch.where(big_l > _KAPPA * _EPS, fy ** 3, big_l / _KAPPA)
    z = torch.where(fz ** 3 > _EPS, fz ** 3, (116 * fz - 16) / _KAPPA)
    lin = (torch.stack([x, y, z], dim=-1) * _matrix((_WHITE,), lab)[0]) @ _matrix(_RGB_FROM_XYZ, lab).T
    rgb = torch.where(lin > 0.0031308, 1.055 * lin.clamp_min(0) ** (1 / 2.4) - 0.055, 12.92 * lin)
    return rgb.clamp(0.0, 1.0)


def match_colors(video: torch.Tensor, reference: torch.Tensor, strength: float) -> torch.Tensor:
    """video `[B, 3, T, H, W]` in [-1, 1], reference `[B | 1, 3, 1, H', W']` in [-1, 1] ->
    `[B, 3, T, H, W]`: each frame's Lab moments set to the reference's, blended at `strength`
    (0: unchanged, 1: fully corrected). The reference may have another size (only its moments
    are read)."""
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"colour correction strength must be in [0, 1], got {strength}")
    if strength == 0.0:
        return video
    src = ((video + 1) / 2).permute(0, 2, 3, 4, 1)  # [B, T, H, W, 3]
    ref = ((reference.to(video) + 1) / 2).permute(0, 2, 3, 4, 1)  # [B, 1, H', W', 3]
    lab, ref_lab = rgb_to_lab(src), rgb_to_lab(ref)
    mean, std = lab.mean(dim=(2, 3), keepdim=True), lab.std(dim=(2, 3), keepdim=True, unbiased=False)
    r_mean = ref_lab.mean(dim=(2, 3), keepdim=True)
    r_std = ref_lab.std(dim=(2, 3), keepdim=True, unbiased=False)
    std = torch.where(std < 1e-8, torch.ones_like(std), std)
    fixed = lab_to_rgb((lab - mean) * (r_std / std) + r_mean)  # [B, T, H, W, 3]
    out = (1 - strength) * src + strength * fixed
    return (out * 2 - 1).permute(0, 4, 1, 2, 3).contiguous()  # [B, 3, T, H, W]
