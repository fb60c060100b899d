"""FlashHead's audio projection: wav2vec2 windows of the chunk's video frames -> a fixed set of
audio tokens per latent frame, the context of the DiT's per-frame audio cross-attention.

The audio input of a chunk is `[B, frames, window, layers, channels]`: for each of the chunk's
`1 + s·(F − 1)` video frames (s = video frames per latent, the VAE's temporal stride), the stacked
hidden states of the audio encoder's layers at the frames f − 2 .. f + 2 (`window` = 5). A causal
video VAE maps frame 0 alone to latent 0 and frames `1 + s·(j−1) .. s·j` to latent j, so:

- latent 0 sees its frame's whole window (5 windows, `proj1`);
- latent j ≥ 1 sees its s frames without counting a frame twice where neighbouring windows
  overlap: the first frame's windows up to the centre, each middle frame's centre window, the
  last frame's windows from the centre on: 3 + (s − 2) + 3 = window + s − 1 windows
  (8 for Pro, s = 4; 12 for Lite, s = 8; `proj1_vf`).

Both go through ReLU, a shared `proj2` + ReLU and `proj3`, which makes `tokens` vectors of the
model width per latent frame, then a LayerNorm (eps 1e-5, the official module's default).
The official module hard-codes 12 layers × 768 channels, width 512 and 32 tokens (wav2vec2-base);
here they come from the config, so tiny test models can shrink them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class AudioProjConfig:
    """Sizes of the audio projection; defaults are wav2vec2-base's (the released checkpoints)."""

    layers: int = 12  # hidden states stacked per frame
    channels: int = 768
    hidden: int = 512
    tokens: int = 32  # context tokens per latent frame
    window: int = 5  # frames f − 2 .. f + 2 per video frame


def latent_windows(audio: torch.Tensor, frames_per_latent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a chunk's per-video-frame windows by latent frame (see the module docstring).

    audio `[B, 1 + s·(F−1), W, L, C]` -> first `[B, 1, W·L·C]` (latent 0), later
    `[B, F−1, (W + s − 1)·L·C]` (latents 1..F−1), s = `frames_per_latent`.
    """
    b, n, w, layers, c = audio.shape
    s = frames_per_latent
    if (n - 1) % s:
        raise ValueError(f"{n} audio frames do not make whole latents: expected 1 + {s}·k")
    mid = w // 2
    first = audio[:, :1].reshape(b, 1, w * layers * c)  # [B, 1, W·L·C]
    groups = audio[:, 1:].reshape(b, (n - 1) // s, s, w, layers, c)  # [B, F−1, s, W, L, C]
    later = torch.cat([groups[:, :, 0, : mid + 1],  # [B, F−1, mid+1, L, C] first frame, past half
                       groups[:, :, 1:-1, mid],  # [B, F−1, s−2, L, C] middle frames, centre
                       groups[:, :, -1, mid:]], dim=2)  # [B, F−1, W−mid, L, C] last frame, future half
    return first, later.flatten(2)  # [B, 1, W·L·C], [B, F−1, (W+s−1)·L·C]


class AudioProjection(nn.Module):
    """Keys as the official `audio_proj`: `proj1`, `proj1_vf`, `proj2`, `proj3`, `norm`."""

    def __init__(self, config: AudioProjConfig, dim: int, frames_per_latent: int) -> None:
        """Tokens of width `dim` (the DiT's) for latents of `frames_per_latent` video frames."""
        super().__init__()
        c, w = config, config.window
        if frames_per_latent < 2 or w < 3 or w % 2 == 0:
            raise ValueError(f"audio windowing needs >= 2 frames per latent and an odd window >= 3, "
                             f"got {frames_per_latent} and {w}")
        self.tokens, self.dim, self.frames_per_latent = c.tokens, dim, frames_per_latent
        per_window = c.layers * c.channels
        self.proj1 = nn.Linear(w * per_window, c.hidden)
        self.proj1_vf = nn.Linear((w + frames_per_latent - 1) * per_window, c.hidden)
        self.proj2 = nn.Linear(c.hidden, c.hidden)
        self.proj3 = nn.Linear(c.hidden, c.tokens * dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """audio `[B, 1 + s·(F−1), W, L, C]` -> tokens `[B, F, tokens, dim]`."""
        first, later = latent_windows(audio, self.frames_per_latent)
        h = torch.cat([F.relu(self.proj1(first)), F.relu(self.proj1_vf(later))], dim=1)  # [B, F, hidden]
        h = F.relu(self.proj2(h))
        return self.norm(self.proj3(h).unflatten(-1, (self.tokens, self.dim)))  # [B, F, tokens, dim]
