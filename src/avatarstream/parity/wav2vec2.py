"""Parity of the wav2vec2 audio paths (family `wav2vec2`, docs/parity-fixtures.md).

The fixture's weights go through `weights/wav2vec2.load_wav2vec2`, the loader a downloaded HF
folder takes (prefix strip, weight-norm names, CTC head skipped). Then, per `settings.variant`:

- `liveavatar`: the whole clip through the stable-layer-norm model, every hidden state at 50 Hz,
  resampled to 30 fps and bucketed to 25 fps video frames (`models/wav2vec2/liveavatar.py`);
- `flashhead`: the clip as one stream-mode window through the post-LN model at 25 fps, the layer
  outputs and the ±radius windows of frames [audio_start_idx, audio_end_idx)
  (`models/wav2vec2/flashhead.py`).

Every size comes from the fixture's config and settings.
"""

from __future__ import annotations

import torch

from avatarstream.errors import InputError
from avatarstream.models.wav2vec2.flashhead import (FlashHeadAudioConfig, flashhead_states, frame_windows,
                                                    layer_features)
from avatarstream.models.wav2vec2.liveavatar import (LiveAvatarAudioConfig, bucket_to_video,
                                                     liveavatar_states, to_mid_fps)
from avatarstream.models.wav2vec2.model import normalize_waveform
from avatarstream.parity.fixture import Fixture
from avatarstream.weights.wav2vec2 import load_wav2vec2


def run(fx: Fixture) -> dict[str, torch.Tensor]:
    """Our outputs for the fixture's expected tensors, by variant."""
    variants = {"liveavatar": _liveavatar, "flashhead": _flashhead}
    if fx.config.get("model_type") != "wav2vec2":
        raise InputError(f"{fx.path}: config is not a wav2vec2 config (model_type "
                         f"{fx.config.get('model_type')!r})")
    if fx.variant not in variants:
        raise InputError(f"{fx.path}: wav2vec2 variant {fx.variant!r} is unknown; known: "
                         f"{', '.join(variants)}")
    if "waveform" not in fx.inputs:
        raise InputError(f"{fx.path}: no inputs.waveform in this wav2vec2 fixture")
    wave = fx.inputs["waveform"].float()
    model = load_wav2vec2(fx.weights, fx.config, dtype=torch.float32, what=f"{fx.path} weights")
    return {"input_values": normalize_waveform(wave), **variants[fx.variant](fx, model, wave)}


def _liveavatar(fx: Fixture, model: torch.nn.Module, wave: torch.Tensor) -> dict[str, torch.Tensor]:
    s = fx.settings  # the clip length: video frames per bucket repeat
    cfg = LiveAvatarAudioConfig(fps=int(s.get("fps", 25)),
                                batch_frames=int(s["video_frames"]) // int(s.get("num_repeat", 1)))
    states = liveavatar_states(model, wave)  # [L+1, T50, C]
    mid = to_mid_fps(states, cfg)  # [L+1, T30, C]
    return {"hidden_states": states, "features_30fps": mid, "audio_embed": bucket_to_video(mid, cfg)}


def _flashhead(fx: Fixture, model: torch.nn.Module, wave: torch.Tensor) -> dict[str, torch.Tensor]:
    s = fx.settings
    cfg = FlashHeadAudioConfig(sample_rate=int(s["sample_rate"]), fps=int(s["fps"]),
                               frame_num=int(s["frame_num"]))
    states = flashhead_states(model, wave, cfg)  # [L+1, T25, C]
    features = layer_features(states)  # [T25, L, C]
    windows = frame_windows(features, int(s["audio_start_idx"]), int(s["audio_end_idx"]), cfg.radius)
    return {"hidden_states": states, "audio_emb": features, "audio_embedding": windows}
