"""Checkpoints and starting weights (train/checkpoints.py): where `[init]` weights come from, and
how weights older than the network load."""

from __future__ import annotations

import pytest
import torch

from avatarstream.train.checkpoints import net_weights
from avatarstream.train.nets import build_nets

pytestmark = pytest.mark.usefixtures("one_thread")


def test_init_from_a_prepared_file_takes_its_vae(dataset):
    """`init.vae = <prepared file>`: the VAE inside it (statistics folded in), so a decoder
    fine-tune starts from exactly the encoder its DiT's latents came from."""
    from safetensors.torch import load_file

    prep = load_file(str(dataset["prepared"]))
    sd = net_weights(str(dataset["prepared"]), "vae")
    assert set(sd) == {k[4:] for k in prep if k.startswith("vae.")} and sd
    assert all(torch.equal(sd[k], prep["vae." + k]) for k in sd)
    build_nets("tiny")["vae"].load_state_dict(sd)  # strict
