"""Building blocks of the causal video VAE (`models/vae.py`): causal 3D convolutions with a
streaming cache, per-position RMS norm, resnets, per-frame attention, the spatial/temporal
resamplers with their parameter-free shortcuts, and the encoder/decoder levels.

Every layer with temporal state takes an optional `ConvCache` (`cache/conv.py`) and keeps its last
input frames under its module name (`cache_key`, set by `CausalVAE`), so a stream processed chunk
by chunk gives the whole sequence's numbers. Shapes are `[B, C, T, H, W]` throughout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.cache.conv import ConvCache

def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           stride: tuple[int, int, int], padding: tuple[int, int, int]) -> torch.Tensor:
    """F.conv3d, forcing oneDNN for fp32 CPU inference.

    PyTorch's CPU backend picks the im2col path (`slow_conv3d`) for batch-1 inputs whose
    N·C·T·H ≤ 20480 — exactly the size of a streaming chunk — which is ≈ 10× slower here and
    allocates a Cin·k³·T·H·W column buffer (≈ 60 MB for 16 channels, 35 frames at 32×32) that
    would dominate a chunk's peak memory. Results agree with F.conv3d to float rounding.
    Under autocast, with gradients, off the CPU, or while torch.compile / torch.export trace it
    (`torch.compiler.is_compiling`: the compiler picks its own convolution kernels, and an
    exported graph needs the portable op): plain F.conv3d.

    A 1×1×1 kernel (stride 1, no padding) is a matrix product over the channels, run as one
    (`baddbmm`, on any device, under autocast and with gradients too; not while compiling): the
    same sums, ≈ 1.8x faster than the convolution on the decoder's last level (16 -> 12 channels
    over 24 frames of 128², 4.2 against 7.5 ms in bf16, one thread).
    """
    if (not torch.compiler.is_compiling() and weight.shape[2:] == (1, 1, 1) and tuple(stride) == (1, 1, 1)
            and tuple(padding) == (0, 0, 0)):
        b, c = x.shape[:2]
        co = weight.shape[0]
        w = weight.reshape(1, co, c).expand(b, co, c)
        y = (torch.bmm(w, x.reshape(b, c, -1)) if bias is None
             else torch.baddbmm(bias.reshape(1, co, 1).expand(b, co, 1), w, x.reshape(b, c, -1)))
        return y.view(b, co, *x.shape[2:])
    if (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and not torch.is_autocast_enabled("cpu")
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.mkldnn_convolution(x.contiguous(), weight, bias, padding, stride,
                                        (1, 1, 1), 1)
    return F.conv3d(x, weight, bias, stride, padding)


class CausalConv3d(nn.Conv3d):
    """Conv3d, causal in time: zero left padding of k_t - 1 frames (no right padding), symmetric
    spatial padding. x [B, Cin, T, H, W] -> [B, Cout, T, H', W'].

    With a cache, the left padding is the last k_t - 1 input frames of the previous chunk (zeros
    before the first chunk) and the cache is updated with this chunk's last k_t - 1 input frames.
    """

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int, int] = 3) -> None:
        k = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        super().__init__(cin, cout, k, padding=(0, k[1] // 2, k[2] // 2))
        self.cache_key = ""  # set to the module name by CausalVAE

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        kt = self.kernel_size[0]
        if kt > 1:
            if cache is None:
                x = F.pad(x, (0, 0, 0, 0, kt - 1, 0))
            else:
                prev = cache.get(self.cache_key)
                if prev is None:
                    b, c, _, h, w = x.shape
                    prev = x.new_zeros(b, c, kt - 1, h, w)
                x = torch.cat([prev.to(x.dtype), x], dim=2)
                cache.put(self.cache_key, x[:, :, -(kt - 1):])
        return conv3d(x, self.weight, self.bias, self.stride, self.padding)


class RMSNorm(nn.Module):
    """Per-position RMS norm over channels (no mixing across time or space).
    x [B, C, T, H, W] -> same shape.

    `F.normalize(x, dim=1)`'s arithmetic, x / max(‖x‖, eps) · √C, with the norm written as
    √(Σx²) over channels: the library's norm kernel over a non-innermost dim was 1.3-2.5x slower in
    fp32 and up to 7x in bf16 on decoder shapes (the norms were 15-24 % of a decode chunk); the two
    differ by float rounding (≤ 2e-7 relative in fp32). gamma and bias: one fused multiply-add in
    fp32; in bf16 a multiply then an add (bf16 `addcmul` with per-channel operands is 3-4x slower
    than the two: 15.5 against 4 ms on [1, 16, 24, 128, 128], one thread), which rounds y·gamma
    once more (≤ 1 bf16 ulp of max(|y·gamma|, |result|))."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.scale = channels ** 0.5
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = x * (self.scale / x.square().sum(1, keepdim=True).sqrt().clamp_min(self.eps))
        gamma, bias = self.gamma.view(shape).to(y.dtype), self.bias.view(shape).to(y.dtype)
        if y.dtype == torch.float32:
            return torch.addcmul(bias, y, gamma)
        return y * gamma + bias


