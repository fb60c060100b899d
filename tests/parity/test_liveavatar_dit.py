"""LiveAvatar DiT parity with the official code (`liveavatar-dit` fixture): the CLI passes, the
fp16 RoPE emulation is what brings it to ~1e-6, deliberate bugs the fixture catches, and bad
fixtures as one clear error."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from avatarstream.errors import InputError
from avatarstream.parity import liveavatar_dit
from avatarstream.parity.fixture import FAMILY_TOLERANCE, Fixture, load_fixture, run_parity

from .helpers import GOLDEN, cli_parity, rewrite_fixture

FIXTURE = GOLDEN / "liveavatar-dit-a.safetensors"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fx() -> Fixture:
    return load_fixture(FIXTURE)


def _worst(out: dict[str, torch.Tensor], fx: Fixture) -> float:
    return max(float((out[k] - fx.expected[k]).abs().max()) for k in fx.expected)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("liveavatar-dit-*.safetensors")), ids=lambda p: p.name)
def test_cli_parity_passes(path: Path) -> None:
    """-a: the shipped fixture (1.43e-6); -b: ours, made with the official code at another size,
    non-square latents, sink distance 10, a ring that wraps twice (1.46e-6 at 1 thread, 1.67e-6
    at 2; AMD EPYC). The family's bound, 1e-5, is 6x the largest."""
    out = cli_parity(path)
    assert out["family"] == "liveavatar-dit" and out["tolerance"] == FAMILY_TOLERANCE["liveavatar-dit"] == 1e-5
    assert out["pass"] and out["max_abs_diff"] <= out["tolerance"]


def test_fp16_rope_tables_are_the_official_ones(fx: Fixture) -> None:
    """Without the fp16 rounding of cos/sin a correct port lands ~4.5e-5 off: 30x worse than with
    it, and over the family's bound (1e-5)."""
    with torch.inference_mode():
        exact = _worst(liveavatar_dit.stream(liveavatar_dit.load(fx, rope_fp16=False), fx), fx)
    assert FAMILY_TOLERANCE["liveavatar-dit"] < exact < 1e-4


@pytest.mark.parametrize("bug", ["sink distance + 1", "one ring block too many"])
def test_deliberate_bugs_are_caught(fx: Fixture, bug: str) -> None:
    """The fixture's README lists these (1.9e-2, 5.2e-2): each must fail the bound clearly."""
    net = liveavatar_dit.load(fx)
    fx = dataclasses.replace(fx, settings=dict(fx.settings))
    kw = {}
    if bug == "sink distance + 1":
        kw["sink_distance"] = int(fx.settings["sink_distance"]) + 1
    else:
        fx.settings["kv_ring_frames"] += fx.settings["frames_per_block"]
    with torch.inference_mode():
        assert _worst(liveavatar_dit.stream(net, fx, **kw), fx) > 1e-3


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_bf16_weights_under_autocast_stay_within_two_percent(fx: Fixture) -> None:
    """What a bf16 deployment runs (the loader's dtype, the engine's autocast), on the CPU: the
    issue's bf16 bound of 2e-2 relative to the largest expected value (observed 0.5% on the
    latents, 1.1% on the first velocity)."""
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = liveavatar_dit.stream(liveavatar_dit.load(fx, dtype=torch.bfloat16), fx)
    for name, want in fx.expected.items():
        assert (out[name].float() - want).abs().max() < 2e-2 * want.abs().max(), name


def test_bad_fixtures_are_one_clear_error(tmp_path: Path) -> None:
    shapes = rewrite_fixture(FIXTURE, tmp_path / "shapes.safetensors",
                             weights={"frame_packer.proj_2x.weight": torch.zeros(64, 16, 1, 2, 2)})
    with pytest.raises(InputError, match=r"'frame_packer.proj_2x.weight' has shape \(64, 16, 1, 2, 2\)"):
        run_parity(shapes)
    missing = rewrite_fixture(FIXTURE, tmp_path / "missing.safetensors",
                              weights={"trainable_cond_mask.weight": None})
    with pytest.raises(InputError, match="1 missing .*trainable_cond_mask.weight"):
        run_parity(missing)
    other = rewrite_fixture(GOLDEN / "flashhead-dit-a.safetensors", tmp_path / "other.safetensors",
                            family="liveavatar-dit")
    with pytest.raises(InputError, match="not a LiveAvatar DiT config"):
        run_parity(other)
