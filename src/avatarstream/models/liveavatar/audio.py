"""LiveAvatar's audio path: the wav2vec2 layers mixed and encoded into per-latent-frame tokens
(`casual_audio_encoder`, the official key's spelling), and the injectors that add them to the
noisy tokens after some DiT layers (`audio_injector`).

Encoder (Wan2.2-S2V's `CausalAudioEncoder`):
1. the L wav2vec2 states are mixed with weights silu(w) / Σ silu(w);
2. a local branch (`conv1_local`: n·D/4 channels, read as n tokens of D/4) and a global one
   (`conv1_global`: D/4) each go through the shared `conv2` and `conv3`: causal Conv1d (kernel 3,
   replicate left padding 2, the last two with stride 2: 4 video frames per latent frame), each
   followed by LayerNorm (no affine, eps 1e-6) and SiLU;
3. per latent frame: n local tokens plus the learned `padding_tokens` (n + 1 tokens), and one
   global token (`final_linear`).

Injector j (after the j-th layer of `audio_inject_layers`), frame by frame on the noisy tokens:
x̂ = LayerNorm(x, eps 1e-5, no affine)·(1 + scale) + shift with (shift, scale) =
linear(silu(global)), then x += CrossAttention(x̂, the frame's n + 1 local tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.models.dit_blocks import CrossAttention

ENCODER_EPS = 1e-6  # LayerNorms of the audio encoder (official constant)
ADAIN_EPS = 1e-5  # the injector's AdaLN LayerNorm (diffusers `AdaLayerNorm` default)
INJECTOR_EPS = 1e-6  # the injectors' q/k RMSNorm (official default, whatever the model's eps)


class CausalConv1d(nn.Module):
    """Conv1d that sees only the past: the input is left-padded by repeating its first frame."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1) -> None:
        super().__init__()
        self.pad = kernel - 1
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, C, T]` -> `[B, C', ceil(T / stride)]`."""
        return self.conv(F.pad(x, (self.pad, 0), mode="replicate"))


class AudioTokenEncoder(nn.Module):
    """The convolutions after the layer mix (official `MotionEncoder_tc`, key `encoder`)."""

    def __init__(self, audio_dim: int, dim: int, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        q = dim // 4
        self.conv1_local = CausalConv1d(audio_dim, q * tokens)
        self.conv1_global = CausalConv1d(audio_dim, q)
        self.conv2 = CausalConv1d(q, dim // 2, stride=2)
        self.conv3 = CausalConv1d(dim // 2, dim, stride=2)
        self.final_linear = nn.Linear(dim, dim)
        self.padding_tokens = nn.Parameter(torch.zeros(1, 1, 1, dim))

    @staticmethod
    def _norm_act(x: torch.Tensor) -> torch.Tensor:
        """LayerNorm over channels then SiLU: x `[N, C, T]` -> `[N, T, C]`."""
        x = x.transpose(1, 2)
        return F.silu(F.layer_norm(x, x.shape[-1:], eps=ENCODER_EPS))

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """After conv1 (`[N, D/4, T]`, not yet normalised) -> `[N, T/4, D]`."""
        x = self.conv2(self._norm_act(x).transpose(1, 2))
        x = self.conv3(self._norm_act(x).transpose(1, 2))
        return self._norm_act(x)

    def forward(self, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feat `[B, C_a, T]` mixed wav2vec2 features at video rate -> (global `[B, T', 1, D]`,
        local `[B, T', n + 1, D]`) with T' = ceil(ceil(T / 2) / 2) latent frames."""
        b, _, t = feat.shape
        n = self.tokens
        loc = self.conv1_local(feat)  # [B, n·D/4, T], channels grouped token-major
        loc = loc.reshape(b, n, -1, t).flatten(0, 1)  # [B·n, D/4, T]
        loc = self._shared(loc)  # [B·n, T', D]
        loc = loc.unflatten(0, (b, n)).transpose(1, 2)  # [B, T', n, D]
        pad = self.padding_tokens.expand(b, loc.shape[1], 1, -1)
        loc = torch.cat([loc, pad.to(loc.dtype)], dim=2)  # [B, T', n + 1, D]
        glob = self.final_linear(self._shared(self.conv1_global(feat)))  # [B, T', D]
        return glob[:, :, None], loc


class CausalAudioEncoder(nn.Module):
    """wav2vec2 states `[B, L, C_a, T]` (video rate) -> (global, local) tokens per latent frame."""

    def __init__(self, audio_dim: int, dim: int, tokens: int, layers: int) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.full((1, layers, 1, 1), 0.01))
        self.encoder = AudioTokenEncoder(audio_dim, dim, tokens)

    def forward(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = F.silu(self.weights.float())  # [1, L, 1, 1]
        feat = (states.float() * w / w.sum(dim=1, keepdim=True)).sum(dim=1)  # [B, C_a, T]
        return self.encoder(feat.to(self.weights.dtype))


class AudioAdaLN(nn.Module):
    """shift, scale = linear(silu(global)); x̂ = LayerNorm(x)·(1 + scale) + shift (key `linear`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
        """x `[N, P, D]` tokens of one latent frame each, glob `[N, D]` that frame's global token."""
        shift, scale = self.linear(F.silu(glob)).chunk(2, dim=-1)  # [N, D] each, shift first
        return F.layer_norm(x, x.shape[-1:], eps=ADAIN_EPS) * (1 + scale[:, None]) + shift[:, None]


class AudioInjector(nn.Module):
    """One cross-attention (`injector.j`) and one AdaLN (`injector_adain_layers.j`) per layer of
    `audio_inject_layers`; `inject(j, x, glob, loc)` adds injector j's output to x."""

    def __init__(self, dim: int, heads: int, count: int) -> None:
        super().__init__()
        self.injector = nn.ModuleList(CrossAttention(dim, heads, INJECTOR_EPS) for _ in range(count))
        self.injector_adain_layers = nn.ModuleList(AudioAdaLN(dim) for _ in range(count))

    def inject(self, j: int, x: torch.Tensor, glob: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        """x `[B, F, P, D]` noisy tokens, glob `[B, F, 1, D]`, loc `[B, F, A, D]` -> x + injection."""
        b, f, p, d = x.shape
        xh = self.injector_adain_layers[j](x.reshape(b * f, p, d), glob.reshape(b * f, d).to(x.dtype))
        y = self.injector[j](xh, loc.reshape(b * f, -1, d).to(x.dtype))  # [B·F, P, D]
        return x + y.view(b, f, p, d)
