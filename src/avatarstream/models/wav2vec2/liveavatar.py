"""LiveAvatar's audio input: all wav2vec2 hidden states of a whole clip, bucketed to video frames.

LiveAvatar (`s2v/audio_encoder.py:AudioEncoder` and the pipeline's `encode_audio`) encodes the
**whole file at once** with wav2vec2-large-xlsr-53 and hands the DiT every one of its L+1 hidden
states (the DiT mixes them with learned weights):

1. normalise the clip (`normalize_waveform`) and run the encoder at 50 Hz: `[L+1, T50, C]`.
   The last state is the final LayerNorm's output, as `transformers` 4.x (LiveAvatar pins
   ≤ 4.51.3) returns it; 5.x returns the raw last layer there instead (checked on 5.24), which
   is not what the DiT was trained on;
2. resample linearly (align corners) to the 30 fps grid the official encoder works on,
   `int(T50 / 50 · 30)` frames, so the result depends on the clip's total length;
3. bucket to video frames: video frame j takes 30-fps frame round(j · 30/25) (with `m` neighbours
   each side, stride 30 // 25, concatenated on channels; LiveAvatar uses m = 0); frames past the
   end are zeros and the count is rounded up to a multiple of `batch_frames` (the clip length);
4. lay it out as the DiT's `audio_input` `[1, L+1, C·(2m+1), frames]`.

Whole-clip encoding is not streamable (every feature depends on all the audio, through the
normalisation, the self-attention and the length-dependent resampling). That is LiveAvatar's
quirk (docs/real-models.md, LiveAvatar's "Audio"); a bounded window replaces it in issue 29. This file reproduces the
official behaviour, which the golden fixture `wav2vec2-a` checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from avatarstream.models.wav2vec2.model import Wav2Vec2, normalize_waveform, resample_frames


@dataclass(frozen=True)
class LiveAvatarAudioConfig:
    feature_fps: int = 50  # wav2vec2's frame rate (320x down at 16 kHz)
    mid_fps: int = 30  # the official AudioEncoder's `video_rate`: features are resampled to it first
    fps: int = 25  # video frames per second
    batch_frames: int = 48  # video frames per clip: the bucket count is a multiple of it
    m: int = 0  # neighbours each side concatenated on channels (the pipeline's audio_sample_m)


def to_mid_fps(states: torch.Tensor, cfg: LiveAvatarAudioConfig) -> torch.Tensor:
    """`[L+1, T50, C]` -> `[L+1, int(T50 / 50 · 30), C]` (the float expression of the original,
    so the truncation agrees at every length)."""
    frames = int(states.shape[1] / float(cfg.feature_fps) * cfg.mid_fps)
    return resample_frames(states, frames)


def bucket_indices(frames: int, cfg: LiveAvatarAudioConfig) -> tuple[np.ndarray, int]:
    """(mid-fps frame index of every video frame `[n]`, n): n = the video frame count rounded up
    to a multiple of batch_frames; indices may reach past `frames` (those video frames are zeros)."""
    clips = int(frames / (cfg.batch_frames * (cfg.mid_fps / cfg.fps))) + 1
    n = clips * cfg.batch_frames
    total = math.ceil(clips * cfg.batch_frames / cfg.fps * cfg.mid_fps)  # mid-fps frames, padded
    times = np.linspace(0.0, n / cfg.fps, n, endpoint=False)  # video frame times, seconds
    idx = np.clip(np.round(times * cfg.mid_fps).astype(int), 0, total - 1)
    return idx, n


def bucket_to_video(features: torch.Tensor, cfg: LiveAvatarAudioConfig) -> torch.Tensor:
    """`[L+1, T30, C]` -> the DiT's `audio_input` `[1, L+1, C·(2m+1), frames]`."""
    layers, t, c = features.shape
    idx, n = bucket_indices(t, cfg)
    stride = int(cfg.mid_fps / cfg.fps)
    offsets = np.arange(-cfg.m, cfg.m + 1) * stride
    window = torch.from_numpy(np.clip(idx[:, None] + offsets[None], 0, t - 1))  # [n, 2m+1]
    out = features[:, window.flatten()].view(layers, n, -1)  # [L+1, n, (2m+1)·C]
    past_end = torch.from_numpy(idx >= t).to(out.device)
    out = out.masked_fill(past_end[None, :, None], 0.0)  # video frames past the audio: zeros
    return out.permute(0, 2, 1)[None]  # [1, L+1, (2m+1)·C, n]


def liveavatar_states(model: Wav2Vec2, wave: torch.Tensor) -> torch.Tensor:
    """One clip `[N]` (16 kHz) -> its L+1 hidden states at 50 Hz `[L+1, T50, C]`."""
    x = normalize_waveform(wave.float()).to(next(model.parameters()).dtype)
    return model(x[None])[:, 0]


def liveavatar_audio_input(model: Wav2Vec2, wave: torch.Tensor,
                           cfg: LiveAvatarAudioConfig = LiveAvatarAudioConfig()) -> torch.Tensor:
    """One whole clip `[N]` -> the DiT's `audio_input` `[1, L+1, C, frames]` (m = 0)."""
    return bucket_to_video(to_mid_fps(liveavatar_states(model, wave), cfg), cfg)
