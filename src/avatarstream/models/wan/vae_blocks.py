"""Layers of the Wan2.1 VAE (`models/wan/vae.py`), laid out so the official state dict loads as is.

The official module names are list positions (`residual.0.gamma`, `residual.2.weight`,
`downsamples.5.time_conv`, `head.2`), so the layers that carry them are `Chain`s: an
`nn.Sequential` whose forward hands the streaming cache to the layers that keep temporal state.
Shapes are `[B, C, T, H, W]` throughout; per-frame 2D layers see `[B·T, C, H, W]`.

Temporal state lives in our `ConvCache` (`cache/conv.py`), keyed by module name, which fits the
official "2-frame cache" exactly: a causal conv with temporal kernel 3 keeps its last two input
frames (zeros before the stream starts, as the official zero padding), a temporal downsampler its
last frame. The one irregular rule, the temporal upsampler's first frame, is spelled out in
`Upsample`. The causal convolution itself is our `models/vae_blocks.CausalConv3d`: zero left
padding of k_t − 1 frames, symmetric spatial padding k // 2, which is what every Wan
`CausalConv3d` is (kernels 1, 3 and 3×1×1 with the official paddings 0, 1 and (1, 0, 0)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.cache.conv import ConvCache
from avatarstream.models.vae_blocks import CausalConv3d, conv3d, per_frame


class Streaming(nn.Module):
    """A layer whose forward is `(x, cache)`: it keeps temporal state in a `ConvCache`."""


def _streams(layer: nn.Module) -> bool:
    return isinstance(layer, (CausalConv3d, Streaming))


class Chain(nn.Sequential, Streaming):
    """`nn.Sequential` (the official key positions) that passes the cache to the layers with state."""

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        for layer in self:
            x = layer(x, cache) if _streams(layer) else layer(x)
        return x


class RMSNorm(nn.Module):
    """Wan's `RMS_norm`: each position's channel vector scaled to norm √C, times `gamma`.

    `F.normalize`'s arithmetic with its default eps (1e-12), no bias: x / max(‖x‖, eps), in the
    official order, except that the norm is √(Σx²) over channels rather than `vector_norm`, whose
    CPU kernel over a non-innermost dim was 7-25x slower on decoder shapes (40 % of a tiny
    FlashHead chunk); the two differ by float rounding (≤ 1.2e-7 relative).
    gamma is `[C, 1, 1, 1]` for video `[B, C, T, H, W]` and `[C, 1, 1]` for frames `[N, C, H, W]`
    (the checkpoint's shapes, so it loads without reshapes). Nothing mixes positions."""

    def __init__(self, dim: int, video: bool = True) -> None:
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim, *(1,) * (3 if video else 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.square().sum(1, keepdim=True).sqrt().clamp_min(1e-12) * self.scale * self.gamma


class ResidualBlock(Streaming):
    """norm, SiLU, causal 3×3×3 conv, norm, SiLU, dropout, causal 3×3×3 conv, plus the input (a
    1×1×1 conv where the width changes). x [B, cin, T, H, W] -> [B, cout, T, H, W]."""

    def __init__(self, cin: int, cout: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.residual = Chain(RMSNorm(cin), nn.SiLU(), CausalConv3d(cin, cout, 3),
                              RMSNorm(cout), nn.SiLU(), nn.Dropout(dropout), CausalConv3d(cout, cout, 3))
        self.shortcut = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        return self.residual(x, cache) + self.shortcut(x)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (never across frames, so it needs
    no state to stream), plus the input. x [B, C, T, H, W] -> same shape."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, video=False)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def attend(self, f: torch.Tensor) -> torch.Tensor:
        """One batch of frames f [N, C, H, W] -> the attention branch [N, C, H, W]."""
        n, c, h, w = f.shape
        qkv = self.to_qkv(self.norm(f)).reshape(n, 1, 3 * c, h * w)  # [N, 1, 3C, HW]
        q, k, v = qkv.transpose(2, 3).contiguous().chunk(3, dim=-1)  # each [N, 1, HW, C]
        o = F.scaled_dot_product_attention(q, k, v)  # [N, 1, HW, C]
        return self.proj(o[:, 0].transpose(1, 2).reshape(n, c, h, w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return per_frame(self.attend, x) + x


class Upsample(Streaming):
    """×2 in space (nearest, then a 3×3 conv to dim/2 channels, per frame), and with `temporal`
    ×2 in time first. x [B, dim, T, h, w] -> [B, dim/2, T', 2h, 2w].

    **Temporal rule (the official `upsample3d`).** A causal conv (kernel 3×1×1) makes 2·dim
    channels and each frame becomes two (channels [:dim] first, [dim:] second). The stream's very
    first frame is the exception: it passes through alone, undoubled, and it is *not* part of the
    time conv's history, which starts with zeros at the second frame. So T' = 1 + 2(T − 1) for the
    whole sequence or a stream's first chunk, 2T for later chunks. With a cache, the time conv keeps
    its last two input frames; after a first chunk of one frame that is two zero frames, which also
    records that the stream has started.
    """

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                      nn.Conv2d(dim, dim // 2, 3, padding=1))
        self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1)) if temporal else None

    def double_frames(self, x: torch.Tensor, cache: ConvCache | None) -> torch.Tensor:
        """x [B, C, T, h, w] -> [B, C, 1 + 2(T-1) or 2T, h, w] (see the class docstring)."""
        tc = self.time_conv
        first = cache is None or not cache.has(tc.cache_key)
        b, c, _, h, w = x.shape
        rest = x[:, :, 1:] if first else x  # the frames that are doubled
        if rest.shape[2] == 0:  # a first chunk of one frame: the history is still all zeros
            if cache is not None:
                cache.put(tc.cache_key, x.new_zeros(b, c, tc.kernel_size[0] - 1, h, w))
            return x
        y = tc(rest, cache)  # [B, 2C, t, h, w]
        t = y.shape[2]
        y = y.reshape(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        return torch.cat([x[:, :, :1], y], dim=2) if first else y

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        if self.time_conv is not None:
            x = self.double_frames(x, cache)
        return per_frame(self.resample, x)


class Downsample(Streaming):
    """/2 in space (zero pad right and bottom by one, 3×3 conv, stride 2, per frame), and with
    `temporal` /2 in time after it. x [B, dim, T, H, W] -> [B, dim, T', H/2, W/2].

    **Temporal rule (the official `downsample3d`).** The stream's first frame passes alone; then a
    conv with kernel 3×1×1, stride 2 and no padding runs over the windows (x0, x1, x2),
    (x2, x3, x4), ...: T' = 1 + (T − 1)/2 for the whole sequence or a first chunk (T odd), T/2 for
    later chunks (T even), whose windows start at the previous chunk's last frame (the cache).
    """

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        self.time_conv = nn.Conv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None
        self.cache_key = ""  # the module name, set by WanVAE

    def halve_frames(self, x: torch.Tensor, cache: ConvCache | None) -> torch.Tensor:
        """x [B, C, T, h, w] -> [B, C, 1 + (T-1)/2 or T/2, h, w] (see the class docstring)."""
        prev = None if cache is None else cache.get(self.cache_key)
        if (x.shape[2] % 2 == 0) == (prev is None):
            raise ValueError(f"a {'first' if prev is None else 'later'} chunk needs an "
                             f"{'odd' if prev is None else 'even'} number of frames at this level "
                             f"(1+4k video frames first, 4k after), got {x.shape[2]}")
        if cache is not None:
            cache.put(self.cache_key, x[:, :, -1:])
        windows = x if prev is None else torch.cat([prev.to(x.dtype), x], dim=2)
        tc = self.time_conv
        y = (conv3d(windows, tc.weight, tc.bias, tc.stride, tc.padding) if windows.shape[2] >= 3
             else windows[:, :, :0])  # [B, C, (n-1)/2, h, w]
        return torch.cat([x[:, :, :1], y], dim=2) if prev is None else y

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        x = per_frame(self.resample, x)
        return x if self.time_conv is None else self.halve_frames(x, cache)


def middle(dim: int, dropout: float) -> Chain:
    """The mid block of encoder and decoder: resnet, attention, resnet at constant width."""
    return Chain(ResidualBlock(dim, dim, dropout), AttentionBlock(dim), ResidualBlock(dim, dim, dropout))


def head(cin: int, cout: int) -> Chain:
    """The output block of encoder and decoder: norm, SiLU, causal 3×3×3 conv."""
    return Chain(RMSNorm(cin), nn.SiLU(), CausalConv3d(cin, cout, 3))
