"""The networks a training run builds: the presets' sizes (`model = "tiny" | "small"`), the
variant a checkpoint was trained as, and the starting weights of a network trained from scratch.
Used by the objectives, `train prepare` and `train export`."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from avatarstream.models.audio import AudioConfig, AudioEncoder
from avatarstream.models.dit import DiTConfig, VideoRefDiT
from avatarstream.models.refiner import RefinerConfig, SRRefiner
from avatarstream.models.text import TextConfig, TextEncoder
from avatarstream.models.vae import CausalVAE, VAEConfig
from avatarstream.train.vae_init import init_pooling_

NETS = ("dit", "refiner", "vae", "audio", "text")
GEOMETRY = {"tiny": {"lr_size": 32, "hr_size": 64}, "small": {"lr_size": 128, "hr_size": 256}}


def dit_config(model: str, direct: bool = False) -> DiTConfig:
    """The preset's DiT config; `direct`: it generates at the output (HR) resolution with 2× the
    spatial patch, so a frame has as many tokens as at LR (no SR refiner in the chain)."""
    cfg = getattr(DiTConfig, model)()
    if direct:
        cfg = dataclasses.replace(cfg, patch=(1, 2 * cfg.patch[1], 2 * cfg.patch[2]), x0_skip=True)
    return cfg


def build_nets(model: str, direct: bool = False) -> dict[str, nn.Module]:
    """All five networks at the preset's sizes (fresh, default PyTorch init); `direct`: see
    `dit_config`."""
    pick = lambda cls: getattr(cls, model)()  # noqa: E731
    return {"dit": VideoRefDiT(dit_config(model, direct)), "refiner": SRRefiner(pick(RefinerConfig)),
            "vae": CausalVAE(pick(VAEConfig)), "audio": AudioEncoder(pick(AudioConfig)),
            "text": TextEncoder(pick(TextConfig))}


def vae_for(model: str, state: dict[str, torch.Tensor]) -> CausalVAE:
    """The preset's VAE in the variant `state` was trained as: weights from before the
    parameter-free shortcuts (no `decoder.head.skip`) get `shortcuts = False`, so a trained
    latent space stays usable when the preset moves on. Loads `state` strictly."""
    cfg = getattr(VAEConfig, model)()
    if cfg.shortcuts and not any(k.startswith("decoder.head.skip.") for k in state):
        cfg = dataclasses.replace(cfg, shortcuts=False)
    vae = CausalVAE(cfg)
    vae.load_state_dict(state)
    return vae


def init_net(name: str, net: nn.Module, seed: int) -> None:
    """Starting weights of a trained-from-scratch network.

    Transformers: the registry's `init_random_` (fan-in scaled, no zero heads) with the output
    heads, AdaLN gates and the motion head scaled down ×0.1 (small initial updates keep the
    residual stream stable). VAE with shortcuts: `init_pooling_` (the average-pooling
    autoencoder, train/vae_init.py). Other VAEs / encoders: their `init_random_`.
    """
    if name == "vae" and net.cfg.shortcuts:
        init_pooling_(net, seed)  # starts as the average-pooling autoencoder
    else:
        net.init_random_(seed)
    if name in ("dit", "refiner"):
        with torch.no_grad():
            for n, p in net.named_parameters():
                if n.startswith("head.") or n.startswith("motion_head.") or n.endswith("o.weight"):
                    p.mul_(0.1)
                if n.startswith("guidance_embedding.2."):  # neutral until CFG distillation trains it
                    p.zero_()
