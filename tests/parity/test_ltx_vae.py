"""LTX-Video VAE parity with the official code (`ltx-vae` fixture): the CLI on the fixture, the
same numbers when the weights arrive in the on-disk (diffusers) form, both official config forms
at the real size, a deliberate bug the fixture catches, and bad inputs as one clear error."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file

from avatarstream.errors import InputError
from avatarstream.models.ltx import LTXVAEConfig, LTXVideoVAE
from avatarstream.parity.fixture import FAMILY_TOLERANCE, load_fixture, run_parity
from avatarstream.parity.ltx_vae import run
from avatarstream.weights.ltx import load_ltx_vae, ltx_vae_adapter, ltx_vae_config
from avatarstream.weights.official import read_state

from .helpers import GOLDEN, cli_parity, rewrite_fixture

LTX = GOLDEN / "ltx-vae-a.safetensors"
KEYS = Path(__file__).resolve().parents[1] / "fixtures" / "real-models" / "ltx_vae_diffusers_keys.json"
pytestmark = pytest.mark.usefixtures("one_thread")

# VAE_LTX/config.json as diffusers writes it for LTX-Video 0.9, and the LTX repository's form
# of the same network (the config FlashHead's loader maps it to)
DIFFUSERS_09 = {"_class_name": "AutoencoderKLLTXVideo", "_diffusers_version": "0.32.0.dev0",
                "block_out_channels": [128, 256, 512, 512], "decoder_causal": False, "encoder_causal": True,
                "in_channels": 3, "latent_channels": 128, "layers_per_block": [4, 3, 3, 3, 4],
                "out_channels": 3, "patch_size": 4, "patch_size_t": 1, "resnet_norm_eps": 1e-06,
                "scaling_factor": 1.0, "spatio_temporal_scaling": [True, True, True, False]}
LTX_09 = {"_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
          "latent_channels": 128, "blocks": [["res_x", 4], ["compress_all", 1], ["res_x_y", 1], ["res_x", 3],
                                             ["compress_all", 1], ["res_x_y", 1], ["res_x", 3],
                                             ["compress_all", 1], ["res_x", 3], ["res_x", 4]],
          "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
          "use_quant_conv": False, "causal_decoder": False}


def test_cli_parity_passes() -> None:
    """Measured 0 (decoded and encoded_mode; torch 2.13, AMD EPYC, 1 and 2 threads); the
    family's bound is the floor, 1e-5 (another CPU sums the convolutions in another order)."""
    out = cli_parity(LTX)
    print(LTX.name, out["max_abs_diff"])
    assert out["family"] == "ltx-vae" and out["tolerance"] == FAMILY_TOLERANCE["ltx-vae"] == 1e-5
    assert out["pass"] and out["max_abs_diff"] <= out["tolerance"]


def test_every_output_is_checked() -> None:
    result = run_parity(LTX)
    assert set(result["outputs"]) == {"decoded", "encoded_mode"}
    assert result["pass"] and all(d <= FAMILY_TOLERANCE["ltx-vae"] for d in result["outputs"].values())


def test_real_configs_both_forms() -> None:
    """The diffusers config.json and the LTX form of 0.9 are the same network (our defaults);
    the on-disk keys pass the adapter unchanged; the LTX names map to them as FlashHead's table does."""
    assert ltx_vae_config(DIFFUSERS_09) == ltx_vae_config(LTX_09) == LTXVAEConfig()
    adapter = ltx_vae_adapter(LTXVAEConfig())
    on_disk = {k: torch.empty(0) for k in json.loads(KEYS.read_text())}
    assert list(adapter.state_dict("vae", on_disk)) == list(on_disk)
    renames = {  # LTX name -> on-disk name, as FlashHead's VAE_KEYS_RENAME_DICT pairs them
        "encoder.down_blocks.2.norm3.norm.weight": "encoder.down_blocks.0.conv_out.norm3.weight",
        "encoder.down_blocks.5.conv_shortcut.weight":
            "encoder.down_blocks.1.conv_out.conv_shortcut.conv.weight",
        "encoder.down_blocks.7.conv.bias": "encoder.down_blocks.2.downsamplers.0.conv.bias",
        "encoder.down_blocks.8.res_blocks.2.conv1.conv.bias": "encoder.down_blocks.3.resnets.2.conv1.conv.bias",
        "encoder.down_blocks.9.res_blocks.3.conv2.conv.weight": "encoder.mid_block.resnets.3.conv2.conv.weight",
        "decoder.up_blocks.0.res_blocks.3.conv1.conv.weight": "decoder.mid_block.resnets.3.conv1.conv.weight",
        "decoder.up_blocks.1.res_blocks.2.conv1.conv.weight":
            "decoder.up_blocks.0.resnets.2.conv1.conv.weight",
        "decoder.up_blocks.2.conv.conv.weight": "decoder.up_blocks.1.upsamplers.0.conv.conv.weight",
        "decoder.up_blocks.7.conv_shortcut.weight": "decoder.up_blocks.3.conv_in.conv_shortcut.conv.weight",
        "decoder.up_blocks.9.res_blocks.3.conv2.conv.bias": "decoder.up_blocks.3.resnets.3.conv2.conv.bias",
        "per_channel_statistics.std-of-means": "latents_std", "mean_of_means": "latents_mean"}
    got = adapter.state_dict("vae", {k: torch.empty(0) for k in renames})
    assert list(got) == list(renames.values())


