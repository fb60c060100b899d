"""Loading wav2vec2 checkpoints as Hugging Face ships them, into our port (`models/wav2vec2`).

A downloaded folder (facebook/wav2vec2-base-960h, wav2vec2-large-xlsr-53-english) holds
`config.json` and `model.safetensors` or `pytorch_model.bin`. Its keys are those of
`Wav2Vec2ForCTC` (`wav2vec2.*` plus the CTC head `lm_head.*`); a bare `Wav2Vec2Model` state dict
(FlashHead's wrapper, the golden fixture) has no prefix. The positional conv's weight norm is
stored as `weight_g` / `weight_v` in checkpoints written before torch's parametrizations, and as
`parametrizations.weight.original0` / `original1` in state dicts of today's `transformers`
modules. `ADAPTER` maps every one of these forms onto our keys; the CTC head and SpecAugment's
mask embedding are training or ASR parts, skipped by name (`UNUSED`), and anything else that
does not fit is one error naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import InputError
from avatarstream.models.wav2vec2 import Wav2Vec2, Wav2Vec2Config
from avatarstream.weights.adapters import KeyRule, StateDictAdapter
from avatarstream.weights.official import build_loaded, read_state
from avatarstream.weights.validate import WAV2VEC2 as WAV2VEC2_SCHEMA, confine, fields, read_json

_PREFIX = r"(?:wav2vec2\.)?"
_POS_CONV = _PREFIX + r"(encoder\.pos_conv_embed\.conv)\."

ADAPTER = StateDictAdapter("wav2vec2", rules=(
    KeyRule("wav2vec2", _POS_CONV + r"(?:weight_g|parametrizations\.weight\.original0)", r"\1.weight_g"),
    KeyRule("wav2vec2", _POS_CONV + r"(?:weight_v|parametrizations\.weight\.original1)", r"\1.weight_v"),
    KeyRule("wav2vec2", r"wav2vec2\.(.*)", r"\1"),
))
UNUSED = (r"lm_head\..*", r"masked_spec_embed")  # the CTC head; SpecAugment's (training) mask vector

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what the HF folders ship, preferred first


def load_wav2vec2(state: Mapping[str, torch.Tensor], config: Wav2Vec2Config | Mapping[str, Any], *,
                  dtype: torch.dtype | None = None, what: str = "wav2vec2") -> Wav2Vec2:
    """Our `Wav2Vec2` filled in place from a stored state dict (any of the key forms above);
    config: ours, or the checkpoint's config.json dict. dtype None: as stored."""
    cfg = config if isinstance(config, Wav2Vec2Config) else Wav2Vec2Config.from_hf(config)
    net = build_loaded(lambda: Wav2Vec2(cfg), ADAPTER.state_dict("wav2vec2", state), what=what,
                       dtype=dtype, unused=UNUSED)
    return net.eval().requires_grad_(False)


def load_wav2vec2_folder(folder: str | Path, *, dtype: torch.dtype | None = None) -> Wav2Vec2:
    """A downloaded HF wav2vec2 folder (config.json + model.safetensors or pytorch_model.bin)."""
    d = Path(folder)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{d}: no config.json; is this a downloaded wav2vec2 folder?")
    raw = read_json(confine(cfg_path, d))
    fields(raw, WAV2VEC2_SCHEMA, str(cfg_path))
    if raw.get("model_type") != "wav2vec2":
        raise InputError(f"{cfg_path}: model_type {raw.get('model_type')!r}, not a wav2vec2 checkpoint")
    weights = next((d / f for f in WEIGHT_FILES if (d / f).is_file()), None)
    if weights is None:
        raise InputError(f"{d}: none of {', '.join(WEIGHT_FILES)}; the download is incomplete")
    return load_wav2vec2(read_state(confine(weights, d)), raw, dtype=dtype, what=str(weights))
