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

The layers live in `models/vae_blocks.py`. This module is what inference needs (plus
`init_random_`, the registry's random weights); the training-only surgery — the average-pooling
init of a fresh VAE and folding latent statistics into it — is `train/vae_init.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.cache.conv import ConvCache
from avatarstream.models.vae_blocks import (CausalConv3d, Downsample, Head, MidBlock, ResnetLevel,
                                           Upsample, channel_mean, per_frame, pixel_shuffle)

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
    # already carries the low frequencies (see `vae_blocks.fold_down` and `Upsample`)
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
        attention multiply-adds ×2, counted with forward hooks on a real decode), ≈ 28 GFLOP/s at 25 fps. Measured
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
            blocks.append(ResnetLevel(cin, ch[i], n_res, eps, down, "downsampler"))
            cin = ch[i]
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(ch[-1], cfg.mid_attention, eps)
        self.head = Head(ch[-1], 2 * cfg.z_channels, eps)

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        if self.patch_size > 1:
            x = per_frame(lambda f: F.pixel_unshuffle(f, self.patch_size), x)
        x = self.conv_in(x, cache)
        for blk in self.down_blocks:
            x = blk(x, cache)
        x = self.mid_block(x, cache)
        out = self.head(x, cache)
        if self.shortcuts:  # the mean starts as the channel mean of the last features
            z = out.shape[1] // 2
            out = torch.cat([out[:, :z] + channel_mean(x, z), out[:, z:]], dim=1)
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
            blocks.append(ResnetLevel(cin, ch[lvl], cfg.res_blocks[lvl], eps, up, "upsampler"))
            cin = ch[lvl - 1] if lvl > 0 else ch[0]
        self.up_blocks = nn.ModuleList(blocks)
        self.head = Head(ch[0], 3 * cfg.patch_size ** 2, eps, skip=cfg.shortcuts)

    def forward(self, z: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        x = self._stem(z, cache)
        for blk in self.up_blocks:  # iterated whole: block offload onloads each just in time
            x = blk(x, cache)
        return self._tail(x, cache, unpatch=True)

    def _stem(self, z: torch.Tensor, cache: ConvCache | None) -> torch.Tensor:
        x = self.conv_in(z, cache)
        if self.shortcuts:  # the latent, channels repeated, under the first convolution
            x = x + z.repeat_interleave(x.shape[1] // z.shape[1], dim=1)
        return self.mid_block(x, cache)

    def _tail(self, x: torch.Tensor, cache: ConvCache | None, unpatch: bool) -> torch.Tensor:
        x = self.head(x, cache)
        if self.patch_size > 1 and unpatch:
            x = per_frame(lambda f: pixel_shuffle(f, self.patch_size), x)
        return x

    # The two parts of a pipelined streaming decode (`CausalVAE.decode_front` / `decode_back`):
    # the low-resolution part (conv_in, mid block, the first level) and the rest. The levels are
    # iterated, never sliced (an offloaded `up_blocks` is a ModuleList that onloads as it goes).
    FRONT_LEVELS = 1

    def front(self, z: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        x = self._stem(z, cache)
        for i, blk in enumerate(self.up_blocks):
            if i == self.FRONT_LEVELS:
                break
            x = blk(x, cache)
        return x

    def back(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        """The rest, up to the head's output [B, 3·p², F, H/p, W/p] before the pixel unfold
        (`patches_to_uint8` unfolds it while it converts)."""
        for i, blk in enumerate(self.up_blocks):
            if i >= self.FRONT_LEVELS:
                x = blk(x, cache)
        return self._tail(x, cache, unpatch=False)

    def is_back_layer(self, key: str) -> bool:
        """Whether the cache entry `key` (a module name under the VAE) belongs to `back`."""
        lvl = [f"decoder.up_blocks.{i}." for i in range(self.FRONT_LEVELS, len(self.up_blocks))]
        return key.startswith(("decoder.head.", *lvl))


def patches_to_uint8(x: torch.Tensor, patch: int = 1) -> torch.Tensor:
    """Decoder output -> pictures: x [B, 3·p², F, h, w] (channel 4c + 2a + b... as
    `F.pixel_shuffle` orders them: colour c, row phase a, column phase b, for p = 2) in [-1, 1] ->
    uint8 [B, F, p·h, p·w, 3], the value round((clamp(x) + 1) · 127.5).

    The same numbers as pixel_shuffle, clamp and conversion done one after the other, in one
    float32 pass (in place) and one uint8 copy: a quarter of the passes over the frames
    (≈ 22 against 39 ms for 24 frames of 256², one thread)."""
    b, cp, f, h, w = x.shape
    c = cp // (patch * patch)
    u = x.to(torch.float32, copy=True).clamp_(-1.0, 1.0).add_(1.0).mul_(127.5).round_().to(torch.uint8)
    # B, F, h, a, w, b, c; numpy's copy of this byte permutation is 2.5x torch's (6.6 / 17 ms)
    u = u.cpu().numpy().reshape(b, c, patch, patch, f, h, w).transpose(0, 4, 5, 2, 6, 3, 1)
    return torch.from_numpy(np.ascontiguousarray(u).reshape(b, f, patch * h, patch * w, c))


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
        self.decode_backend = None  # a `vae_backend.DecodeBackend` for steady chunks; None: eager

    def set_decode_backend(self, kind: str) -> None:
        """Decode a stream's steady-state chunks through `kind` (`vae_backend.BACKENDS`;
        "eager": as written). The first chunk of a stream always decodes eagerly."""
        from avatarstream.models.vae_backend import DecodeBackend

        self.decode_backend = None if kind == "eager" else DecodeBackend(self, kind)

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
        if self.decode_backend is not None and clamp:
            out = self.decode_backend.decode_step(z_chunk, cache)
            if out is not None:
                cache.chunks += 1
                return out
        x = self.decoder(self.post_quant_conv(z_chunk), cache)
        cache.chunks += 1
        return x.clamp(-1.0, 1.0) if clamp else x

    def decode_step_frames(self, z_chunk: torch.Tensor, cache: ConvCache) -> torch.Tensor:
        """`decode_step`'s frames as pictures: uint8 [B, F, 8h, 8w, 3] (`patches_to_uint8`),
        what a publisher takes, without the float video in between."""
        if self.decode_backend is not None:
            self._check_latent(z_chunk)
            cache.bind("decode")
            out = self.decode_backend.decode_step(z_chunk, cache)
            if out is not None:
                cache.chunks += 1
                return patches_to_uint8(out)
        return self.decode_back(self.decode_front(z_chunk, cache), cache)

    # -- a streaming decode in two parts, for two threads ----------------------------------------
    # Chunk k's `decode_back` can run while chunk k+1's `decode_front` does: the two parts use
    # disjoint layers (`is_back_layer` tells their cache entries apart), and each part alone is
    # the same computation as in `decode_step_frames`, so the frames are identical.
    def decode_front(self, z_chunk: torch.Tensor, cache: ConvCache) -> torch.Tensor:
        """The low-resolution part of `decode_step_frames` (eager): features for `decode_back`."""
        self._check_latent(z_chunk)
        cache.bind("decode")
        return self.decoder.front(self.post_quant_conv(z_chunk), cache)

    def decode_back(self, h: torch.Tensor, cache: ConvCache) -> torch.Tensor:
        """The rest: `decode_front`'s features -> uint8 pictures [B, F, 8h, 8w, 3]."""
        x = self.decoder.back(h, cache)
        cache.chunks += 1
        return patches_to_uint8(x, self.decoder.patch_size)

    def is_back_layer(self, key: str) -> bool:
        """Whether cache entry `key` is written by `decode_back` (else by `decode_front`)."""
        return self.decoder.is_back_layer(key)

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
