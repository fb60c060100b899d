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


# one fixture per family (the quickest to run)
FAMILY_FIXTURES = {"flashhead-dit": "flashhead-dit-lite-a", "liveavatar-dit": "liveavatar-dit-a", "umt5": "umt5-a",
                   "ltx-vae": "ltx-vae-a", "wan-vae": "wan-vae-a", "wav2vec2": "wav2vec2-flashhead-a"}


def test_every_family_has_a_measured_bound():
    """Each family's default bound (fixture.py: at least 4x the worst figure measured on its
    fixtures, 1e-5 at the least) is tight enough that an error of 5e-5 fails."""
    from avatarstream.parity import FAMILIES
    from avatarstream.parity.fixture import FAMILY_TOLERANCE

    assert set(FAMILY_TOLERANCE) == set(FAMILIES) == set(FAMILY_FIXTURES)
    assert all(1e-5 <= t < 5e-5 for t in FAMILY_TOLERANCE.values())


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_an_error_of_5e_5_fails_by_default(family, tmp_path):
    """One expected value moved by 5e-5 (a regression the old bound of 1e-4 let pass) fails at
    the family's default bound; `tolerance` still overrides it."""
    from avatarstream.parity.fixture import FAMILY_TOLERANCE, run_parity

    from .helpers import rewrite_fixture

    src = GOLDEN / f"{FAMILY_FIXTURES[family]}.safetensors"
    fx = load_fixture(src)
    name = sorted(fx.expected)[0]
    moved = fx.expected[name].clone()
    moved.view(-1)[0] += 5e-5
    res = run_parity(rewrite_fixture(src, tmp_path / "moved.safetensors", expected={name: moved}))
    assert res["family"] == family and res["tolerance"] == FAMILY_TOLERANCE[family]
    assert not res["pass"] and 4e-5 < res["outputs"][name] <= 1e-4, res["outputs"]
    assert run_parity(tmp_path / "moved.safetensors", tolerance=1e-4)["pass"]


def test_cli_default_bound_and_override(tmp_path):
    """`models parity` passes at the family's bound, reports it, and `--tolerance` replaces it
    (wan-vae-a measures 4.3e-6: over a bound of 1e-6)."""
    path = GOLDEN / "wan-vae-a.safetensors"
    r = run_cli("models", "parity", str(path), "--json")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and out["pass"] and out["tolerance"] == 2e-5
    r = run_cli("models", "parity", str(path), "--json", "--tolerance", "1e-6")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 1 and not out["pass"] and out["tolerance"] == 1e-6
