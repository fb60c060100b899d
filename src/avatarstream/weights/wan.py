"""Loading the official Wan2.1 VAE checkpoint: its config, its state-dict adapter, `build_loaded`.

The parity tool (parity/wan_vae.py) and the official-folder loader both come through here, so a
fixture checks exactly the path a downloaded file takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from avatarstream.errors import InputError
from avatarstream.models.wan.vae import WanVAE, WanVAEConfig
from avatarstream.weights.adapters import StateDictAdapter
from avatarstream.weights.official import build_loaded

WAN_VAE = StateDictAdapter("wan2.1-vae")  # identity: the official keys are ours
NET = "vae"


def wan_vae_config(official: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> WanVAEConfig:
    """The official constructor kwargs (+ `latent_mean`/`latent_std` from a fixture's settings,
    else the real Wan2.1 statistics) -> our config; InputError when they do not describe one."""
    settings = settings or {}
    try:
        return WanVAEConfig.from_official(official, latent_mean=settings.get("latent_mean"),
                                          latent_std=settings.get("latent_std"))
    except (TypeError, ValueError) as e:
        raise InputError(f"not a Wan VAE config ({e})") from None


def load_wan_vae(state: Mapping[str, torch.Tensor], config: WanVAEConfig, *, what: str = "Wan2.1 VAE",
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> WanVAE:
    """A `WanVAE` built on the meta device and filled in place with `state` (official keys);
    InputError naming the key when the weights do not fit the config."""
    return build_loaded(lambda: WanVAE(config), WAN_VAE.state_dict(NET, state), what=what,
                        dtype=dtype, device=device).eval()
