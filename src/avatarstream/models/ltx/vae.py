"""The LTX-Video 0.9 VAE as FlashHead Lite uses it: 32× spatial, 8× temporal, 128 latent channels.

Shapes (pixels in [-1, 1], latents normalised per channel):

    encode(video [B, 3, 1+8k, 32h, 32w]) -> z [B, 128, 1+k, h, w]
    decode(z [B, 128, T, h, w])           -> video [B, 3, 1+8(T-1), 32h, 32w], not clamped

Latent frame 0 stands for video frame 0 alone, latent j ≥ 1 for frames 8j-7 .. 8j. FlashHead Lite
decodes 5 latents into a 33-frame chunk and re-encodes the last 9 frames into its 2 motion latents.

What the network is (FlashHead@12467ce `ltx_video/models/autoencoders/causal_video_autoencoder.py`,
docs/real-models.md, "What the loaders expect"):

- **Patchify 4×4** into 48 channels, then per stage: resnets, a stride-2 conv in T, H and W (three
  stages), and a widening resnet where the width changes (128 -> 256 -> 512). A mid block of
  resnets, PixelNorm, SiLU, and a conv to 129 channels: 128 means and one log-variance shared by
  every channel (`latent_log_var = "uniform"`). No attention, no quant conv, no timestep
  conditioning: the 0.9 decoder has none.
- **The encoder is causal** (first frame replicated as time padding): changing frames ≥ 9 leaves
  latents 0-1 bit-identical. **The decoder is not** (first and last frames replicated): the last
  latent changes every frame of the chunk. So this VAE **cannot stream**: `decode` takes a whole
  chunk, and there is no `decode_step`/`ConvCache` (unlike `models/vae.py` and the Wan VAE). Each
  chunk is decoded on its own; FlashHead hides the seams with its 9-frame motion overlap.
- **`encode` returns the mode** (the 128 mean channels), deterministic. The official wrapper's
  `encode` draws `.sample()` from the global RNG; pass `generator=` to sample mean + σ·ε from a
  generator of your own (FlashHead Lite's choice: docs/real-models.md).
- **Per-channel latent statistics** (`latents_mean`, `latents_std`, stored with the weights):
  `encode` returns (μ - mean) / std, `decode` first computes z · std + mean (FlashHead's
  `LtxVAE.normalize_latents` / `un_normalize_latents`).
- **No clamp** after decode (the Wan VAE clamps to [-1, 1]; LTX does not).

Parameter names are diffusers' (`AutoencoderKLLTXVideo`), the form of the `VAE_LTX/` file on disk,
so a downloaded checkpoint loads with no renames: `encoder.down_blocks.{i}.{resnets.{j},
downsamplers.0,conv_out}`, `encoder.mid_block`, `decoder.mid_block`, `decoder.up_blocks.{i}.
{conv_in,upsamplers.0,resnets.{j}}`, `latents_mean`, `latents_std` (190 tensors, 419,193,905
values at the real size). The LTX repository's own names (`down_blocks.0..9`, `res_blocks`) are
renamed by the loader's adapter (`weights/ltx.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.models.ltx.blocks import (DownBlock, MidBlock, TimePadConv3d, UpBlock, patchify,
                                            pixel_norm, unpatchify)

LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0  # the clamp of diffusers' DiagonalGaussianDistribution


@dataclass(frozen=True)
class LTXVAEConfig:
    """Sizes of the LTX-Video VAE, in diffusers' terms (`AutoencoderKLLTXVideo`'s config.json).

    Encoder stage i runs layers_per_block[i] resnets at block_out_channels[i], downsamples by 2 in
    T, H and W when spatio_temporal_scaling[i], and widens to block_out_channels[i+1] when that
    differs; layers_per_block[-1] is the mid block. The decoder_* fields are given in the same
    (encoder) order and run reversed. The defaults are the real LTX-Video 0.9 VAE.
    """

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    patch_size: int = 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: tuple[int, ...] = (4, 3, 3, 3, 4)
    spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, False)
    decoder_block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    decoder_layers_per_block: tuple[int, ...] = (4, 3, 3, 3, 4)
    decoder_spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, False)
    # "uniform": one log-variance channel for all (0.9); "per_channel": one each; "constant":
    # a stored channel replaced by log σ² = -30 (the mode is the same for all three)
    latent_log_var: str = "uniform"
    encoder_causal: bool = True
    decoder_causal: bool = False
    resnet_norm_eps: float = 1e-6
    spatial_padding_mode: str = "zeros"

    def __post_init__(self) -> None:
        for side, ch, layers, scaling in (
                ("encoder", self.block_out_channels, self.layers_per_block, self.spatio_temporal_scaling),
                ("decoder", self.decoder_block_out_channels, self.decoder_layers_per_block,
                 self.decoder_spatio_temporal_scaling)):
            if not ch or len(layers) != len(ch) + 1 or len(scaling) != len(ch):
                raise ValueError(f"LTXVAEConfig {side}: need one width and one scaling flag per "
                                 f"stage and one layer count per stage plus the mid block, got "
                                 f"{ch}, {scaling}, {layers}")
        if sum(self.spatio_temporal_scaling) != sum(self.decoder_spatio_temporal_scaling):
            raise ValueError("LTXVAEConfig: encoder and decoder must scale the same number of times")
        if self.latent_log_var not in ("uniform", "per_channel", "constant"):
            raise ValueError(f"LTXVAEConfig: latent_log_var {self.latent_log_var!r} is not one of "
                             "uniform, per_channel, constant")

    @property
    def temporal_compression(self) -> int:
        """Video frames per latent frame after the first (8)."""
        return 2 ** sum(self.spatio_temporal_scaling)

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent along H and W (32)."""
        return self.patch_size * self.temporal_compression

    @property
    def moment_channels(self) -> int:
        """Channels of the encoder output: the means plus the log-variance channel(s)."""
        return 2 * self.latent_channels if self.latent_log_var == "per_channel" else self.latent_channels + 1

    @staticmethod
    def tiny() -> "LTXVAEConfig":
        """The 0.9 layout at widths 4/8/16/16, one resnet per block, 8 latent channels: a
        9×64×64 clip encodes to [8, 2, 2, 2] in milliseconds on a CPU."""
        return LTXVAEConfig(latent_channels=8, block_out_channels=(4, 8, 16, 16),
                            layers_per_block=(1, 1, 1, 1, 1),
                            decoder_block_out_channels=(4, 8, 16, 16),
                            decoder_layers_per_block=(1, 1, 1, 1, 1))


