"""The networks of a run (train/nets.py): a checkpoint's VAE is built in the variant it was
trained as."""

from __future__ import annotations

import dataclasses

import pytest

from avatarstream.models.vae import CausalVAE, VAEConfig
from avatarstream.train.nets import vae_for


def test_vae_for_keeps_the_variant_the_weights_were_trained_as():
    """Weights trained before the parameter-free shortcuts (no decoder.head.skip) load into a
    shortcut-free VAE; today's weights into the preset; a misfit is an error, not a silent load."""
    preset = VAEConfig.small()
    assert preset.shortcuts
    old = CausalVAE(dataclasses.replace(preset, shortcuts=False))
    assert not vae_for("small", old.state_dict()).cfg.shortcuts
    assert vae_for("small", CausalVAE(preset).state_dict()).cfg.shortcuts
    sd = old.state_dict()
    sd.pop(next(iter(sd)))
    with pytest.raises(RuntimeError):
        vae_for("small", sd)
