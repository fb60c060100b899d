"""FlashHead's audio context: wav2vec2-base at 25 fps over a bounded trailing window.

What the official code feeds the DiT per chunk (`FlashHeadPipeline.preprocess_audio`,
`inference.get_audio_embedding`, stream mode of `generate_video.py`; docs/real-models.md, "The official FlashHead loop"):

1. **Encode at the video rate.** The window is normalised as a whole (`normalize_waveform`),
   the CNN features (50 Hz) are resampled linearly (align corners) to `int(N · 25 / 16000)`
   frames **before** the feature projection and the transformer, so the transformer runs at
   25 fps. The L layer outputs (`hidden_states[1:]`, no state 0) are the per-frame features
   `[T, L, C]`.
2. **Windows.** Video frame f gets the features of frames f−2 .. f+2 (`radius` 2), indices
   clamped to [0, end−1]: `[1, frames, 5, L, C]`, the DiT's audio context (its audio projection
   reads 5 windows for latent 0 and 3 + (s−2) + 3 for the others).
3. **Stream mode** (`FlashHeadAudioStream`). A trailing window of `window_seconds` (8 s: 128000
   samples, 200 frames) starts as silence; each chunk appends its new samples (28 · 640 for Pro,
   24 · 640 for Lite), the **whole window is re-encoded**, and the chunk takes its last
   `frame_num` (33) frames. The newest two frames therefore see no future audio (their windows
   are clamped at the end), and no frame sees more than 8 s of past. The cost per chunk is one
   encoder pass over 200 frames, constant in the stream's length.

Re-encoding the whole window is required, not an inefficiency to optimise away: the clip
normalisation, the GroupNorm over time in conv 0 and the self-attention make every feature depend
on the whole window, so features of a frame change as the window slides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from avatarstream.models.wav2vec2.model import Wav2Vec2, normalize_waveform, resample_frames


@dataclass(frozen=True)
class FlashHeadAudioConfig:
    sample_rate: int = 16000
    fps: int = 25  # video frames per second: the encoder runs at this rate
    radius: int = 2  # frames each side of a video frame's window (5 windows)
    window_seconds: int = 8  # stream mode's trailing window (infer_params `cached_audio_duration`)
    frame_num: int = 33  # video frames per chunk

    @property
    def window_samples(self) -> int:
        return self.sample_rate * self.window_seconds

    def frames(self, samples: int) -> int:
        """Video frames the encoder makes of `samples` samples (the official `int(N·fps/sr)`)."""
        return int(samples * self.fps / self.sample_rate)


def flashhead_states(model: Wav2Vec2, wave: torch.Tensor, cfg: FlashHeadAudioConfig) -> torch.Tensor:
    """A window `[N]` (16 kHz) -> the L+1 hidden states at the video rate `[L+1, frames(N), C]`."""
    x = normalize_waveform(wave.float()).to(next(model.parameters()).dtype)
    features = resample_frames(model.conv_features(x[None]), cfg.frames(wave.shape[-1]))  # [1, T25, Cf]
    return model.encode(features)[:, 0]


def layer_features(states: torch.Tensor) -> torch.Tensor:
    """`[L+1, T, C]` -> the per-frame layer outputs `[T, L, C]` (state 0 dropped)."""
    return states[1:].transpose(0, 1)


def frame_windows(features: torch.Tensor, start: int, end: int, radius: int) -> torch.Tensor:
    """`[T, L, C]` -> `[1, end − start, 2·radius + 1, L, C]`: frame f's window is frames
    f − radius .. f + radius, clamped to [0, end − 1] (no frame past `end` is read)."""
    offsets = torch.arange(-radius, radius + 1, device=features.device)
    idx = (torch.arange(start, end, device=features.device)[:, None] + offsets).clamp(0, end - 1)
    return features[idx][None]


def flashhead_audio_context(model: Wav2Vec2, wave: torch.Tensor, cfg: FlashHeadAudioConfig,
                            start: int | None = None, end: int | None = None) -> torch.Tensor:
    """The DiT's audio context for frames [start, end) of the encoded window `wave [N]`
    (default: all of it): `[1, end − start, 2·radius + 1, L, C]`."""
    features = layer_features(flashhead_states(model, wave, cfg))
    end = features.shape[0] if end is None else end
    return frame_windows(features, 0 if start is None else start, end, cfg.radius)


class FlashHeadAudioStream:
    """Stream mode: a trailing window of samples, zero at start, re-encoded whole per chunk.

    `push(samples)` appends a chunk's new audio (dropping the oldest); `context()` is the DiT's
    audio context for the chunk: the window's last `frame_num` frames, `[1, frame_num, 5, L, C]`.
    """

    def __init__(self, model: Wav2Vec2, cfg: FlashHeadAudioConfig = FlashHeadAudioConfig()) -> None:
        self.model, self.cfg = model, cfg
        self.window = torch.zeros(cfg.window_samples)  # [window_samples], newest last

    def reset(self) -> None:
        self.window.zero_()

    def push(self, samples: torch.Tensor) -> None:
        """Append `[n]` new samples (any n; only the newest window_samples are kept)."""
        samples = samples.detach().to(torch.float32).flatten().cpu()
        self.window = torch.cat([self.window, samples])[-self.cfg.window_samples:]

    def context(self) -> torch.Tensor:
        end = self.cfg.frames(self.cfg.window_samples)
        wave = self.window.to(next(self.model.parameters()).device)
        return flashhead_audio_context(self.model, wave, self.cfg, end - self.cfg.frame_num, end)