def pixel_shuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    """`F.pixel_shuffle(x, r)` ([N, C·r², H, W] -> [N, C, r·H, r·W]) as a reshape, a permute and
    one copy: the same values, ≈ 3.5x faster than the library kernel on the decoder's shapes
    (4.2 against 15.3 ms for [24, 64, 64, 64] bf16, one thread)."""
    n, crr, h, w = x.shape
    c = crr // (r * r)
    return x.reshape(n, c, r, r, h, w).permute(0, 1, 4, 2, 5, 3).reshape(n, c, h * r, w * r)


def per_frame(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a 2D op to every frame: x [B, C, T, H, W] -> fn([B*T, C, H, W]) -> [B, C', T, H', W']."""
    b, c, t, h, w = x.shape
    y = fn(x.transpose(1, 2).reshape(b * t, c, h, w))
    return y.reshape(b, t, *y.shape[1:]).transpose(1, 2)


class ResnetBlock(nn.Module):
    """norm-SiLU-causal conv ×2 plus a (1×1×1 conv) shortcut. x [B, cin, T, H, W] -> [B, cout, T, H, W]."""

    def __init__(self, cin: int, cout: int, eps: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cin, eps)
        self.conv1 = CausalConv3d(cin, cout, 3)
        self.norm2 = RMSNorm(cout, eps)
        self.conv2 = CausalConv3d(cout, cout, 3)
        self.conv_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)), cache)
        h = self.conv2(F.silu(self.norm2(h)), cache)
        return h + (self.conv_shortcut(x) if self.conv_shortcut is not None else x)


class FrameAttention(nn.Module):
    """Single-head spatial self-attention inside each frame (never across frames).
    x [B, C, T, H, W] -> same shape (residual)."""

    def __init__(self, channels: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(channels, eps)
        self.to_qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def attend(f: torch.Tensor) -> torch.Tensor:  # f [N, C, H, W]
            n, c, h, w = f.shape
            # contiguous [N, HW, C] each: SDPA takes its fused (flash) CPU kernel only when the
            # last dimension has stride 1, else the math path (3x slower here, N x HW x HW scores)
            q, k, v = self.to_qkv(f).reshape(n, 3, c, h * w).transpose(2, 3).contiguous().unbind(1)
            o = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
            return self.proj(o.transpose(1, 2).reshape(n, c, h, w))

        return x + per_frame(attend, self.norm(x))


class MidBlock(nn.Module):
    """resnet, (frame attention), resnet at constant width. x [B, C, T, h, w] -> same shape."""

    def __init__(self, channels: int, attention: bool, eps: float) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, eps) for _ in range(2)])
        self.attentions = nn.ModuleList([FrameAttention(channels, eps)] if attention else [])

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x, cache)


