"""Recipes: every file under recipes/ resolves and names only runs other recipes make, keys that
were retired keep old runs' fingerprints, and recipes/train.sh runs the whole chain at the tiny
size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from avatarstream.errors import ConfigError
from avatarstream.train.recipe import fingerprint, load_recipe

from .helpers import RECIPES


def test_every_recipe_file_loads_and_its_init_runs_come_from_recipes():
    """Each recipes/*.toml resolves (unknown keys are errors), and every `[init]` path (and a DMD
    teacher or fake score) under runs/ names a run another recipe makes, so a chain can be
    replayed from the recipes alone."""
    names = {p.stem for p in RECIPES.glob("*.toml")}
    assert len(names) >= 10
    for p in RECIPES.glob("*.toml"):
        r = load_recipe(p)
        assert r["name"] == p.stem
        sources = list(r["init"].values()) + [r.get("dmd", {}).get(k, "") for k in ("teacher", "fake_init")]
        for src in sources:
            if src.startswith("runs/"):
                assert src.split("/")[1] in names, (p.name, src)


# fingerprints of the recipes as resolved before issue 27 retired `train.muon_bf16`,
# `vae.predicted`, `vae.p_predicted`, `dmd.strategy`, `dmd.prefix_chunk` and `dmd.overlap`
BEFORE_ISSUE_27 = {"vae-tiny": "829c28811f1f6d79", "a2v-tiny": "abdf0a96e2074302", "dmd-tiny": "49087237816833c9",
                   "dmd-next-small": "e5b69484264ec61f", "vae-motion-small": "0765bffe8d26cbc5"}


@pytest.mark.parametrize("name", sorted(BEFORE_ISSUE_27))
def test_retired_keys_keep_the_fingerprint_of_runs_made_with_them(name):
    """A run started before the keys went still resumes (`--resume` compares fingerprints), and
    the keys themselves are now unknown (a typo-proof recipe has no dead settings)."""
    assert fingerprint(load_recipe(RECIPES / f"{name}.toml")) == BEFORE_ISSUE_27[name]
    section = name.split("-")[0]
    if section in ("vae", "dmd"):
        key = {"vae": "vae.predicted=\"x\"", "dmd": "dmd.strategy=\"prefix\""}[section]
        with pytest.raises(ConfigError, match="unknown key"):
            load_recipe(RECIPES / f"{name}.toml", [key])


@pytest.mark.slow
def test_train_script_runs_the_whole_chain(tmp_path):
    """recipes/train.sh at the tiny size: synth -> VAE -> prepare -> A2V -> SFT -> CFG distill ->
    SR -> export, from a copy of the recipes (its data and runs stay in tmp_path)."""
    import os
    import shutil
    import subprocess
    import sys

    from avatarstream.weights import load_exported

    shutil.copytree(RECIPES, tmp_path / "recipes")
    av = Path(sys.executable).with_name("avatarstream")
    env = dict(os.environ, AV=str(av), SIZE="tiny", OUT=str(tmp_path / "w"), OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", str(tmp_path / "recipes" / "train.sh")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "w" / "config.json").read_text())
    assert set(cfg["trained"]) == {"dit", "refiner", "vae", "audio", "text"} and not cfg["untrained"]
    assert cfg["trained"]["dit"] == "runs/cfg-distill-tiny"
    assert (cfg["pipeline"]["audio_scale"], cfg["pipeline"]["ref_scale"]) == (3.0, 1.5)
    assert cfg["pipeline"]["adaptive_sink"] is False  # bidirectional: causal keeps the reference as sink
    load_exported(tmp_path / "w")
