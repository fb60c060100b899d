"""Loading the LTX-Video 0.9 VAE from either official form (family `ltx-vae`; its parity run is parity/ltx_vae.py).

Two forms of the same network reach us:
- **diffusers** (`AutoencoderKLLTXVideo`): what `VAE_LTX/` holds on disk (config.json +
  diffusion_pytorch_model.safetensors). Our `LTXVideoVAE` uses these names, so these weights
  pass the adapter unchanged.
- **the LTX repository's own** (`CausalVideoAutoencoder.from_config`, the "ours" config of
  FlashHead's `diffusers_config_mapping.py`): one flat `blocks` list, modules `down_blocks.0..9` /
  `up_blocks.0..9`, `res_blocks`, statistics as `mean_of_means` / `std_of_means` (or
  `per_channel_statistics.*`). The golden fixture stores this form.

`ltx_vae_config(raw)` turns either config into `LTXVAEConfig`, refusing anything the 0.9 port
does not implement (timestep conditioning, noise injection, residual upsamplers, other block
kinds) with one `InputError`. `ltx_vae_adapter(cfg)` renames the LTX form's keys: which flat
index is which diffusers module follows from the stage layout, so the rules are derived from the
config rather than written out for one size. `load_ltx_vae(state, config)` is the one loader the
parity tool and an official-folder loader both call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from avatarstream.errors import InputError
from avatarstream.models.ltx import LTXVAEConfig, LTXVideoVAE
from avatarstream.weights.adapters import KeyRule, StateDictAdapter
from avatarstream.weights.official import build_loaded

_NOT_09 = "only the LTX-Video 0.9 VAE layout is supported"
# diffusers config fields that must keep their 0.9 value (anything else changes the network)
_DIFFUSERS_FIXED: dict[str, Any] = {"patch_size_t": 1, "timestep_conditioning": False}
_DIFFUSERS_ALL_EQUAL: dict[str, Any] = {"down_block_types": "LTXVideoDownBlock3D", "downsample_type": "conv",
                                        "decoder_inject_noise": False, "upsample_residual": False,
                                        "upsample_factor": 1}
_DIFFUSERS_FIELDS = {"in_channels", "out_channels", "latent_channels", "patch_size", "block_out_channels",
                     "layers_per_block", "spatio_temporal_scaling", "decoder_block_out_channels",
                     "decoder_layers_per_block", "decoder_spatio_temporal_scaling", "encoder_causal",
                     "decoder_causal", "resnet_norm_eps"}
_IGNORED = {"scaling_factor", "spatial_compression_ratio", "temporal_compression_ratio", "sample_size"}


def ltx_vae_config(raw: Mapping[str, Any]) -> LTXVAEConfig:
    """`LTXVAEConfig` from an official config dict: diffusers' `AutoencoderKLLTXVideo` config.json
    or the LTX repository's `CausalVideoAutoencoder` config. InputError for anything else."""
    kind = raw.get("_class_name")
    if kind == "CausalVideoAutoencoder":
        return _from_ltx(raw)
    if kind == "AutoencoderKLLTXVideo":
        return _from_diffusers(raw)
    raise InputError(f"not an LTX-Video VAE config (_class_name {kind!r}; expected "
                     "AutoencoderKLLTXVideo or CausalVideoAutoencoder)")


def _from_diffusers(raw: Mapping[str, Any]) -> LTXVAEConfig:
    for k, want in _DIFFUSERS_FIXED.items():
        if k in raw and raw[k] != want:
            raise InputError(f"LTX VAE config: {k} = {raw[k]!r}; {_NOT_09} ({k} = {want!r})")
    for k, want in _DIFFUSERS_ALL_EQUAL.items():
        if k in raw and any(v != want for v in (raw[k] if isinstance(raw[k], (list, tuple)) else [raw[k]])):
            raise InputError(f"LTX VAE config: {k} = {raw[k]!r}; {_NOT_09} (all {want!r})")
    unknown = sorted(k for k in raw if not k.startswith("_") and k not in
                     _DIFFUSERS_FIELDS | _IGNORED | set(_DIFFUSERS_FIXED) | set(_DIFFUSERS_ALL_EQUAL))
    if unknown:
        raise InputError(f"LTX VAE config: unknown field(s) {unknown}; {_NOT_09}")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in _DIFFUSERS_FIELDS}
    for enc, dec in (("block_out_channels", "decoder_block_out_channels"),
                     ("layers_per_block", "decoder_layers_per_block"),
                     ("spatio_temporal_scaling", "decoder_spatio_temporal_scaling")):
        if enc in kw and dec not in kw:  # diffusers 0.32.0.dev0 configs (LTX 0.9) share them
            kw[dec] = kw[enc]
    return _make(kw)