class Encoder(nn.Module):
    """video [B, C_in, 1+8k, 32h, 32w] -> moments [B, moment_channels, 1+k, h, w] (before the
    Gaussian is split off; 8 and 32 at the 0.9 layout)."""

    def __init__(self, cfg: LTXVAEConfig) -> None:
        super().__init__()
        ch, eps, pad = cfg.block_out_channels, cfg.resnet_norm_eps, cfg.spatial_padding_mode
        n = len(ch)
        self.patch_size, self.causal = cfg.patch_size, cfg.encoder_causal
        self.conv_in = TimePadConv3d(cfg.in_channels * cfg.patch_size**2, ch[0], 3, padding_mode=pad)
        self.down_blocks = nn.ModuleList(
            DownBlock(ch[i], ch[min(i + 1, n - 1)], cfg.layers_per_block[i], cfg.spatio_temporal_scaling[i],
                      eps, pad) for i in range(n))
        self.mid_block = MidBlock(ch[-1], cfg.layers_per_block[-1], eps, pad)
        self.conv_out = TimePadConv3d(ch[-1], cfg.moment_channels, 3, padding_mode=pad)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(patchify(video, self.patch_size), self.causal)  # [B, ch0, F, H/p, W/p]
        for block in self.down_blocks:
            x = block(x, self.causal)
        x = self.mid_block(x, self.causal)
        return self.conv_out(F.silu(pixel_norm(x)), self.causal)


class Decoder(nn.Module):
    """z [B, latent_channels, T, h, w] (un-normalised) -> video [B, C_out, 1+8(T-1), 32h, 32w]."""

    def __init__(self, cfg: LTXVAEConfig) -> None:
        super().__init__()
        ch = tuple(reversed(cfg.decoder_block_out_channels))
        layers = tuple(reversed(cfg.decoder_layers_per_block))
        scaling = tuple(reversed(cfg.decoder_spatio_temporal_scaling))
        eps, pad = cfg.resnet_norm_eps, cfg.spatial_padding_mode
        self.patch_size, self.causal = cfg.patch_size, cfg.decoder_causal
        self.conv_in = TimePadConv3d(cfg.latent_channels, ch[0], 3, padding_mode=pad)
        self.mid_block = MidBlock(ch[0], layers[0], eps, pad)
        self.up_blocks = nn.ModuleList(
            UpBlock(ch[max(i - 1, 0)], ch[i], layers[i + 1], scaling[i], eps, pad) for i in range(len(ch)))
        self.conv_out = TimePadConv3d(ch[-1], cfg.out_channels * cfg.patch_size**2, 3, padding_mode=pad)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z, self.causal), self.causal)
        for block in self.up_blocks:
            x = block(x, self.causal)
        x = self.conv_out(F.silu(pixel_norm(x)), self.causal)  # [B, C_out·p², F, H/p, W/p]
        return unpatchify(x, self.patch_size)


