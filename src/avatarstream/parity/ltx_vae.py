"""Parity of the LTX-Video 0.9 VAE (`ltx-vae` fixtures): whole-chunk decode and the encoder's mode,
loaded through `weights/ltx.py` as a downloaded `VAE_LTX/` folder is."""

from __future__ import annotations

import torch

from avatarstream.parity.fixture import Fixture
from avatarstream.weights.ltx import load_ltx_vae


def run(fx: Fixture) -> dict[str, torch.Tensor]:
    """The fixture's weights through `load_ltx_vae`; `decoded` = whole-chunk decode of the
    normalised `inputs.latents`, `encoded_mode` = normalised mode of `inputs.video`."""
    vae = load_ltx_vae(fx.weights, fx.config, what=f"{fx.path.name} weights")
    latents, video = fx.inputs["latents"], fx.inputs["video"]  # [C, T, h, w], [3, F, H, W]
    return {"decoded": vae.decode(latents[None])[0],  # [3, 1+8(T-1), 32h, 32w]
            "encoded_mode": vae.encode(video[None])[0]}  # [C, 1+k, h, w]
