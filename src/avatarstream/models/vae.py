"""Causal video VAE (Wan family layout): ×8 spatial, ×4 temporal compression, first frame alone.

Shapes (Wan convention, pixels in [-1, 1]):

    encode(video [B, 3, 1+4k, H, W]) -> (mean, logvar), each [B, z, 1+k, H/8, W/8]
    decode(z [B, z, T, h, w])        -> video [B, 3, 1+4(T-1), 8h, 8w] in [-1, 1]

Latent frame 0 covers video frame 0 alone; latent frame j ≥ 1 covers video frames 4j-3 .. 4j.

Design choices (documented contract):

- **Causal 3D convolutions, zero left padding in time.** A conv with temporal kernel k sees the
  current frame and the k-1 previous ones; before the first frame it sees zeros (not replicated
  frames: zero padding needs no knowledge of the first frame, so the whole-sequence and the
  streaming computations share one rule). Spatial padding is symmetric zero padding.
- **Normalisation is per position** (RMS over channels, as in Wan), never over time, so nothing
  mixes frames except the causal convolutions and the temporal resamplers.
- **Temporal downsampler** (encoder, after a per-frame spatial stride-2 conv): the first frame
  passes alone; then a conv with temporal kernel 3, stride 2, no padding over the frames
  (x0, x1, x2), (x2, x3, x4), ...: 1+2n frames -> 1+n.
- **Temporal upsampler** (decoder, before the per-frame nearest ×2 + conv): a causal conv
  (kernel 3) doubles the channels and each frame becomes two; the first frame of the stream is
  passed through alone: T frames -> 1+2(T-1). Twice: T latent frames -> 1+4(T-1) video frames.
- **Pixel patch** (optional, `patch_size` 2 in `small()`, as in Wan 2.2): pixels are folded
  2×2 into channels before the encoder and unfolded after the decoder, per frame.
- **Mid block** = resnet, per-frame spatial self-attention, resnet (attention never crosses
  frames, so it is causal and streams without state).
- **Output range**: `decode`/`decode_step` clamp to [-1, 1] (`clamp=False` returns the raw
  decoder output, which is what a reconstruction loss should see: clamping kills gradients of
  saturated pixels, a tanh would squash the targets ±1 to infinite pre-activations).
- **KL latent**: `quant_conv` maps the encoder output to 2z channels = (mean, logvar), logvar
  clamped to [-30, 20]; `post_quant_conv` (1×1×1) precedes the decoder.

Streaming (`new_cache`, `decode_step`, `encode_step`): every layer with temporal state keeps its
last input frames in a `ConvCache` (`cache/conv.py`) keyed by its module name, so processing a
stream chunk by chunk gives the same numbers as the whole sequence (≤ 1e-4 in fp32) for any chunk
sizes, and a chunk's memory is set by the chunk alone. A cache serves one direction of one
stream: use one cache to decode and another to encode.

Parameter names follow the diffusers/Wan VAE layout where it costs nothing: `encoder.conv_in`,
`encoder.down_blocks.{i}.resnets.{j}.{norm1,conv1,norm2,conv2,conv_shortcut}`,
`encoder.down_blocks.{i}.downsampler.{resample,time_conv}`, `encoder.mid_block.{resnets,attentions}`,
`encoder.head.{norm,conv}`, `quant_conv`, `post_quant_conv`, `decoder.conv_in`, `decoder.mid_block`,
`decoder.up_blocks.{i}.{resnets,upsampler}`, `decoder.head`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.cache.conv import ConvCache

LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0


@dataclass(frozen=True)
class VAEConfig:
    """Sizes of the causal VAE.

    patch_size p: pixels are folded p×p into channels before the encoder (pixel unshuffle,
    3·p² channels) and unfolded after the decoder (pixel shuffle), as in the Wan 2.2 VAE; the
    convolution stack then runs at most at 1/p resolution, which is what makes a CPU decode at
    256×256 affordable. channels[i] is the width at level i (level 0 = 1/p resolution, each
    level halves H and W; p · 2^(L-1) = 8); res_blocks[i] the number of resnets at level i
    (encoder and decoder alike); temporal_down[i] whether the resampler between level i and i+1
    also halves (encoder) / doubles (decoder) time. Exactly two resamplers are temporal: ×4.
    """

    z_channels: int = 4
    channels: tuple[int, ...] = (16, 16, 32, 32)
    res_blocks: tuple[int, ...] = (1, 1, 1, 1)
    temporal_down: tuple[bool, ...] = (False, True, True)
    patch_size: int = 1
    mid_attention: bool = True
    eps: float = 1e-6
    # parameter-free residual shortcuts around every resampler and the latent bottleneck
    # (space/time folded into channels and averaged down; channels duplicated and unfolded up),
    # as in DC-AE and the Wan 2.2 VAE: the convolutions learn a residual over a path that
    # already carries the low frequencies (see `_fold_down` and `Upsample`)
    shortcuts: bool = False

    def __post_init__(self) -> None:
        n = len(self.channels)
        if len(self.res_blocks) != n or len(self.temporal_down) != n - 1:
            raise ValueError("VAEConfig: channels and res_blocks need one entry per level, "
                             "temporal_down one per resampler (levels - 1)")
        if self.patch_size * 2 ** (n - 1) != 8:
            raise ValueError(f"patch_size · 2^(levels-1) must be 8 (×8 spatial), got "
                             f"{self.patch_size} · 2^{n - 1}")
        if sum(self.temporal_down) != 2:
            raise ValueError("exactly two temporal resamplers (×4 in time) are supported")

    @property
    def levels(self) -> int:
        return len(self.channels)

    @staticmethod
    def tiny() -> "VAEConfig":
        """z = 4, pixel patch 2, widths 16/16/32 at 1/2, 1/4, 1/8 resolution, one resnet per
        level: for 64×64 test video. Decode cost ≈ 0.055 GFLOP per output frame at 64×64
        (the same widths without the patch, (16, 16, 32, 32) over 4 levels: ≈ 0.21 GFLOP)."""
        return VAEConfig(z_channels=4, channels=(16, 16, 32), res_blocks=(1, 1, 1),
                         temporal_down=(True, True), patch_size=2, shortcuts=True)

    @staticmethod
    def small() -> "VAEConfig":
        """z = 16, pixel patch 2 (Wan 2.2 style), widths 16/32/64 at 1/2, 1/4, 1/8 resolution,
        one resnet per level except the 1/2 level (res_blocks (0, 1, 1)).

        Decode cost at 256×256 (latent 32×32): ≈ 1.1 GFLOP per output frame (convolution and
        attention multiply-adds ×2, `decode_flops_per_frame`), ≈ 28 GFLOP/s at 25 fps. Measured
        on a shared 2-core AVX512 CPU (chunks of 8 latent frames): ≈ 65 fps fp32, ≈ 115 fps under
        bf16 autocast, i.e. decoding at 25 fps takes ≈ 40 % (fp32) / ≈ 20 % (bf16) of the two
        cores. For scale: without the
        patch, widths 32/64/64/128 cost ≈ 21.6 GFLOP per frame (≈ 540 GFLOP/s at 25 fps), several
        times what the whole CPU delivers; thin full-resolution convolutions are memory-bound on
        a CPU, which is why the patch (no convolution at full resolution) matters more than the
        FLOP count suggests.
        """
        return VAEConfig(z_channels=16, channels=(16, 32, 64), res_blocks=(0, 1, 1),
                         temporal_down=(True, True), patch_size=2, shortcuts=True)


# -- layers -----------------------------------------------------------------------------------------
def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           stride: tuple[int, int, int], padding: tuple[int, int, int]) -> torch.Tensor:
    """F.conv3d, forcing oneDNN for fp32 CPU inference.

    PyTorch's CPU backend picks the im2col path (`slow_conv3d`) for batch-1 inputs whose
    N·C·T·H ≤ 20480 — exactly the size of a streaming chunk — which is ≈ 10× slower here and
    allocates a Cin·k³·T·H·W column buffer (≈ 60 MB for 16 channels, 35 frames at 32×32) that
    would dominate a chunk's peak memory. Results agree with F.conv3d to float rounding.
    Under autocast, with gradients, or off the CPU: plain F.conv3d.
    """
    if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
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
    x [B, C, T, H, W] -> same shape."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.scale = channels ** 0.5
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = F.normalize(x, dim=1, eps=self.eps) * self.scale
        return y * self.gamma.view(shape).to(y.dtype) + self.bias.view(shape).to(y.dtype)


def _per_frame(fn, x: torch.Tensor) -> torch.Tensor:
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
            q, k, v = self.to_qkv(f).reshape(n, 3, c, h * w).transpose(2, 3).unbind(1)  # [N, HW, C]
            o = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
            return self.proj(o.transpose(1, 2).reshape(n, c, h, w))

        return x + _per_frame(attend, self.norm(x))


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


def _fold_down(x: torch.Tensor, cout: int) -> torch.Tensor:
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


def _channel_mean(x: torch.Tensor, cout: int) -> torch.Tensor:
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
        self.temporal = temporal
        self.shortcut = shortcut
        if shortcut and (4 * cin) % cout:
            raise ValueError(f"a downsampler shortcut needs cout | 4·cin (got {cin} -> {cout})")
        self.resample = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
        self.time_conv = nn.Conv3d(cout, cout, (3, 1, 1), stride=(2, 1, 1)) if temporal else None
        self.cache_key = ""

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        cout = self.resample.out_channels
        if self.shortcut:
            x = _per_frame(lambda f: self.resample(f) + _fold_down(f, cout), x)
        else:
            x = _per_frame(self.resample, x)
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
        self.temporal = temporal
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
            return F.pixel_shuffle(y, 2)

        return _per_frame(up, x)


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


class DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n_res: int, down: Downsample | None, eps: float) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(cin if i == 0 else cout, cout, eps)
                                      for i in range(n_res)])
        self.downsampler = down

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        for r in self.resnets:
            x = r(x, cache)
        return self.downsampler(x, cache) if self.downsampler is not None else x


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n_res: int, up: Upsample | None, eps: float) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(cin if i == 0 else cout, cout, eps)
                                      for i in range(n_res)])
        self.upsampler = up

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        for r in self.resnets:
            x = r(x, cache)
        return self.upsampler(x, cache) if self.upsampler is not None else x


class Encoder(nn.Module):
    """video [B, 3, 1+4k, H, W] -> [B, 2z, 1+k, H/8, W/8] (before quant_conv)."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        ch, eps, n = cfg.channels, cfg.eps, cfg.levels
        self.patch_size = cfg.patch_size
        self.shortcuts = cfg.shortcuts
        self.conv_in = CausalConv3d(3 * cfg.patch_size ** 2, ch[0], 3)
        blocks, cin = [], ch[0]
        for i in range(n):
            down = Downsample(ch[i], ch[i], cfg.temporal_down[i], cfg.shortcuts) if i < n - 1 else None
            n_res = cfg.res_blocks[i]
            if n_res == 0 and cin != ch[i]:
                raise ValueError("a level without resnets must keep the width of the previous one")
            blocks.append(DownBlock(cin, ch[i], n_res, down, eps))
            cin = ch[i]
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(ch[-1], cfg.mid_attention, eps)
        self.head = Head(ch[-1], 2 * cfg.z_channels, eps)

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        if self.patch_size > 1:
            x = _per_frame(lambda f: F.pixel_unshuffle(f, self.patch_size), x)
        x = self.conv_in(x, cache)
        for blk in self.down_blocks:
            x = blk(x, cache)
        x = self.mid_block(x, cache)
        out = self.head(x, cache)
        if self.shortcuts:  # the mean starts as the channel mean of the last features
            z = out.shape[1] // 2
            out = torch.cat([out[:, :z] + _channel_mean(x, z), out[:, z:]], dim=1)
        return out


