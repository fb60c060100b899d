"""Our own parity fixtures (`*-b.safetensors`, tests/fixtures/golden/README.md): the official code
run at other sizes than the shipped `-a` files (non-square latents, other widths, head and layer
counts, chunk / bucket / step counts). A port that took any size from a constant instead of the
fixture's config and settings passes the `-a` files and fails these.

The `liveavatar-dit` ones are left to tests/parity/test_liveavatar_dit.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from avatarstream.parity.fixture import FAMILY_TOLERANCE, FORMAT, load_fixture, run_parity

from .helpers import GOLDEN, cli_parity

pytestmark = pytest.mark.usefixtures("one_thread")

OURS = sorted(p for p in GOLDEN.glob("*.safetensors")
              if re.search(r"-[b-z]\.safetensors$", p.name) and not p.name.startswith("liveavatar-dit"))
SOURCES = {"Alibaba-Quark/LiveAvatar@9c2c38de1715e553127b42c82cb959f756b02595",
           "Soul-AILab/SoulX-FlashHead@12467cef31a9554cd9682a0521e6e87deaef9810"}


def ids(p: Path) -> str:
    return p.stem


def test_the_fixture_set_is_there() -> None:
    names = {p.name for p in OURS}
    assert {"wan-vae-b.safetensors", "ltx-vae-b.safetensors", "wav2vec2-b.safetensors",
            "wav2vec2-flashhead-b.safetensors", "flashhead-dit-b.safetensors",
            "flashhead-dit-lite-b.safetensors"} <= names


@pytest.mark.parametrize("path", OURS, ids=ids)
def test_every_expected_tensor_within_the_readme_bound(path: Path) -> None:
    """docs/parity-fixtures.md: max|port − expected| ≤ 1e-5 · max(1, max|expected|) per tensor
    (measured: 0 to 4.1e-6, the largest on the wav2vec2 hidden states), and the port reproduces
    every stored tensor, the debugging velocities included."""
    fx = load_fixture(path)
    res = run_parity(path)
    assert res["pass"] and set(res["outputs"]) == set(fx.expected)
    for name, diff in res["outputs"].items():
        bound = 1e-5 * max(1.0, float(fx.expected[name].abs().max()))
        assert diff <= bound, (path.name, name, diff, bound)


@pytest.mark.parametrize("path", OURS, ids=ids)
def test_cli_passes(path: Path) -> None:
    """Measured (AMD EPYC, 1 / 2 threads): flashhead-dit 1.19e-6, lite 1.19e-6, wan-vae 3.13e-6 /
    3.73e-6, ltx-vae 0, wav2vec2 4.05e-6 / 4.17e-6, flashhead's 1.51e-6 / 1.55e-6: each at least
    4x under its family's bound (parity/fixture.py)."""
    out = cli_parity(path)
    family = load_fixture(path).family
    assert out["family"] == family and out["tolerance"] == FAMILY_TOLERANCE[family]
    assert out["pass"] and out["max_abs_diff"] <= out["tolerance"]


@pytest.mark.parametrize("path", OURS, ids=ids)
def test_other_sizes_than_the_shipped_fixture(path: Path) -> None:
    """Each file is official output at sizes of its own: its config or latent geometry differs from
    the `-a` file of the same family and variant, and its latents are not square."""
    fx = load_fixture(path)
    assert fx.source.split(" ")[0] in SOURCES and path.stat().st_size < 2_000_000
    shipped = load_fixture(path.with_name(re.sub(r"-[b-z]\.safetensors$", "-a.safetensors", path.name)))
    assert (fx.family, fx.variant) == (shipped.family, shipped.variant)
    shape = {k: tuple(v.shape) for k, v in fx.inputs.items()}
    assert fx.config != shipped.config or shape != {k: tuple(v.shape) for k, v in shipped.inputs.items()}
    if "latent_height" in fx.settings:
        assert fx.settings["latent_height"] != fx.settings["latent_width"]


def test_format_is_the_documented_one() -> None:
    from safetensors import safe_open

    for path in OURS:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        assert meta["format"] == FORMAT and {"family", "config", "settings", "source", "note"} <= set(meta)