def _stages(blocks: list[Any], base: int,
            side: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """LTX `blocks` (encoder order) -> (block_out_channels, layers_per_block, scaling): each
    stage is `res_x` [`compress_all`] [`res_x_y`]; the last `res_x` is the mid block."""
    layers: list[int] = []
    scaling: list[bool] = []
    widths = [base]
    i = 0
    while i < len(blocks):
        name, params = blocks[i]
        params = {"num_layers": params} if isinstance(params, int) else dict(params)
        if name != "res_x" or params.get("inject_noise", False):
            raise InputError(f"LTX VAE {side} block {i} ({name} {params}): expected a res_x stage "
                             f"without noise injection; {_NOT_09}")
        layers.append(int(params["num_layers"]))
        i += 1
        scale, mult = False, 1
        if i < len(blocks) and blocks[i][0] == "compress_all":
            p = blocks[i][1] if isinstance(blocks[i][1], dict) else {}
            if p.get("residual", False) or p.get("multiplier", 1) != 1:
                raise InputError(f"LTX VAE {side} block {i}: residual / multiplied compress_all; {_NOT_09}")
            scale, i = True, i + 1
        if i < len(blocks) and blocks[i][0] == "res_x_y":
            p = blocks[i][1] if isinstance(blocks[i][1], dict) else {}
            mult, i = int(p.get("multiplier", 2)), i + 1
        scaling.append(scale)
        widths.append(widths[-1] * mult)
    if len(layers) < 2 or scaling[-1] or widths[-1] != widths[-2] or widths[-2] != widths[-3]:
        raise InputError(f"LTX VAE {side} blocks {blocks}: the last two stages must keep the width "
                         f"and the last (mid block) must not downsample; {_NOT_09}")
    return tuple(widths[:-2]), tuple(layers), tuple(scaling[:-1])


def _from_ltx(raw: Mapping[str, Any]) -> LTXVAEConfig:
    checks = {"dims": (3, [3]), "norm_layer": ("pixel_norm",), "use_quant_conv": (False,),
              "normalize_latent_channels": (False, None), "timestep_conditioning": (False, None)}
    for k, allowed in checks.items():
        if raw.get(k) not in allowed:
            raise InputError(f"LTX VAE config: {k} = {raw.get(k)!r}; {_NOT_09} ({allowed[0]!r})")
    if not isinstance(raw.get("latent_channels"), int):
        raise InputError(f"LTX VAE config: latent_channels = {raw.get('latent_channels')!r}, expected an int")
    try:
        enc = _stages(list(raw.get("encoder_blocks", raw.get("blocks", []))),
                      int(raw.get("encoder_base_channels", 128)), "encoder")
        dec = _stages(list(raw.get("decoder_blocks", raw.get("blocks", []))),
                      int(raw.get("decoder_base_channels", 128)), "decoder")
    except (TypeError, ValueError, KeyError, IndexError) as e:  # a block that is not [name, params]
        raise InputError(f"LTX VAE config: malformed blocks list ({type(e).__name__}: {e})") from None
    return _make(dict(
        in_channels=raw.get("in_channels", 3), out_channels=raw.get("out_channels", 3),
        latent_channels=raw["latent_channels"], patch_size=raw.get("patch_size", 1),
        block_out_channels=enc[0], layers_per_block=enc[1], spatio_temporal_scaling=enc[2],
        decoder_block_out_channels=dec[0], decoder_layers_per_block=dec[1],
        decoder_spatio_temporal_scaling=dec[2],
        latent_log_var=raw.get("latent_log_var", "per_channel" if raw.get("double_z", True) else "none"),
        decoder_causal=bool(raw.get("causal_decoder", False)),
        spatial_padding_mode=raw.get("spatial_padding_mode", "zeros")))


def _make(kw: dict[str, Any]) -> LTXVAEConfig:
    try:
        return LTXVAEConfig(**kw)
    except (TypeError, ValueError) as e:
        raise InputError(f"LTX VAE config: {e}") from None


def ltx_vae_adapter(cfg: LTXVAEConfig) -> StateDictAdapter:
    """Renames of the LTX repository's keys to ours (diffusers'); diffusers keys match no rule.

    The LTX form numbers the encoder's modules in order (stage i: resnets, downsampler, widening
    resnet; then the mid block) and the decoder's likewise (mid block; stage i: narrowing resnet,
    upsampler, resnets), so the flat index of each module follows from `cfg`."""
    wb = r"(?:weight|bias)"
    rules = [KeyRule("vae", r"(?:per_channel_statistics\.mean-of-means|mean_of_means)", "latents_mean"),
             KeyRule("vae", r"(?:per_channel_statistics\.std-of-means|std_of_means)", "latents_std")]

    def rename(side: str, j: int, theirs: str, ours: str) -> None:  # `side`.j.`theirs` -> `ours`
        rules.append(KeyRule("vae", rf"{side}\.{j}\.{theirs}", ours))

    def widening(side: str, j: int, ours: str) -> None:  # LTX `res_x_y`
        rename(side, j, rf"conv_shortcut\.({wb})", rf"{ours}.conv_shortcut.conv.\1")
        rename(side, j, rf"norm3\.norm\.({wb})", rf"{ours}.norm3.\1")
        rename(side, j, rf"(conv[12]\.conv\.{wb})", rf"{ours}.\1")

    enc, ch, j = r"encoder\.down_blocks", cfg.block_out_channels, 0
    for i in range(len(ch)):
        rename(enc, j, r"res_blocks\.(.+)", rf"encoder.down_blocks.{i}.resnets.\1")
        j += 1
        if cfg.spatio_temporal_scaling[i]:
            rename(enc, j, rf"(conv\.{wb})", rf"encoder.down_blocks.{i}.downsamplers.0.\1")
            j += 1
        if i + 1 < len(ch) and ch[i + 1] != ch[i]:
            widening(enc, j, f"encoder.down_blocks.{i}.conv_out")
            j += 1
    rename(enc, j, r"res_blocks\.(.+)", r"encoder.mid_block.resnets.\1")

    dec = r"decoder\.up_blocks"
    rename(dec, 0, r"res_blocks\.(.+)", r"decoder.mid_block.resnets.\1")
    ch = tuple(reversed(cfg.decoder_block_out_channels))
    scaling = tuple(reversed(cfg.decoder_spatio_temporal_scaling))
    j = 1
    for i in range(len(ch)):
        if i > 0 and ch[i] != ch[i - 1]:
            widening(dec, j, f"decoder.up_blocks.{i}.conv_in")
            j += 1
        if scaling[i]:
            rename(dec, j, rf"(conv\.conv\.{wb})", rf"decoder.up_blocks.{i}.upsamplers.0.\1")
            j += 1
        rename(dec, j, r"res_blocks\.(.+)", rf"decoder.up_blocks.{i}.resnets.\1")
        j += 1
    return StateDictAdapter("LTX-Video VAE", rules=tuple(rules))


def load_ltx_vae(state: Mapping[str, torch.Tensor], config: Mapping[str, Any] | LTXVAEConfig, *,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                 what: str = "LTX-Video VAE weights") -> LTXVideoVAE:
    """The VAE built on the meta device and filled in place from `state` (diffusers or LTX keys,
    an optional `vae.` prefix) under `config` (either official form, or an LTXVAEConfig). One
    InputError names the first missing, unexpected or mis-shaped key."""
    cfg = config if isinstance(config, LTXVAEConfig) else ltx_vae_config(config)
    if any(k.startswith("vae.") for k in state):  # a combined LTX checkpoint: keep the VAE's part
        state = {k[len("vae."):]: v for k, v in state.items() if k.startswith("vae.")}
    ours = ltx_vae_adapter(cfg).state_dict("vae", state)
    vae = build_loaded(lambda: LTXVideoVAE(cfg), ours, what=what, dtype=dtype, device=device)
    assert isinstance(vae, LTXVideoVAE)
    return vae.eval()