def test_on_disk_form_gives_the_same_numbers(tmp_path: Path) -> None:
    """The fixture's weights renamed to diffusers' names and written as a VAE_LTX folder
    (config.json + diffusion_pytorch_model.safetensors) load through the same loader and give
    the same numbers as the fixture's own weights loaded in memory, bit for bit, and the
    fixture's outputs within its tolerance (1e-5: bit for bit on the AMD EPYC machine that
    measured it; an Intel CPU's kernels sum in another order)."""
    fx = load_fixture(LTX)
    cfg = ltx_vae_config(fx.config)
    folder = tmp_path / "VAE_LTX"
    folder.mkdir()
    weights = folder / "diffusion_pytorch_model.safetensors"
    save_file(ltx_vae_adapter(cfg).state_dict("vae", fx.weights), str(weights))
    conf = dict(DIFFUSERS_09, block_out_channels=list(cfg.block_out_channels),
                layers_per_block=list(cfg.layers_per_block))
    (folder / "config.json").write_text(json.dumps(conf))
    vae = load_ltx_vae(read_state(weights), json.loads((folder / "config.json").read_text()))
    direct = load_ltx_vae(fx.weights, fx.config)
    with torch.no_grad():
        for name, run, x in (("decoded", "decode", "latents"), ("encoded_mode", "encode", "video")):
            got = getattr(vae, run)(fx.inputs[x][None])[0]
            assert torch.equal(got, getattr(direct, run)(fx.inputs[x][None])[0]), name
            assert (got - fx.expected[name]).abs().max() <= 1e-5, name


@torch.no_grad()
def test_a_causal_decoder_is_caught() -> None:
    """Decoding with causal time padding (as the encoder does) moves the output far past the
    tolerance: the fixture checks the decoder's two-sided padding."""
    fx = load_fixture(LTX)
    good = load_ltx_vae(fx.weights, fx.config)
    bad = load_ltx_vae(fx.weights, replace(ltx_vae_config(fx.config), decoder_causal=True))
    z = fx.inputs["latents"][None]
    assert (good.decode(z)[0] - fx.expected["decoded"]).abs().max() < 1e-5
    assert (bad.decode(z)[0] - fx.expected["decoded"]).abs().max() > 1e-2
    assert isinstance(good, LTXVideoVAE) and run(fx).keys() == fx.expected.keys()


def test_bad_inputs_are_one_clear_error(tmp_path: Path) -> None:
    shapes = rewrite_fixture(LTX, tmp_path / "shapes.safetensors",
                      weights={"encoder.conv_in.conv.weight": torch.zeros(4, 12, 3, 3, 3)})
    with pytest.raises(InputError, match=r"'encoder.conv_in.conv.weight' has shape \(4, 12, 3, 3, 3\)"):
        run_parity(shapes)
    other = rewrite_fixture(GOLDEN / "wan-vae-a.safetensors", tmp_path / "other.safetensors", family="ltx-vae")
    with pytest.raises(InputError, match="not an LTX-Video VAE config"):
        run_parity(other)
    fx = load_fixture(LTX)
    with pytest.raises(InputError, match="do not fit this network"):  # another family's weights
        load_ltx_vae(load_fixture(GOLDEN / "wan-vae-a.safetensors").weights, fx.config)
    later = rewrite_fixture(LTX, tmp_path / "later.safetensors", config=dict(fx.config, timestep_conditioning=True))
    with pytest.raises(InputError, match="timestep_conditioning.*only the LTX-Video 0.9"):
        run_parity(later)
    with pytest.raises(InputError, match="upsample_residual"):
        ltx_vae_config(dict(DIFFUSERS_09, upsample_residual=[True] * 4))
    r = run_cli("models", "parity", str(shapes), "--json")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "encoder.conv_in.conv.weight" in r.stderr