def fold_down(x: torch.Tensor, cout: int) -> torch.Tensor:
    """Spatial shortcut of a downsampler: x [N, C, H, W] -> pixel unshuffle ×2 -> [N, 4C, H/2, W/2]
    -> mean over groups of 4C/cout consecutive channels -> [N, cout, H/2, W/2]."""
    y = F.pixel_unshuffle(x, 2)
    n, c, h, w = y.shape
    return y.reshape(n, cout, c // cout, h, w).mean(dim=2)


# Nearest ×2 upsampling then a 3×3 conv (padding 1), computed on the small picture: output pixel
# (2i + a, 2j + b) sees input rows i-1, i, i (a = 0) or i, i, i+1 (a = 1), so its taps fold into a
# 3×3 kernel over the input per phase (a, b). _PHASE[a] maps the conv's 3 kernel rows to the input
# offsets -1, 0, +1.
_PHASE = ((1.0, 0.0, 0.0), (0.0, 1.0, 1.0), (0.0, 0.0, 0.0)), ((0.0, 0.0, 0.0), (1.0, 1.0, 0.0), (0.0, 0.0, 1.0))


def subpixel_weights(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """conv2d(nearest×2(x), weight, bias, padding=1) == pixel_shuffle(conv2d(x, W4, b4, padding=1), 2)
    for (W4, b4) = subpixel_weights(weight, bias): weight [cout, cin, 3, 3] -> W4 [4·cout, cin, 3, 3]
    (channel 4o + 2a + b: output channel o at phase (a, b), pixel_shuffle's order). The same sums
    in another order (float rounding), on a quarter of the pixels, without the upsampled copy."""
    r = torch.tensor(_PHASE, dtype=weight.dtype, device=weight.device)  # [2, 3, 3]
    w4 = torch.einsum("aik,ockl,bjl->oabcij", r, weight, r)  # [cout, 2, 2, cin, 3, 3]
    cout, cin = weight.shape[:2]
    return w4.reshape(4 * cout, cin, 3, 3), None if bias is None else bias.repeat_interleave(4)


def channel_mean(x: torch.Tensor, cout: int) -> torch.Tensor:
    """[B, C, ...] -> [B, cout, ...]: mean over groups of C/cout consecutive channels."""
    return x.reshape(x.shape[0], cout, x.shape[1] // cout, *x.shape[2:]).mean(dim=2)


class Downsample(nn.Module):
    """Spatial stride-2 conv per frame, then (temporal) first frame alone + conv k=3, stride 2.

    x [B, cin, T, H, W] -> [B, cout, T', H/2, W/2] with T' = T (spatial only), T' = 1 + (T-1)/2 for
    the first chunk of a stream / the whole sequence (T odd), T' = T/2 for later chunks (T even).
    The cache keeps the last input frame of the time conv.
    """

    def __init__(self, cin: int, cout: int, temporal: bool, shortcut: bool = False) -> None:
        super().__init__()
        self.shortcut = shortcut
        if shortcut and (4 * cin) % cout:
            raise ValueError(f"a downsampler shortcut needs cout | 4·cin (got {cin} -> {cout})")
        self.resample = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
        self.time_conv = nn.Conv3d(cout, cout, (3, 1, 1), stride=(2, 1, 1)) if temporal else None
        self.cache_key = ""

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        cout = self.resample.out_channels
        if self.shortcut:
            x = per_frame(lambda f: self.resample(f) + fold_down(f, cout), x)
        else:
            x = per_frame(self.resample, x)
        if self.time_conv is None:
            return x
        prev = cache.get(self.cache_key) if cache is not None else None
        first = prev is None
        if first:
            if x.shape[2] % 2 != 1:
                raise ValueError(f"the first chunk needs an odd number of frames at this level "
                                 f"(1+4k video frames), got {x.shape[2]}")
            xin = x
        else:
            if x.shape[2] % 2 != 0:
                raise ValueError(f"later chunks need an even number of frames at this level "
                                 f"(4k video frames), got {x.shape[2]}")
            xin = torch.cat([prev.to(x.dtype), x], dim=2)
        if cache is not None:
            cache.put(self.cache_key, x[:, :, -1:])
        tc = self.time_conv
        y = (conv3d(xin, tc.weight, tc.bias, tc.stride, tc.padding) if xin.shape[2] >= 3
             else xin[:, :, :0])
        if self.shortcut and y.shape[2]:
            # output frame j covers the two new input frames of its window (x_{2j+1}, x_{2j+2})
            y = y + 0.5 * (xin[:, :, 1::2][:, :, :y.shape[2]] + xin[:, :, 2::2][:, :, :y.shape[2]])
        return torch.cat([x[:, :, :1], y], dim=2) if first else y


class Upsample(nn.Module):
    """(Temporal) causal conv k=3 to 2·cin channels, each frame -> 2 frames, the first frame of the
    stream alone; then nearest ×2 + 3×3 conv per frame.

    x [B, cin, T, h, w] -> [B, cout, T', 2h, 2w] with T' = T (spatial only), 1 + 2(T-1) on the first
    chunk of a stream / the whole sequence, 2T on later chunks.
    """

    def __init__(self, cin: int, cout: int, temporal: bool, shortcut: bool = False) -> None:
        super().__init__()
        self.shortcut = shortcut
        if shortcut and (4 * cout) % cin:
            raise ValueError(f"an upsampler shortcut needs cin | 4·cout (got {cin} -> {cout})")
        self.time_conv = CausalConv3d(cin, 2 * cin, (3, 1, 1)) if temporal else None
        self.resample = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        if self.time_conv is not None:
            first = cache is None or not cache.has(self.time_conv.cache_key)
            b, c, t, h, w = x.shape
            y = self.time_conv(x, cache)  # [B, 2C, T, h, w]
            y = y.reshape(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
            if self.shortcut:
                y = y + x.repeat_interleave(2, dim=2)  # each frame's two frames start as copies
            x = torch.cat([x[:, :, :1], y[:, :, 2:]], dim=2) if first else y
        cout = self.resample.out_channels
        w4, b4 = subpixel_weights(self.resample.weight, self.resample.bias)

        def up(f: torch.Tensor) -> torch.Tensor:  # = resample(nearest ×2 (f)) [+ shortcut]
            y = F.conv2d(f, w4.to(f.dtype), None if b4 is None else b4.to(f.dtype), padding=1)
            if self.shortcut:  # channels repeated to 4·cout, unfolded to 2×2 by the shuffle below
                y = y + f.repeat_interleave(4 * cout // f.shape[1], dim=1)
            return pixel_shuffle(y, 2)

        return per_frame(up, x)


class Head(nn.Module):
    """norm, SiLU, causal 3×3×3 conv (+ with `skip`, a 1×1×1 conv of the un-normalised input:
    the per-position norm keeps only each feature vector's direction, and the decoder's output
    pixels should not have to be rebuilt from directions alone). x [B, cin, T, H, W] ->
    [B, cout, T, H, W]."""

    def __init__(self, cin: int, cout: int, eps: float, skip: bool = False) -> None:
        super().__init__()
        self.norm = RMSNorm(cin, eps)
        self.conv = CausalConv3d(cin, cout, 3)
        self.skip = CausalConv3d(cin, cout, 1) if skip else None

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        out = self.conv(F.silu(self.norm(x)), cache)
        return out if self.skip is None else out + self.skip(x, cache)


class ResnetLevel(nn.Module):
    """One level of the encoder or the decoder: `n_res` resnets (the first cin -> cout), then the
    level's resampler, if any. x [B, cin, T, H, W] -> [B, cout, T', H', W'] (the resampler's).

    The resampler is stored under `resampler_name` ("downsampler" in the encoder, "upsampler" in
    the decoder), so one class keeps the diffusers/Wan parameter names of both
    (`down_blocks.{i}.downsampler.*`, `up_blocks.{i}.upsampler.*`) and every checkpoint loads."""

    def __init__(self, cin: int, cout: int, n_res: int, eps: float, resampler: nn.Module | None,
                 resampler_name: str) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(cin if i == 0 else cout, cout, eps) for i in range(n_res)])
        self.resampler_name = resampler_name
        setattr(self, resampler_name, resampler)

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        for r in self.resnets:
            x = r(x, cache)
        resampler = getattr(self, self.resampler_name)
        return x if resampler is None else resampler(x, cache)