class Decoder(nn.Module):
    """z [B, z, T, h, w] -> [B, 3, 1+4(T-1), 8h, 8w] (first chunk / whole) or [B, 3, 4T, 8h, 8w]
    (later chunks), unclamped."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        ch, eps, n = cfg.channels, cfg.eps, cfg.levels
        self.patch_size = cfg.patch_size
        self.shortcuts = cfg.shortcuts
        self.conv_in = CausalConv3d(cfg.z_channels, ch[-1], 3)
        self.mid_block = MidBlock(ch[-1], cfg.mid_attention, eps)
        blocks, cin = [], ch[-1]
        for j in range(n):
            lvl = n - 1 - j
            up = Upsample(ch[lvl], ch[lvl - 1], cfg.temporal_down[lvl - 1], cfg.shortcuts) if lvl > 0 else None
            if cfg.res_blocks[lvl] == 0 and cin != ch[lvl]:
                raise ValueError("a level without resnets must keep the width of the previous one")
            blocks.append(UpBlock(cin, ch[lvl], cfg.res_blocks[lvl], up, eps))
            cin = ch[lvl - 1] if lvl > 0 else ch[0]
        self.up_blocks = nn.ModuleList(blocks)
        self.head = Head(ch[0], 3 * cfg.patch_size ** 2, eps, skip=cfg.shortcuts)

    def forward(self, z: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        x = self.conv_in(z, cache)
        if self.shortcuts:  # the latent, channels repeated, under the first convolution
            x = x + z.repeat_interleave(x.shape[1] // z.shape[1], dim=1)
        x = self.mid_block(x, cache)
        for blk in self.up_blocks:
            x = blk(x, cache)
        x = self.head(x, cache)
        if self.patch_size > 1:
            x = _per_frame(lambda f: F.pixel_shuffle(f, self.patch_size), x)
        return x


# -- the VAE ----------------------------------------------------------------------------------------
class CausalVAE(nn.Module):
    """Causal video VAE with whole-sequence and streaming encode/decode (see module docstring)."""

    spatial_factor = 8
    temporal_factor = 4

    def __init__(self, cfg: VAEConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or VAEConfig.tiny()
        self.encoder = Encoder(self.cfg)
        self.quant_conv = CausalConv3d(2 * self.cfg.z_channels, 2 * self.cfg.z_channels, 1)
        self.post_quant_conv = CausalConv3d(self.cfg.z_channels, self.cfg.z_channels, 1)
        self.decoder = Decoder(self.cfg)
        for name, m in self.named_modules():  # cache keys = module names (unique, stable)
            if hasattr(m, "cache_key"):
                m.cache_key = name

    # -- whole sequence --------------------------------------------------------------------------
    def encode(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """video [B, 3, 1+4k, H, W] in [-1, 1] (H, W multiples of 8) -> (mean, logvar), each
        [B, z, 1+k, H/8, W/8]."""
        self._check_video(video, first=True)
        return self._encode(video, None)

    def decode(self, z: torch.Tensor, *, clamp: bool = True) -> torch.Tensor:
        """z [B, z, T, h, w] -> video [B, 3, 1+4(T-1), 8h, 8w], clamped to [-1, 1] unless clamp=False."""
        self._check_latent(z)
        x = self.decoder(self.post_quant_conv(z), None)
        return x.clamp(-1.0, 1.0) if clamp else x

    def forward(self, video: torch.Tensor, *, sample: bool = False,
                generator: torch.Generator | None = None):
        """Reconstruction: video [B, 3, 1+4k, H, W] -> (recon [B, 3, 1+4k, H, W] unclamped, mean,
        logvar); sample=True decodes mean + exp(logvar/2)·ε instead of the mean."""
        mean, logvar = self.encode(video)
        z = mean
        if sample:
            eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            z = mean + torch.exp(0.5 * logvar) * eps
        return self.decode(z, clamp=False), mean, logvar

    # -- streaming -------------------------------------------------------------------------------
    def new_cache(self, direction: str | None = None) -> ConvCache:
        """A fresh ConvCache for one stream, in one direction (fixed on first use if None)."""
        return ConvCache(direction)

    def decode_step(self, z_chunk: torch.Tensor, cache: ConvCache, *,
                    clamp: bool = True) -> torch.Tensor:
        """Decode the next latent frames of a stream.

        z_chunk [B, z, T, h, w], T ≥ 1 -> [B, 3, F, 8h, 8w] with F = 1 + 4(T-1) on the stream's first
        call and 4T afterwards. Concatenating the outputs over chunks of any sizes equals
        `decode` of the concatenated latents. Memory: the chunk's activations plus the cache
        (bounded), independent of how many chunks came before.
        """
        self._check_latent(z_chunk)
        cache.bind("decode")
        x = self.decoder(self.post_quant_conv(z_chunk), cache)
        cache.chunks += 1
        return x.clamp(-1.0, 1.0) if clamp else x

    def encode_step(self, video_chunk: torch.Tensor,
                    cache: ConvCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the next video frames of a stream.

        video_chunk [B, 3, F, H, W]: F = 1+4k on the stream's first call (k ≥ 0), F = 4k (k ≥ 1)
        afterwards -> (mean, logvar), each [B, z, 1+k or k, H/8, W/8]. Concatenating the outputs
        equals `encode` of the concatenated video.
        """
        cache.bind("encode")
        self._check_video(video_chunk, first=cache.chunks == 0)
        out = self._encode(video_chunk, cache)
        cache.chunks += 1
        return out

    @torch.no_grad()
    def fold_latent_stats(self, mean: torch.Tensor, std: torch.Tensor) -> "CausalVAE":
        """Make the latent space unit-scale: afterwards `encode` returns (μ − mean)/std (and the
        log-variance of that), and `decode` expects such normalised latents, for per-channel
        `mean`, `std` `[z]` measured on the training data's latents. Folded exactly into the two
        1x1x1 convolutions around the latent (no new tensors, the weight format is unchanged):
        quant_conv's mean half W, b -> W/std, (b − mean)/std, its log-variance bias − 2 log std;
        post_quant_conv W, b -> W·diag(std), b + W·mean. Flow matching wants data at the noise's
        scale; the raw KL-light latents are several times larger."""
        z = self.cfg.z_channels
        mean = mean.to(torch.float64).flatten()
        std = std.to(torch.float64).flatten()
        if mean.numel() != z or std.numel() != z or bool((std <= 0).any()):
            raise ValueError(f"latent stats must be {z} means and {z} positive stds")
        q, p = self.quant_conv, self.post_quant_conv
        w = q.weight.double()
        b = q.bias.double()
        w[:z] /= std[:, None, None, None, None]
        b[:z] = (b[:z] - mean) / std
        b[z:] -= 2.0 * std.log()
        q.weight.copy_(w)
        q.bias.copy_(b)
        w = p.weight.double()  # [out, in, 1, 1, 1]
        p.bias.copy_(p.bias.double() + (w[:, :, 0, 0, 0] @ mean))
        p.weight.copy_(w * std[None, :, None, None, None])
        return self

    # -- helpers ---------------------------------------------------------------------------------
    def _encode(self, video: torch.Tensor,
                cache: ConvCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.quant_conv(self.encoder(video, cache))
        mean, logvar = h.chunk(2, dim=1)
        return mean, logvar.clamp(LOGVAR_MIN, LOGVAR_MAX)

    def _check_video(self, video: torch.Tensor, *, first: bool) -> None:
        if video.dim() != 5 or video.shape[1] != 3:
            raise ValueError(f"video must be [B, 3, F, H, W], got {tuple(video.shape)}")
        f, h, w = video.shape[2:]
        if h % 8 or w % 8:
            raise ValueError(f"H and W must be multiples of 8, got {h}x{w}")
        if first and (f - 1) % 4 != 0:
            raise ValueError(f"expected 1+4k frames (first chunk / whole video), got {f}")
        if not first and (f % 4 != 0 or f == 0):
            raise ValueError(f"expected 4k frames (k ≥ 1) after the first chunk, got {f}")

    def _check_latent(self, z: torch.Tensor) -> None:
        if z.dim() != 5 or z.shape[1] != self.cfg.z_channels or z.shape[2] < 1:
            raise ValueError(f"latents must be [B, {self.cfg.z_channels}, T≥1, h, w], "
                             f"got {tuple(z.shape)}")

    @torch.no_grad()
    def init_pooling_(self, seed: int = 0) -> "CausalVAE":
        """Training init of a VAE with `shortcuts`: random weights (`init_random_`), then every
        residual branch's last layer scaled down and the few linear maps on the shortcut path set to
        pass channels through, so that at step 0 the VAE *is* the parameter-free path: encode =
        8×8 (and ×4 in time) average pooling of the RGB values into 3 of the latent channels,
        decode = nearest-neighbour unpooling, plus small random branches (a tenth of their
        random init) through which the detail is learned. Training then learns the detail on top of a
        colour-correct reconstruction instead of from noise (measured on the small preset: the
        random init starts at 1 dB crop PSNR, this one at the pooled image's)."""
        self.init_random_(seed)
        if not self.cfg.shortcuts:
            raise ValueError("init_pooling_ needs a VAE with shortcuts")

        def zero(*mods: nn.Module | None) -> None:
            """Branch outputs at a tenth of their random init, not at zero: a chain of zero
            layers passes no gradient, and the latent channels the pooled path leaves empty
            would start dead (measured: PSNR flat for the first hundred steps)."""
            for m in mods:
                if m is not None:
                    for p in m.parameters():
                        p.mul_(0.1)

        def pass_through(conv: nn.Module, tap: tuple[int, ...]) -> None:
            """conv weight [out, in, *k] -> channel c to channel c (c < min(in, out)) at `tap`."""
            conv.weight.zero_()
            conv.bias.zero_()
            n = min(conv.weight.shape[0], conv.weight.shape[1])
            for c in range(n):
                conv.weight[(c, c) + tap] = 1.0

        for m in self.modules():
            if isinstance(m, ResnetBlock):
                zero(m.conv2)
                if m.conv_shortcut is not None:
                    pass_through(m.conv_shortcut, (0, 0, 0))
            elif isinstance(m, FrameAttention):
                zero(m.proj)
            elif isinstance(m, (Downsample, Upsample)):
                zero(m.resample, m.time_conv)
        enc, dec = self.encoder, self.decoder
        pass_through(enc.conv_in, (2, 1, 1))  # the current frame's pixel, causal kernel
        zero(enc.head.conv, dec.conv_in, dec.head.conv)
        pass_through(self.quant_conv, (0, 0, 0))
        # a near-deterministic posterior to start with (std e^-4 ≈ 0.02 against latents of
        # ≈ 0.2): unit noise would bury the pooled colours the latent starts with
        self.quant_conv.bias[self.cfg.z_channels:] = -8.0
        pass_through(self.post_quant_conv, (0, 0, 0))
        # decoder head skip: the unpooled colour channels (R, G, B = channels 0, 1, 2 after the
        # upsamplers' channel unfolding) to every sub-pixel of the pixel patch
        skip = dec.head.skip
        skip.weight.zero_()
        skip.bias.zero_()
        pp = self.cfg.patch_size ** 2
        for c in range(3):
            skip.weight[c * pp:(c + 1) * pp, c] = 1.0
        return self

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> "CausalVAE":
        """Deterministic random weights (same seed -> same weights) that keep activations O(1)
        and make every output depend on its inputs: conv/linear weights N(0, 1/fan_in) (residual
        branch outputs ×0.5), biases N(0, 0.02), norm gains 1 + N(0, 0.05)."""
        g = torch.Generator().manual_seed(int(seed))
        for name, p in sorted(self.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                std = 1.0 / math.sqrt(fan_in)
                if name.endswith("conv2.weight") or name.endswith("proj.weight"):
                    std *= 0.5
                p.copy_(std * torch.randn(p.shape, generator=g))
        return self


def decode_flops_per_frame(cfg: VAEConfig, height: int, width: int, latent_frames: int = 9) -> float:
    """FLOPs (2 × multiply-adds of convolutions and attention matmuls) per decoded video frame at
    height×width, counted on a real decode of `latent_frames` latent frames with forward hooks."""
    vae = CausalVAE(cfg)
    macs = [0]

    def conv_hook(m: nn.Module, inp, out) -> None:
        k = m.weight[0].numel()  # cin/groups × kernel volume
        macs[0] += out.numel() * k

    def attn_hook(m: FrameAttention, inp, out) -> None:
        b, c, t, h, w = inp[0].shape
        macs[0] += 2 * b * t * (h * w) ** 2 * c

    hooks = [m.register_forward_hook(conv_hook) for m in vae.modules()
             if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    hooks += [m.register_forward_hook(attn_hook) for m in vae.modules()
              if isinstance(m, FrameAttention)]
    z = torch.zeros(1, cfg.z_channels, latent_frames, height // 8, width // 8)
    with torch.no_grad():
        frames = vae.decode(z).shape[2]
    for h in hooks:
        h.remove()
    return 2.0 * macs[0] / frames
