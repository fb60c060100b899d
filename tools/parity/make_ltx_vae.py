"""Regenerate an `ltx-vae` parity fixture with FlashHead's vendored LTX-Video 0.9 VAE.

    python tools/parity/make_ltx_vae.py --official CHECKOUT/SoulX-FlashHead \
        --like tests/fixtures/golden/ltx-vae-b.safetensors --out /tmp/ltx-vae-b.safetensors

Builds `CausalVideoAutoencoder.from_config(config)` from
`flash_head/ltx_video/models/autoencoders/causal_video_autoencoder.py`, draws its weights by the
fixture rule, installs the per-channel statistics (mean 0.2·N, std exp(0.3·N), from the generator
seed `settings.weight_init.statistics` names) through the official `load_state_dict`, and wraps it
in `flash_head/ltx_video/ltx_vae.py:LtxVAE` (built without its checkpoint-loading constructor).
Expected: `LtxVAE.decode(latents)` (whole chunk) and the normalised encoder mode (the official
`encode` calls `.sample()`; the fixture takes `.mode()` so it is deterministic). Inputs: one
generator seeded with `inputs_seed` draws the normalised latents (N(0,1)), then the video
(uniform in [-1, 1]). Needs diffusers (0.35.2) and einops.
"""
from __future__ import annotations

import re

import torch

import _common as C

FAMILIES = ("ltx-vae",)  # the fixture families this script makes
SOURCES = ("Soul-AILab/SoulX-FlashHead@12467cef31a9554cd9682a0521e6e87deaef9810",)


def main():
    args = C.parser(__doc__).parse_args()
    root = C.check_checkout(args.official, "flash_head/ltx_video/ltx_vae.py")
    C.cpu_fp32()
    meta, config, settings, like = C.read_fixture(args.like)
    C.skip_package_inits(root, "flash_head")
    from flash_head.ltx_video.ltx_vae import LtxVAE
    from flash_head.ltx_video.models.autoencoders.causal_video_autoencoder import (
        CausalVideoAutoencoder)

    model = CausalVideoAutoencoder.from_config(config).eval()
    init = settings["weight_init"]
    C.draw_weights(model, init["weights_seed"])
    stats_seed = int(re.search(r"seed (\d+)", init["statistics"]).group(1))
    gen = torch.Generator().manual_seed(stats_seed)
    n = settings["latent_channels"]
    mean = 0.2 * torch.randn(n, generator=gen)
    std = torch.exp(0.3 * torch.randn(n, generator=gen))
    state = dict(model.state_dict())
    state["per_channel_statistics.mean-of-means"] = mean
    state["per_channel_statistics.std-of-means"] = std
    model.load_state_dict(state)  # the official override registers the two buffers

    vae = LtxVAE.__new__(LtxVAE)
    vae.model = model
    t, h, w = settings["latent_frames"], settings["latent_height"], settings["latent_width"]
    gen = torch.Generator().manual_seed(init["inputs_seed"])
    latents = torch.randn((n, t, h, w), generator=gen)
    video = torch.rand((3, 1 + 8 * (t - 1), 32 * h, 32 * w), generator=gen) * 2 - 1
    with torch.no_grad():
        decoded = vae.decode(latents)[0]
        mode = model.encode(video[None], return_dict=False)[0].mode()
        encoded = vae.normalize_latents(mode)[0]
    report = C.write_and_compare(args.out, meta, like, model.state_dict(),
                                 {"latents": latents, "video": video},
                                 {"decoded": decoded, "encoded_mode": encoded})
    C.finish(report)


if __name__ == "__main__":
    main()
