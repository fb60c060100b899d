"""Layers of the LTX-Video 0.9 VAE (`models/ltx/vae.py`), named as diffusers names them on disk.

Every layer here takes `causal` at call time rather than at construction, because the official
model builds one kind of convolution and lets the caller choose the time padding: the encoder
always pads causally, the 0.9 decoder pads on both sides (`causal_decoder = False`).

Time padding **replicates the edge frames** (it does not pad with zeros): a causal conv with
temporal kernel k sees k-1 copies of the first frame before the sequence; a non-causal one sees
(k-1)/2 copies of the first frame before and of the last frame after it. Spatial padding is the
convolution's own (`padding_mode`, zeros in 0.9). Normalisation is PixelNorm (RMS over channels,
eps 1e-8, no gain), so nothing but the convolutions mixes positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PIXEL_NORM_EPS = 1e-8


def pixel_norm(x: torch.Tensor, eps: float = PIXEL_NORM_EPS) -> torch.Tensor:
    """x [B, C, T, H, W] divided by its RMS over channels (LTX `PixelNorm`, no learned gain)."""
    return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + eps)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, T, H·p, W·p] -> [B, C·p·p, T, H, W]; channel c·p² + r·p + q holds the pixel at row
    offset q, column offset r (LTX's order: column offset before row offset)."""
    if p == 1:
        return x
    b, c, t, hp, wp = x.shape
    x = x.reshape(b, c, t, hp // p, p, wp // p, p)  # [B, C, T, H, q, W, r]
    x = x.permute(0, 1, 6, 4, 2, 3, 5)  # [B, C, r, q, T, H, W]
    return x.reshape(b, c * p * p, t, hp // p, wp // p)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """The inverse of `patchify`: [B, C·p·p, T, H, W] -> [B, C, T, H·p, W·p]."""
    if p == 1:
        return x
    b, cpp, t, h, w = x.shape
    x = x.reshape(b, cpp // (p * p), p, p, t, h, w)  # [B, C, r, q, T, H, W]
    x = x.permute(0, 1, 4, 5, 3, 6, 2)  # [B, C, T, H, q, W, r]
    return x.reshape(b, cpp // (p * p), t, h * p, w * p)


def depth_to_space(x: torch.Tensor, s: int) -> torch.Tensor:
    """[B, C·s³, T, H, W] -> [B, C, T·s, H·s, W·s]: channel c·s³ + i·s² + j·s + k goes to time
    offset i, row offset j, column offset k."""
    b, cs, t, h, w = x.shape
    c = cs // s**3
    x = x.reshape(b, c, s, s, s, t, h, w)  # [B, C, s_t, s_h, s_w, T, H, W]
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4)  # [B, C, T, s_t, H, s_h, W, s_w]
    return x.reshape(b, c, t * s, h * s, w * s)


class TimePadConv3d(nn.Module):
    """A cubic 3-D convolution whose time padding replicates the edge frames (see module
    docstring); the weights live in `.conv` (diffusers' `LTXVideoCausalConv3d` layout)."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1,
                 padding_mode: str = "zeros") -> None:
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv3d(cin, cout, kernel, stride=stride, padding=(0, kernel // 2, kernel // 2),
                              padding_mode=padding_mode)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        k = self.kernel
        if k > 1:  # x [B, C, T, H, W] -> [B, C, T + k - 1, H, W]
            if causal:
                x = torch.cat((x[:, :, :1].repeat(1, 1, k - 1, 1, 1), x), dim=2)
            else:
                pad = (k - 1) // 2
                x = torch.cat((x[:, :, :1].repeat(1, 1, pad, 1, 1), x,
                               x[:, :, -1:].repeat(1, 1, pad, 1, 1)), dim=2)
        return self.conv(x)


class ResnetBlock(nn.Module):
    """PixelNorm → SiLU → conv1 → PixelNorm → SiLU → conv2, added to the input. When the width
    changes, the input first goes through `norm3` (LayerNorm over channels, affine) and a 1×1×1
    `conv_shortcut`: the block LTX calls `res_x_y`."""

    def __init__(self, cin: int, cout: int, eps: float, padding_mode: str) -> None:
        super().__init__()
        self.conv1 = TimePadConv3d(cin, cout, 3, padding_mode=padding_mode)
        self.conv2 = TimePadConv3d(cout, cout, 3, padding_mode=padding_mode)
        self.norm3: nn.LayerNorm | None = None
        self.conv_shortcut: TimePadConv3d | None = None
        if cin != cout:
            self.norm3 = nn.LayerNorm(cin, eps=eps, elementwise_affine=True)
            self.conv_shortcut = TimePadConv3d(cin, cout, 1)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        h = self.conv1(F.silu(pixel_norm(x)), causal)
        h = self.conv2(F.silu(pixel_norm(h)), causal)
        if self.norm3 is not None and self.conv_shortcut is not None:
            x = self.norm3(x.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)  # LayerNorm over C
            x = self.conv_shortcut(x, causal)
        return x + h


def run_resnets(resnets: nn.ModuleList, x: torch.Tensor, causal: bool) -> torch.Tensor:
    for block in resnets:
        x = block(x, causal)
    return x


class MidBlock(nn.Module):
    """`n` resnets at one width (LTX `res_x`; diffusers `mid_block`)."""

    def __init__(self, channels: int, n: int, eps: float, padding_mode: str) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(channels, channels, eps, padding_mode) for _ in range(n))

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        return run_resnets(self.resnets, x, causal)


class DownBlock(nn.Module):
    """Encoder stage: `n` resnets at `cin`, then (scale) a stride-2 conv that halves T, H and W
    (T -> ⌊(T-1)/2⌋ + 1 with causal padding), then (cout ≠ cin) a widening resnet `conv_out`."""

    def __init__(self, cin: int, cout: int, n: int, scale: bool, eps: float, padding_mode: str) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(cin, cin, eps, padding_mode) for _ in range(n))
        self.downsamplers = (nn.ModuleList([TimePadConv3d(cin, cin, 3, stride=2, padding_mode=padding_mode)])
                             if scale else None)
        self.conv_out = ResnetBlock(cin, cout, eps, padding_mode) if cout != cin else None

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        x = run_resnets(self.resnets, x, causal)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x, causal)
        if self.conv_out is not None:
            x = self.conv_out(x, causal)
        return x


class DepthToSpaceUpsample(nn.Module):
    """A conv to 8× the channels, depth-to-space 2×2×2, then the first frame dropped: T latent
    frames -> 2T - 1 (the first frame of a causal latent stands for one frame, not two)."""

    def __init__(self, channels: int, padding_mode: str) -> None:
        super().__init__()
        self.conv = TimePadConv3d(channels, 8 * channels, 3, padding_mode=padding_mode)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        x = depth_to_space(self.conv(x, causal), 2)  # [B, C, 2T, 2H, 2W]
        return x[:, :, 1:]


class UpBlock(nn.Module):
    """Decoder stage: (cout ≠ cin) a narrowing resnet `conv_in`, then (scale) a 2×2×2
    depth-to-space upsampler, then `n` resnets at `cout`."""

    def __init__(self, cin: int, cout: int, n: int, scale: bool, eps: float, padding_mode: str) -> None:
        super().__init__()
        self.conv_in = ResnetBlock(cin, cout, eps, padding_mode) if cout != cin else None
        self.upsamplers = nn.ModuleList([DepthToSpaceUpsample(cout, padding_mode)]) if scale else None
        self.resnets = nn.ModuleList(ResnetBlock(cout, cout, eps, padding_mode) for _ in range(n))

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        if self.conv_in is not None:
            x = self.conv_in(x, causal)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, causal)
        return run_resnets(self.resnets, x, causal)
