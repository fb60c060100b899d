"""Lab colour correction to the reference (engine/stages/color.py) against a numpy reference
written from the CIE formulas, and what the correction is for: frame moments equal the
reference's at strength 1, a linear blend below, nothing at 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from avatarstream.engine.stages.color import lab_to_rgb, match_colors, rgb_to_lab

M = np.array([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
              [0.0193339, 0.1191920, 0.9503041]])
WHITE = np.array([0.95047, 1.0, 1.08883])
EPS, KAPPA = 0.008856, 903.3


def np_lab(rgb: np.ndarray) -> np.ndarray:
    """[..., 3] sRGB in [0, 1] -> Lab (float64)."""
    lin = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    t = np.clip(lin @ M.T / WHITE, 1e-8, 1.0)
    f = np.where(t > EPS, np.cbrt(t), (KAPPA * t + 16) / 116)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], -1)


def np_rgb(lab: np.ndarray) -> np.ndarray:
    fy = (lab[..., 0] + 16) / 116
    fx, fz = fy + lab[..., 1] / 500, fy - lab[..., 2] / 200
    xyz = np.stack([np.where(fx ** 3 > EPS, fx ** 3, (116 * fx - 16) / KAPPA),
                    np.where(lab[..., 0] > KAPPA * EPS, fy ** 3, lab[..., 0] / KAPPA),
                    np.where(fz ** 3 > EPS, fz ** 3, (116 * fz - 16) / KAPPA)], -1) * WHITE
    lin = xyz @ np.linalg.inv(M).T
    rgb = np.where(lin > 0.0031308, 1.055 * np.maximum(lin, 0) ** (1 / 2.4) - 0.055, 12.92 * lin)
    return np.clip(rgb, 0, 1)


def np_match(video: np.ndarray, ref: np.ndarray, strength: float) -> np.ndarray:
    """video [3, T, H, W], ref [3, H, W], both in [-1, 1]."""
    src = (video.transpose(1, 2, 3, 0) + 1) / 2  # [T, H, W, 3]
    lab, r = np_lab(src), np_lab((ref.transpose(1, 2, 0) + 1) / 2)
    mean, std = lab.mean((1, 2), keepdims=True), lab.std((1, 2), keepdims=True)
    fixed = np_rgb((lab - mean) * (r.std((0, 1)) / np.where(std < 1e-8, 1, std)) + r.mean((0, 1)))
    return (((1 - strength) * src + strength * fixed) * 2 - 1).transpose(3, 0, 1, 2)


@pytest.fixture
def frames() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    video = (torch.rand(1, 3, 5, 16, 12, generator=g) * 1.2 - 0.9).clamp(-1, 1)  # [1, 3, T, H, W]
    ref = torch.rand(1, 3, 1, 16, 12, generator=g) * 1.4 - 0.8
    video[:, :, 2] = 0.3  # a flat frame: its spread stays (σ = 0 divides by 1)
    return video, ref


@pytest.mark.parametrize("strength", [1.0, 0.4])
def test_matches_the_numpy_reference(frames, strength: float) -> None:
    video, ref = frames
    got = match_colors(video, ref, strength)
    want = np_match(video[0].double().numpy(), ref[0, :, 0].double().numpy(), strength)
    assert got.shape == video.shape and got.dtype == video.dtype
    assert np.abs(got[0].numpy() - want).max() < 1e-4


def test_lab_round_trip_and_known_values() -> None:
    rgb = torch.rand(200, 3, generator=torch.Generator().manual_seed(1))
    assert (lab_to_rgb(rgb_to_lab(rgb)) - rgb).abs().max() < 1e-4
    white, black = rgb_to_lab(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert abs(white[0] - 100) < 1e-3 and white[1:].abs().max() < 1e-2 and black.abs().max() < 1e-3


def test_strength_one_gives_the_reference_moments_and_zero_changes_nothing(frames) -> None:
    video, ref = frames
    video = 0.5 * video  # in gamut after the shift: the moments survive the RGB clamp
    out = match_colors(video, ref, 1.0)
    lab = rgb_to_lab(((out + 1) / 2)[0].permute(1, 2, 3, 0)).double()  # [T, H, W, 3]
    r = rgb_to_lab(((ref + 1) / 2)[0, :, 0].permute(1, 2, 0)).double()
    for t in (0, 1, 3, 4):  # the flat frame 2 keeps σ = 0
        assert (lab[t].mean((0, 1)) - r.mean((0, 1))).abs().max() < 0.5
        assert (lab[t].std((0, 1), unbiased=False) - r.std((0, 1), unbiased=False)).abs().max() < 0.5
    assert match_colors(video, ref, 0.0) is video
    half = match_colors(video, ref, 0.5)
    assert (half - (video + out) / 2).abs().max() < 1e-5
    with pytest.raises(ValueError, match="strength"):
        match_colors(video, ref, 1.5)
