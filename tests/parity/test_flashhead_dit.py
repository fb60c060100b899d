"""FlashHead DiT parity with the official code (`flashhead-dit` fixtures, Pro and Lite): the CLI
on both fixtures, a deliberate bug the fixtures catch, and bad fixtures as one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli

from avatarstream.errors import InputError
from avatarstream.parity import flashhead_dit
from avatarstream.parity.fixture import FAMILY_TOLERANCE, load_fixture, run_parity

from .helpers import GOLDEN, cli_parity, rewrite_fixture

PRO, LITE = GOLDEN / "flashhead-dit-a.safetensors", GOLDEN / "flashhead-dit-lite-a.safetensors"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("path", [PRO, LITE], ids=["pro", "lite"])
def test_cli_parity_passes(path: Path) -> None:
    """Measured (torch 2.13, AMD EPYC, 1 and 2 threads): Pro 1.19e-6, Lite 1.67e-6; the family's
    bound, 1e-5, is 6x the larger."""
    out = cli_parity(path)
    print(path.name, out["max_abs_diff"])
    assert out["family"] == "flashhead-dit" and out["tolerance"] == FAMILY_TOLERANCE["flashhead-dit"] == 1e-5
    assert out["pass"] and out["max_abs_diff"] <= out["tolerance"]


def test_a_wrong_motion_hand_off_is_caught() -> None:
    """Handing one motion latent on instead of two leaves chunk 0 and the first velocity as they
    were and moves chunk 1 far past the tolerance: the fixture checks the hand-off."""
    fx = load_fixture(PRO)
    good = flashhead_dit.run(fx)
    fx.settings["motion_latents"] = 1
    bad = flashhead_dit.run(fx)
    assert torch.equal(good["latents"][0], bad["latents"][0])
    assert (good["latents"][1] - fx.expected["latents"][1]).abs().max() < 1e-5
    assert (bad["latents"][1] - fx.expected["latents"][1]).abs().max() > 1e-2


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_bf16_weights_under_autocast_stay_within_two_percent() -> None:
    """What a bf16 deployment runs (the loader's dtype, the engine's autocast), on the CPU: the
    issue's bf16 bound of 2e-2 relative to the largest expected value (observed ~0.6%)."""
    fx = load_fixture(PRO)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = flashhead_dit.chunk_loop(flashhead_dit.load(fx, dtype=torch.bfloat16), fx)
    for name, want in fx.expected.items():
        assert (out[name].float() - want).abs().max() < 2e-2 * want.abs().max(), name


def test_bad_fixtures_are_one_clear_error(tmp_path: Path) -> None:
    shapes = rewrite_fixture(PRO, tmp_path / "shapes.safetensors",
                      weights={"patch_embedding.weight": torch.zeros(64, 256, 1, 1, 1)})
    with pytest.raises(InputError, match=r"'patch_embedding.weight' has shape \(64, 256, 1, 1, 1\)"):
        run_parity(shapes)
    other = rewrite_fixture(GOLDEN / "wan-vae-a.safetensors", tmp_path / "other.safetensors", family="flashhead-dit")
    with pytest.raises(InputError, match="not a FlashHead DiT config"):
        run_parity(other)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(PRO.read_bytes()[:5000])
    with pytest.raises(InputError, match="cut.safetensors: not a readable safetensors file"):
        run_parity(cut)
    r = run_cli("models", "parity", str(shapes), "--json")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "patch_embedding.weight" in r.stderr
