"""The Wan2.1 video VAE (official `WanVAE_`): the VAE of FlashHead Pro and LiveAvatar.

Our implementation, written from the spec (docs/real-models.md, docs/parity-fixtures.md), whose
state dict is the official one key for key (`encoder.*`, `conv1`, `conv2`, `decoder.*`, RMS norm
`gamma`): `Wan2.1_VAE.pth` loads without renames (194 tensors, 126.9 M parameters).

Shapes (pixels in [-1, 1], latents **normalised** as the DiTs see them):

    encode(video [B, 3, 1+4k, H, W]) -> (mean, logvar), each [B, z, 1+k, H/8, W/8]
    decode(z [B, z, T, h, w])        -> video [B, 3, 1+4(T-1), 8h, 8w]

Latent frame 0 covers video frame 0 alone, latent j ≥ 1 covers frames 4j-3 .. 4j (the ×8 / ×4
factors are those of the real config; a config's own are `spatial_factor`, `temporal_factor`).

It speaks the protocol of our own `models/vae.py:CausalVAE`, so the engine drives it unchanged:
`encode`, `decode(z, clamp=True)`, `new_cache()` (a `ConvCache`), `decode_step(z_chunk, cache)`
(first call: 1 + 4(T-1) frames, later calls 4T; the outputs concatenated equal `decode` of the
concatenated latents for any chunk sizes) and `encode_step`.

Choices, and why:
- **Latent normalisation is explicit** (`LatentNorm`): the official wrapper's `scale` =
  [mean, 1/std] per channel, fp32, with its arithmetic order: encode returns (μ − mean)·(1/std),
  decode first computes z / (1/std) + mean. The statistics are not in the checkpoint; they come
  from the config (default: the real Wan2.1 ones). `logvar` is moved into the same space
  (+ 2·log(1/std)), so (mean, logvar) stay one Gaussian.
- **Work goes through in the official pieces**: decode latent by latent, encode the first frame
  alone and then 4 frames at a time, each piece through the stream's cache, whatever the caller's
  chunking (`decode` is `decode_step` on a fresh cache). So a streamed decode equals the whole
  one bit for bit for any chunk sizes, and peak memory is one piece's activations: at 512² one
  pass over 33 frames would hold several GB. One pass over the whole sequence (`decoder(x)`
  without a cache) is the same computation, the layers being causal in time and the attention
  per frame; it differs only in float rounding (a few 1e-6: the convolutions meet other shapes),
  and the tests use it to check the cache logic.
- **The causal convolution is ours** (`models/vae_blocks.CausalConv3d`, oneDNN for fp32 on the
  CPU). With plain `F.conv3d` in its place this port reproduces the official module, run on the
  same machine, bit for bit (decode, streamed decode and encode of the parity fixture); with
  oneDNN it lands ≈ 4e-6 off, far inside the fixture's bound.
- **Clamping** is the wrapper's (`WanVAE.decode` clamps to [-1, 1]); `clamp=False` gives the
  model-level output the parity fixture stores.
- Dropout is built (the key positions need it) and is a no-op in eval; the real config uses 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from avatarstream.cache.conv import ConvCache
from avatarstream.models.vae_blocks import CausalConv3d
from avatarstream.models.wan.vae_blocks import (AttentionBlock, Chain, Downsample, ResidualBlock,
                                                Streaming, Upsample, head, middle)

# the real Wan2.1 latent statistics (16 channels), as the official `WanVAE` wrapper defines them
WAN21_LATENT_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENT_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0  # the official `sample` clamps log_var so


@dataclass(frozen=True)
class WanVAEConfig:
    """The official constructor's keyword arguments, under their official names (including the
    `temperal` spelling), plus the latent statistics. Defaults: the real Wan2.1 VAE.

    dim_mult[i] · dim is the width of level i (each level halves H and W); temperal_downsample[i]
    whether the resampler after level i also halves time (the decoder mirrors it); attn_scales the
    resolutions (1 = full, 1/2, ...) that get an attention block after each resnet."""

    dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    latent_mean: tuple[float, ...] = WAN21_LATENT_MEAN
    latent_std: tuple[float, ...] = WAN21_LATENT_STD

    def __post_init__(self) -> None:
        if len(self.dim_mult) < 2 or len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError("WanVAEConfig: dim_mult needs ≥ 2 levels and temperal_downsample one "
                             f"entry per resampler (levels - 1); got {self.dim_mult}, "
                             f"{self.temperal_downsample}")
        if not len(self.latent_mean) == len(self.latent_std) == self.z_dim:
            raise ValueError(f"WanVAEConfig: latent_mean and latent_std need z_dim = {self.z_dim} "
                             f"entries, got {len(self.latent_mean)} and {len(self.latent_std)}")

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(map(bool, self.temperal_downsample))

    @staticmethod
    def tiny() -> "WanVAEConfig":
        """The real layout (4 levels, ×8 / ×4) at width 4, z 4, one resnet per level: CPU tests."""
        return WanVAEConfig(dim=4, z_dim=4, dim_mult=(1, 1, 2, 2), num_res_blocks=1,
                            latent_mean=(0.1, -0.2, 0.3, 0.0), latent_std=(1.5, 0.5, 2.0, 1.0))

    @staticmethod
    def from_official(kwargs: Mapping[str, Any], *, latent_mean: Iterable[float] | None = None,
                      latent_std: Iterable[float] | None = None) -> "WanVAEConfig":
        """From the official constructor's kwargs (lists allowed); statistics default to Wan2.1's.
        ValueError on a keyword the official constructor does not have."""
        known = {f.name for f in fields(WanVAEConfig)} - {"latent_mean", "latent_std"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"not Wan VAE constructor arguments: {unknown}")
        args = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
        if latent_mean is not None:
            args["latent_mean"] = tuple(float(v) for v in latent_mean)
        if latent_std is not None:
            args["latent_std"] = tuple(float(v) for v in latent_std)
        return WanVAEConfig(**args)


class Encoder(Streaming):
    """video [B, 3, F, H, W] -> [B, 2z, F', H/8, W/8] (mean ⊕ log-variance, before `conv1`)."""

    def __init__(self, cfg: WanVAEConfig) -> None:
        super().__init__()
        dims = [cfg.dim * m for m in (1, *cfg.dim_mult)]
        self.conv1 = CausalConv3d(3, dims[0], 3)
        layers: list[nn.Module] = []
        scale = 1.0
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                layers.append(ResidualBlock(cin, cout, cfg.dropout))
                if scale in cfg.attn_scales:
                    layers.append(AttentionBlock(cout))
                cin = cout
            if i < len(cfg.dim_mult) - 1:
                layers.append(Downsample(cout, cfg.temperal_downsample[i]))
                scale /= 2.0
        self.downsamples = Chain(*layers)
        self.middle = middle(dims[-1], cfg.dropout)
        self.head = head(dims[-1], 2 * cfg.z_dim)

    def forward(self, x: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        x = self.downsamples(self.conv1(x, cache), cache)
        return self.head(self.middle(x, cache), cache)


class Decoder(Streaming):
    """z [B, z, T, h, w] (after `conv2`) -> [B, 3, 1+4(T-1) or 4T, 8h, 8w], unclamped.

    Widths mirror the encoder's; each upsampler halves the channels, so the resnets after it
    start at half the previous level's width (the official `in_dim // 2`)."""

    def __init__(self, cfg: WanVAEConfig) -> None:
        super().__init__()
        dims = [cfg.dim * m for m in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        temporal_up = cfg.temperal_downsample[::-1]
        self.conv1 = CausalConv3d(cfg.z_dim, dims[0], 3)
        self.middle = middle(dims[0], cfg.dropout)
        layers: list[nn.Module] = []
        scale = 1.0 / 2 ** (len(cfg.dim_mult) - 2)
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            cin = cin // 2 if i > 0 else cin
            for _ in range(cfg.num_res_blocks + 1):
                layers.append(ResidualBlock(cin, cout, cfg.dropout))
                if scale in cfg.attn_scales:
                    layers.append(AttentionBlock(cout))
                cin = cout
            if i < len(cfg.dim_mult) - 1:
                layers.append(Upsample(cout, temporal_up[i]))
                scale *= 2.0
        self.upsamples = Chain(*layers)
        self.head = head(dims[-1], 3)

    def forward(self, z: torch.Tensor, cache: ConvCache | None = None) -> torch.Tensor:
        x = self.middle(self.conv1(z, cache), cache)
        return self.head(self.upsamples(x, cache), cache)


class LatentNorm(nn.Module):
    """Per-channel latent statistics (not in the checkpoint): normalised = (μ − mean)·(1/std).

    Buffers `mean` and `inv_std` [z] are non-persistent (the state dict stays the official one);
    `init_buffers_` makes them after a meta-device build, as `weights/official.build_loaded`
    expects. The arithmetic is the official wrapper's, in fp32 (see the module docstring)."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.values = (mean, std)
        self.register_buffer("mean", torch.tensor(mean), persistent=False)
        self.register_buffer("inv_std", 1.0 / torch.tensor(std), persistent=False)

    def init_buffers_(self) -> None:
        device = torch.device("cpu") if self.mean.is_meta else self.mean.device
        mean, std = (torch.tensor(v, dtype=torch.float32, device=device) for v in self.values)
        self.mean, self.inv_std = mean, 1.0 / std

    def _view(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.to(like).view(1, -1, *(1,) * (like.dim() - 2))  # [1, z, 1, 1, 1]

    def normalise(self, mu: torch.Tensor) -> torch.Tensor:
        """Encoder mean [B, z, T, h, w] -> the DiT's latents."""
        return (mu - self._view(self.mean, mu)) * self._view(self.inv_std, mu)

    def denormalise(self, z: torch.Tensor) -> torch.Tensor:
        """The DiT's latents [B, z, T, h, w] -> the decoder's input."""
        return z / self._view(self.inv_std, z) + self._view(self.mean, z)

    def normalise_logvar(self, log_var: torch.Tensor) -> torch.Tensor:
        """log σ² of the encoder -> log σ² of the normalised latent (σ scales by 1/std)."""
        return log_var + 2.0 * torch.log(self._view(self.inv_std, log_var))


class WanVAE(nn.Module):
    """The Wan2.1 VAE with whole and streaming decode (see the module docstring)."""

    def __init__(self, cfg: WanVAEConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or WanVAEConfig()
        z = self.cfg.z_dim
        self.encoder = Encoder(self.cfg)
        self.conv1 = CausalConv3d(2 * z, 2 * z, 1)  # encoder output -> (mean, log-variance)
        self.conv2 = CausalConv3d(z, z, 1)  # latent -> decoder input
        self.decoder = Decoder(self.cfg)
        self.latent_norm = LatentNorm(self.cfg.latent_mean, self.cfg.latent_std)
        for name, m in self.named_modules():  # cache keys = module names (unique, stable)
            if hasattr(m, "cache_key"):
                m.cache_key = name

    @property
    def spatial_factor(self) -> int:
        return self.cfg.spatial_factor

    @property
    def temporal_factor(self) -> int:
        return self.cfg.temporal_factor

    def init_buffers_(self) -> None:
        """Make the buffers a checkpoint does not hold (the latent statistics)."""
        self.latent_norm.init_buffers_()

    # -- encode ----------------------------------------------------------------------------------
    def encode(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """video [B, 3, 1+4k, H, W] in [-1, 1] -> normalised (mean, logvar), each
        [B, z, 1+k, H/8, W/8]: `encode_step` on a fresh cache."""
        return self.encode_step(video, self.new_cache("encode"))

    def encode_step(self, video_chunk: torch.Tensor,
                    cache: ConvCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The next frames of a stream: [B, 3, 1+4k, H, W] on the first call, [B, 3, 4k, H, W]
        (k ≥ 1) later -> (mean, logvar), each [B, z, 1+k or k, H/8, W/8]. Concatenated, the
        outputs equal `encode` of the concatenated video bit for bit: the frames go through in
        the official pieces (the stream's first frame alone, then 4 at a time) however the
        stream is chunked."""
        cache.bind("encode")
        first = cache.chunks == 0
        self._check_video(video_chunk, first=first)
        tf, f = self.temporal_factor, video_chunk.shape[2]
        starts = [0, *range(1, f, tf)] if first else [*range(0, f, tf)]
        pieces = [video_chunk[:, :, a : a + (1 if first and a == 0 else tf)] for a in starts]
        mean, logvar = zip(*(self._moments(self.encoder(p, cache)) for p in pieces))
        cache.chunks += 1
        return torch.cat(mean, dim=2), torch.cat(logvar, dim=2)

    def _moments(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output [B, 2z, T, h, w] -> normalised (mean, logvar), each [B, z, T, h, w]."""
        mu, log_var = self.conv1(h).chunk(2, dim=1)
        log_var = log_var.clamp(LOGVAR_MIN, LOGVAR_MAX)
        return self.latent_norm.normalise(mu), self.latent_norm.normalise_logvar(log_var)

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, z: torch.Tensor, *, clamp: bool = True) -> torch.Tensor:
        """Normalised z [B, z, T, h, w] -> video [B, 3, 1+4(T-1), 8h, 8w], clamped to [-1, 1]
        unless clamp=False (the model-level output): `decode_step` on a fresh cache."""
        return self.decode_step(z, self.new_cache("decode"), clamp=clamp)

    def new_cache(self, direction: str | None = None) -> ConvCache:
        """A fresh cache for one stream in one direction (fixed on first use when None)."""
        return ConvCache(direction)

    def decode_step(self, z_chunk: torch.Tensor, cache: ConvCache, *,
                    clamp: bool = True) -> torch.Tensor:
        """The next latents of a stream: z_chunk [B, z, T, h, w], T ≥ 1 -> [B, 3, F, 8h, 8w] with
        F = 1 + 4(T-1) on the stream's first call and 4T after. Concatenated over chunks of any
        sizes, the outputs equal `decode` of the concatenated latents bit for bit: every latent
        goes through alone (the official loop), so it meets the same operations whatever the
        chunking. Memory: one latent's activations plus the cache (two frames per causal conv)."""
        self._check_latent(z_chunk)
        cache.bind("decode")
        z = self.latent_norm.denormalise(z_chunk)
        x = torch.cat([self.decoder(self.conv2(z[:, :, i : i + 1]), cache) for i in range(z.shape[2])],
                      dim=2)  # [B, 3, F, 8h, 8w]
        cache.chunks += 1
        return x.clamp(-1.0, 1.0) if clamp else x

    # -- checks ----------------------------------------------------------------------------------
    def _check_video(self, video: torch.Tensor, *, first: bool) -> None:
        s, tf = self.spatial_factor, self.temporal_factor
        ok = video.dim() == 5 and video.shape[1] == 3
        if ok:
            f, h, w = video.shape[2:]
            ok = h % s == 0 and w % s == 0 and ((f - 1) % tf == 0 if first else f % tf == 0 and f > 0)
        if not ok:
            frames = f"1+{tf}k" if first else f"{tf}k (k ≥ 1)"
            raise ValueError(f"video must be [B, 3, {frames} frames, H, W] with H, W multiples "
                             f"of {s}; got {tuple(video.shape)}")

    def _check_latent(self, z: torch.Tensor) -> None:
        if z.dim() != 5 or z.shape[1] != self.cfg.z_dim or z.shape[2] < 1:
            raise ValueError(f"latents must be [B, {self.cfg.z_dim}, T ≥ 1, h, w], got {tuple(z.shape)}")
