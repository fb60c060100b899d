"""Parity of the Wan2.1 VAE (`wan-vae` fixtures, docs/parity-fixtures.md).

`weights/wan.py load_wan_vae(state, config)` is the one way weights under the official keys become a `WanVAE`:
the real `VAE_Wan/Wan2.1_VAE.pth` (a plain state dict, read by `weights/official.read_state`)
and a fixture's `weights.*` alike. The adapter is the identity: our module names are the official
ones, shapes included (RMS norm `gamma` [C, 1, 1, 1]), so there is nothing to rename; it exists so
the file goes through the same `StateDictAdapter` step as every other format and a future rename
has one place to live.

`run(fx)` decodes `inputs.latents` whole and latent by latent through one cache (the official
`stream_decode` loop) and encodes `inputs.video`, returning `decoded_whole`, `decoded_stream` and
`encoded` (the normalised mean). Decodes are unclamped: the fixture stores model-level outputs.
"""

from __future__ import annotations

import torch

from avatarstream.errors import InputError
from avatarstream.parity.fixture import Fixture
from avatarstream.weights.wan import load_wan_vae, wan_vae_config


def run(fx: Fixture) -> dict[str, torch.Tensor]:
    """The fixture's computation on its inputs -> {"decoded_whole", "decoded_stream", "encoded"}."""
    missing = sorted({"latents", "video"} - set(fx.inputs))
    if missing:
        raise InputError(f"{fx.path}: a wan-vae fixture needs inputs {missing}")
    vae = load_wan_vae(fx.weights, wan_vae_config(fx.config, fx.settings), what=f"{fx.path.name} weights")
    z = fx.inputs["latents"][None]  # [1, z, T, h, w], normalised
    video = fx.inputs["video"][None]  # [1, 3, 1+4(T-1), 8h, 8w]
    try:
        whole = vae.decode(z, clamp=False)
        cache = vae.new_cache("decode")
        stream = torch.cat([vae.decode_step(z[:, :, i : i + 1], cache, clamp=False)
                            for i in range(z.shape[2])], dim=2)
        mean, _ = vae.encode(video)
    except ValueError as e:  # inputs of the wrong shape for this config
        raise InputError(f"{fx.path}: {e}") from None
    return {"decoded_whole": whole[0], "decoded_stream": stream[0], "encoded": mean[0]}