class LTXVideoVAE(nn.Module):
    """Whole-chunk encode/decode of the LTX-Video 0.9 VAE (see the module docstring: it cannot
    stream, its encoder returns the mode, its latents are normalised per channel)."""

    def __init__(self, cfg: LTXVAEConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or LTXVAEConfig()
        self.encoder = Encoder(self.cfg)
        self.decoder = Decoder(self.cfg)
        c = self.cfg.latent_channels
        self.register_buffer("latents_mean", torch.zeros(c))  # [C] per-channel statistics,
        self.register_buffer("latents_std", torch.ones(c))  # stored with the weights
        self.spatial_factor: int = self.cfg.spatial_compression  # pixels per latent along H, W
        self.temporal_factor: int = self.cfg.temporal_compression  # frames per latent after the first

    def latent_dist(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """video [B, 3, 1+8k, 32h, 32w] -> (mean, logvar), each [B, C, 1+k, h, w], **not**
        normalised (the encoder's Gaussian; logvar clamped to [-30, 20] as diffusers does)."""
        self._check_video(video)
        moments = self.encoder(video)  # [B, moment_channels, 1+k, h, w]
        c = self.cfg.latent_channels
        mean = moments[:, :c]
        if self.cfg.latent_log_var == "per_channel":
            logvar = moments[:, c:]
        elif self.cfg.latent_log_var == "uniform":
            logvar = moments[:, c:].expand_as(mean)
        else:
            logvar = torch.full_like(mean, LOGVAR_MIN)
        return mean, logvar.clamp(LOGVAR_MIN, LOGVAR_MAX)

    def encode(self, video: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """video [B, 3, 1+8k, 32h, 32w] in [-1, 1] -> normalised latents [B, C, 1+k, h, w].

        The mode (mean) unless `generator` is given, then mean + exp(logvar/2)·ε with ε drawn
        from it (the official encode's `.sample()`, made reproducible)."""
        mean, logvar = self.latent_dist(video)
        z = mean
        if generator is not None:
            eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            z = mean + torch.exp(0.5 * logvar) * eps
        return self.normalize(z)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latents [B, C, T, h, w] -> video [B, 3, 1+8(T-1), 32h, 32w], unclamped.

        The whole chunk at once: the decoder is not causal (every frame depends on every latent),
        so there is no streaming decode and a chunk cannot be split."""
        self._check_latent(z)
        return self.decoder(self.denormalize(z))

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """(z - mean) / std per channel: encoder space -> the DiT's latent space."""
        return (z - self._stat(self.latents_mean, z)) / self._stat(self.latents_std, z)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """z · std + mean per channel: the DiT's latent space -> the decoder's input."""
        return z * self._stat(self.latents_std, z) + self._stat(self.latents_mean, z)

    @staticmethod
    def _stat(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return s.to(z.dtype).view(1, -1, 1, 1, 1)  # [C] -> [1, C, 1, 1, 1]

    def _check_video(self, video: torch.Tensor) -> None:
        s, t = self.cfg.spatial_compression, self.cfg.temporal_compression
        if video.dim() != 5 or video.shape[1] != self.cfg.in_channels:
            raise ValueError(f"video must be [B, {self.cfg.in_channels}, F, H, W], got {tuple(video.shape)}")
        f, h, w = video.shape[2:]
        if h % s or w % s or (f - 1) % t:
            raise ValueError(f"video must have 1+{t}k frames and H, W multiples of {s}, "
                             f"got {f} frames of {h}x{w}")

    def _check_latent(self, z: torch.Tensor) -> None:
        c = self.cfg.latent_channels
        if z.dim() != 5 or z.shape[1] != c or z.shape[2] < 1:
            raise ValueError(f"latents must be [B, {c}, T≥1, h, w], got {tuple(z.shape)}")
