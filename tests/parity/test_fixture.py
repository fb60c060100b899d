"""The parity tool itself: reading fixtures, refusing what is not one, the CLI's exit codes."""

from __future__ import annotations

import pytest

import json

import torch
from safetensors.torch import save_file

from avatarstream.parity.fixture import load_fixture

from conftest import run_cli

from .helpers import GOLDEN



def test_fixture_metadata_and_groups(tmp_path):
    path = tmp_path / "fx.safetensors"
    save_file({"weights.a.weight": torch.ones(2, 2), "inputs.x": torch.zeros(3), "expected.y": torch.ones(1)},
              str(path), metadata={"format": "avatarstream-parity/1", "family": "wan-vae",
                                   "config": json.dumps({"dim": 4}), "settings": json.dumps({"variant": "v"})})
    fx = load_fixture(path)
    assert fx.family == "wan-vae" and fx.config == {"dim": 4} and fx.variant == "v"
    assert set(fx.weights) == {"a.weight"} and set(fx.inputs) == {"x"} and set(fx.expected) == {"y"}


def test_not_a_fixture_is_one_clear_error(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors at all")
    r = run_cli("models", "parity", str(junk), "--json")
    assert r.returncode != 0 and "not a readable safetensors file" in r.stderr and "Traceback" not in r.stderr
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(1)}, str(plain))
    r = run_cli("models", "parity", str(plain), "--json")
    assert r.returncode != 0 and "not a parity fixture" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("models", "parity", str(tmp_path / "missing.safetensors"))
    assert r.returncode != 0 and "no such fixture" in r.stderr


def test_family_not_yet_supported_says_so(monkeypatch):
    from avatarstream.errors import ConfigError
    from avatarstream.parity import FAMILIES
    from avatarstream.parity.fixture import run_parity

    monkeypatch.setitem(FAMILIES, "liveavatar-dit", None)
    with pytest.raises(ConfigError, match="not yet supported"):
        run_parity(GOLDEN / "liveavatar-dit-a.safetensors")
