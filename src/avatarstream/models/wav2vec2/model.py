"""wav2vec 2.0 (Baevski et al., 2020), our port of the `transformers` `Wav2Vec2Model` forward.

The two audio encoders the real checkpoints use are two configs of this one network:

| | wav2vec2-base-960h (FlashHead) | wav2vec2-large-xlsr-53-english (LiveAvatar) |
|---|---|---|
| conv features | GroupNorm after conv 0 only, no conv bias | LayerNorm after every conv, conv bias |
| encoder | post-LN: LN(x + pos) first, LN after attention and after the FFN | pre-LN ("stable layer norm"): LN inside each residual branch, one LN after the last layer |
| size | 12 layers x 768, 12 heads, FFN 3072 | 24 layers x 1024, 16 heads, FFN 4096 |

Module and parameter names are those of the `transformers` checkpoints without the `wav2vec2.`
prefix (`feature_extractor.conv_layers.N.conv`, `encoder.layers.N.attention.q_proj`, ...), so a
state dict maps onto ours by a prefix strip and the weight-norm rename only
(`weights/wav2vec2.py`). The positional conv keeps its weight norm as the two stored tensors
`weight_g` [1, 1, K] and `weight_v` [C, C/groups, K] (norm over every dim but the kernel axis)
and recombines them on each forward, as `torch.nn.utils.parametrizations.weight_norm` does.

Hidden states (`forward` returns all L+1 of them, like `output_hidden_states=True`):
- post-LN: state 0 = LN(features + pos conv), state i = output of layer i-1;
- pre-LN: state 0 = features + pos conv, state i = output of layer i-1 for i < L, and the last
  state is `encoder.layer_norm` of the last layer's output, not its raw output (`transformers`
  4.x, which LiveAvatar pins; 5.x hands out the raw output there).

Attention is SDPA without a mask (one utterance per row, no padding), which is what
`from_pretrained` picks; `transformers`' eager attention differs from it by about 2e-6. Dropout,
layer drop and SpecAugment are training-only and absent: this is an inference port. Equivalence
with `transformers` is tested in tests/models/test_wav2vec2.py (both forms, random weights) and by
the golden fixtures (tests/parity/test_wav2vec2.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.errors import ConfigError
from avatarstream.models.attention import dense_attention


@dataclass(frozen=True)
class Wav2Vec2Config:
    """The `transformers` `Wav2Vec2Config` fields the forward reads, under the same names."""

    # CNN feature encoder: 320x down (16 kHz -> 50 Hz), 400-sample receptive field
    conv_dim: tuple[int, ...] = (512,) * 7
    conv_kernel: tuple[int, ...] = (10, 3, 3, 3, 3, 2, 2)
    conv_stride: tuple[int, ...] = (5, 2, 2, 2, 2, 2, 2)
    conv_bias: bool = False
    feat_extract_norm: str = "group"  # "group": GroupNorm after conv 0; "layer": LayerNorm after each conv
    # transformer encoder
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    do_stable_layer_norm: bool = False  # True: the pre-LN encoder of the large models
    num_conv_pos_embeddings: int = 128  # positional conv kernel
    num_conv_pos_embedding_groups: int = 16
    layer_norm_eps: float = 1e-5

    @classmethod
    def base(cls) -> Wav2Vec2Config:
        """facebook/wav2vec2-base-960h (FlashHead's encoder)."""
        return cls()

    @classmethod
    def large(cls) -> Wav2Vec2Config:
        """wav2vec2-large-xlsr-53-english (LiveAvatar's encoder)."""
        return cls(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                   conv_bias=True, feat_extract_norm="layer", do_stable_layer_norm=True)

    @classmethod
    def tiny(cls, *, stable: bool = False) -> Wav2Vec2Config:
        """A CPU-test size of either form (base-like, or large-like with `stable`)."""
        return cls(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                   conv_dim=(8,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                   conv_bias=stable, feat_extract_norm="layer" if stable else "group",
                   do_stable_layer_norm=stable)

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> Wav2Vec2Config:
        """A checkpoint's config.json (a `transformers` Wav2Vec2Config dict). Missing fields take
        `transformers`' defaults, which are ours; options this port does not implement are one
        ConfigError rather than silently different features."""
        unsupported = {"feat_extract_activation": "gelu", "hidden_act": "gelu", "add_adapter": False,
                       "use_weighted_layer_sum": False}
        for key, want in unsupported.items():
            if raw.get(key, want) != want:
                raise ConfigError(f"wav2vec2 config: {key}={raw[key]!r} is not supported (only {want!r})")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names}
        cfg = cls(**kw)
        n = raw.get("num_feat_extract_layers", len(cfg.conv_dim))
        if not n == len(cfg.conv_dim) == len(cfg.conv_kernel) == len(cfg.conv_stride):
            raise ConfigError(f"wav2vec2 config: {n} conv layers but conv_dim/kernel/stride have "
                              f"{len(cfg.conv_dim)}/{len(cfg.conv_kernel)}/{len(cfg.conv_stride)} entries")
        if cfg.feat_extract_norm not in ("group", "layer"):
            raise ConfigError(f"wav2vec2 config: feat_extract_norm {cfg.feat_extract_norm!r} is not "
                              "'group' or 'layer'")
        return cfg

    def frames(self, samples: int) -> int:
        """Frames the conv stack makes of `samples` samples (valid convs: 320x down, 400-sample field)."""
        n = samples
        for k, s in zip(self.conv_kernel, self.conv_stride):
            n = (n - k) // s + 1
        return max(n, 0)


def normalize_waveform(wave: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """`Wav2Vec2FeatureExtractor(do_normalize=True)`: (x − mean) / √(var + eps) over each whole
    clip (population variance). wave `[..., N]`. Because the statistics are the clip's, a feature
    depends on every sample of what is encoded together, not only on its neighbourhood."""
    mean = wave.mean(dim=-1, keepdim=True)
    var = (wave - mean).square().mean(dim=-1, keepdim=True)
    return (wave - mean) / torch.sqrt(var + eps)


def resample_frames(x: torch.Tensor, frames: int) -> torch.Tensor:
    """Linear interpolation in time with `align_corners=True` (first and last frames kept):
    `[B, T, C]` -> `[B, frames, C]`. Both official paths change frame rates this way."""
    return F.interpolate(x.transpose(1, 2), size=frames, mode="linear", align_corners=True).transpose(1, 2)


class _ConvLayer(nn.Module):
    """conv -> optional norm (GroupNorm with one group per channel, or LayerNorm over channels) -> GELU."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, bias: bool, norm: str | None) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, bias=bias)
        self.norm = norm
        if norm == "group":
            self.layer_norm: nn.Module = nn.GroupNorm(cout, cout, affine=True)
        elif norm == "layer":
            self.layer_norm = nn.LayerNorm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, Cin, N] -> [B, Cout, N']
        x = self.conv(x)
        if self.norm == "group":
            x = self.layer_norm(x)
        elif self.norm == "layer":
            x = self.layer_norm(x.transpose(1, 2)).transpose(1, 2)
        return F.gelu(x)


class _FeatureExtractor(nn.Module):
    def __init__(self, cfg: Wav2Vec2Config) -> None:
        super().__init__()
        cins = (1, *cfg.conv_dim[:-1])
        norms = [("group" if i == 0 else None) if cfg.feat_extract_norm == "group" else "layer"
                 for i in range(len(cfg.conv_dim))]
        self.conv_layers = nn.ModuleList(
            _ConvLayer(ci, co, k, s, cfg.conv_bias, nm)
            for ci, co, k, s, nm in zip(cins, cfg.conv_dim, cfg.conv_kernel, cfg.conv_stride, norms))

    def forward(self, wave: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, C, T]
        x = wave[:, None]
        for layer in self.conv_layers:
            x = layer(x)
        return x


class _FeatureProjection(nn.Module):
    def __init__(self, cfg: Wav2Vec2Config) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(cfg.conv_dim[-1], eps=cfg.layer_norm_eps)
        self.projection = nn.Linear(cfg.conv_dim[-1], cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, Cf] -> [B, T, C]
        return self.projection(self.layer_norm(x))


class _WeightNormConv(nn.Module):
    """The positional conv: grouped Conv1d whose weight is g·v/‖v‖ (norm over all dims but 2)."""

    def __init__(self, dim: int, kernel: int, groups: int) -> None:
        super().__init__()
        self.kernel, self.groups = kernel, groups
        self.weight_g = nn.Parameter(torch.empty(1, 1, kernel))
        self.weight_v = nn.Parameter(torch.empty(dim, dim // groups, kernel))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C, T + 1 - K % 2]
        w = torch._weight_norm(self.weight_v, self.weight_g, 2)
        return F.conv1d(x, w, self.bias, padding=self.kernel // 2, groups=self.groups)


class _PositionalConv(nn.Module):
    def __init__(self, cfg: Wav2Vec2Config) -> None:
        super().__init__()
        self.conv = _WeightNormConv(cfg.hidden_size, cfg.num_conv_pos_embeddings,
                                    cfg.num_conv_pos_embedding_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, C]
        t = x.shape[1]
        y = self.conv(x.transpose(1, 2))[:, :, :t]  # an even kernel makes one extra frame: drop it
        return F.gelu(y).transpose(1, 2)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, C]
        b, t, c = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, H, T, hd]
            return y.view(b, t, self.heads, c // self.heads).transpose(1, 2).contiguous()

        o = dense_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), None)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, c))


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.intermediate_dense = nn.Linear(dim, hidden)
        self.output_dense = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: Wav2Vec2Config) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.pre_norm = cfg.do_stable_layer_norm
        self.attention = _Attention(dim, cfg.num_attention_heads)
        self.layer_norm = nn.LayerNorm(dim, eps=eps)
        self.feed_forward = _FeedForward(dim, cfg.intermediate_size)
        self.final_layer_norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C]
        if self.pre_norm:
            x = x + self.attention(self.layer_norm(x))
            return x + self.feed_forward(self.final_layer_norm(x))
        x = self.layer_norm(x + self.attention(x))
        return self.final_layer_norm(x + self.feed_forward(x))


class _Encoder(nn.Module):
    def __init__(self, cfg: Wav2Vec2Config) -> None:
        super().__init__()
        self.pre_norm = cfg.do_stable_layer_norm
        self.pos_conv_embed = _PositionalConv(cfg)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:  # [B, T, C] -> L+1 x [B, T, C]
        x = x + self.pos_conv_embed(x)
        if not self.pre_norm:
            x = self.layer_norm(x)
        states = [x]
        for layer in self.layers:
            states.append(layer(states[-1]))
        if self.pre_norm:
            states[-1] = self.layer_norm(states[-1])
        return states


class Wav2Vec2(nn.Module):
    """Waveform -> the L+1 hidden states (`transformers`' `output_hidden_states=True`).

    `forward(input_values [B, N])` at the model's own 50 Hz (320x down); a caller that wants
    another frame rate (FlashHead: 25 fps) calls `conv_features`, resamples and then `encode`.
    Input is the *normalised* waveform (`normalize_waveform`)."""

    def __init__(self, cfg: Wav2Vec2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.feature_extractor = _FeatureExtractor(cfg)
        self.feature_projection = _FeatureProjection(cfg)
        self.encoder = _Encoder(cfg)

    def conv_features(self, input_values: torch.Tensor) -> torch.Tensor:
        """`[B, N]` -> CNN features `[B, T, conv_dim[-1]]`, T = cfg.frames(N)."""
        return self.feature_extractor(input_values).transpose(1, 2)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """CNN features `[B, T, conv_dim[-1]]` -> hidden states `[L+1, B, T, hidden]`."""
        return torch.stack(self.encoder(self.feature_projection(features)))

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:  # [B, N] -> [L+1, B, T, C]
        return self.encode(self.conv_features(input_values))
