"""Session fixtures of the training tests: a tiny synthetic dataset with its prepared file, and
each tiny recipe trained once (shared by the objective, trainer and export tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from avatarstream.train.data import prepare
from avatarstream.train.nets import build_nets

from .helpers import ALL, FAST, STEPS, needs, run


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> dict[str, Path]:
    """2 identities x 2 scenes x 1 s at 64 px, and its prepared file (random tiny VAE)."""
    from avatarstream.data.generate import DatasetConfig, generate

    d = tmp_path_factory.mktemp("train-data")
    generate(DatasetConfig(identities=2, clips_per_identity=2, seconds=1.0, size=64), d / "synth")
    vae = build_nets("tiny")["vae"].init_random_(0)  # random features, not the pooling init
    summary = prepare(d / "synth", vae, d / "prep.safetensors", lr_size=32, hr_size=64)
    return {"shards": d / "synth", "prepared": d / "prep.safetensors", "summary": summary, "dir": d}


@pytest.fixture(scope="session")
def trained(dataset, tmp_path_factory) -> dict[str, Path]:
    """Each tiny recipe trained for STEPS steps (shared by the loss and export tests)."""
    out = {}
    root = tmp_path_factory.mktemp("runs")
    for name in ALL:
        extra = needs(name, out)
        run(name, dataset, root / name, train__steps=STEPS[name], train__checkpoint_every=10, **FAST[name],
            **extra)
        out[name] = root / name
    return out
