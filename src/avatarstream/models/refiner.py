"""Identity-aware super-resolution refiner (Avatar V sec. 2.4, 4.6).

The VideoRef DiT's transformer (`models/transformer.py`), with
- input = channel concat of the noisy HR latent and the x2 bilinear-upsampled LR latent
  (`[B, 2C, T, 2h, 2w]`), output = HR velocity `[B, C, T, 2h, 2w]`;
- generation self-attention restricted to latent frames within +-window (sparse temporal
  attention), plus all valid reference tokens (HR reference, identity conditioning);
- text, per-frame audio and motion tokens as in the DiT (motion tokens are the DiT's clean motion
  and condition only: the refiner has no motion head);
- one Euler step from sigma = 0.6: `x = (1 - s) up + s noise`, `x0 = x - s v`.

The reference's LR half of the input is its own down-up version (avg-pool x2, bilinear x2),
which is what an LR condition of that frame looks like.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from avatarstream.cache.reference import ReferenceCache
from avatarstream.models.transformer import DiTCondition, RefTransformer, TransformerConfig


@dataclass(kw_only=True)
class RefinerConfig(TransformerConfig):
    window: int = 1  # generation frames attend to latent frames within +-window

    @classmethod
    def tiny(cls) -> "RefinerConfig":
        """Test size: HR latent 8x8 (64 px), 2 layers of width 32, window 1."""
        return cls(in_channels=4, dim=32, depth=2, heads=2, ffn_dim=64, window=1, audio_dim=16,
                   audio_tokens=6, text_dim=16, motion_dim=4)

    @classmethod
    def small(cls) -> "RefinerConfig":
        """Bundled size: HR latent 32x32 from 256 px (256 patch tokens + 1 motion token per
        frame), 4 layers of width 192 (3 heads of 64), FFN 768, window 1: 3.6M parameters."""
        return cls(in_channels=16, dim=192, depth=4, heads=3, ffn_dim=768, window=1,
                   audio_dim=128, audio_tokens=6, text_dim=128, motion_dim=16)


def upsample2x(lat: torch.Tensor) -> torch.Tensor:
    """Per-frame bilinear x2: `[B, C, T, h, w]` -> `[B, C, T, 2h, 2w]`."""
    b, c, t, h, w = lat.shape
    y = lat.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    y = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
    return y.reshape(b, t, c, 2 * h, 2 * w).permute(0, 2, 1, 3, 4)


def downup(lat: torch.Tensor) -> torch.Tensor:
    """HR latents `[B, C, T, H, W]` -> avg-pool x2 then bilinear x2 (an LR condition of them)."""
    b, c, t, h, w = lat.shape
    y = lat.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    y = F.avg_pool2d(y, 2)
    return upsample2x(y.reshape(b, t, c, h // 2, w // 2).permute(0, 2, 1, 3, 4))


class SRRefiner(RefTransformer):
    """- `encode_reference(hr_lat [B,C,R,H,W], valid [B,R] | None, t_pos [R]) -> ReferenceCache`
    - `forward(x_noisy [B,C,T,H,W], lr_up [B,C,T,H,W], sigma, cond, ref) -> velocity [B,C,T,H,W]`
    - `forward_dense(x_noisy, lr_up, sigma, cond, ref_latents, valid, ref_t_pos)` (explicit mask)
    - `refine(lr [B,C,T,h,w], noise [B,C,T,2h,2w], cond, ref, sigma=0.6) -> [B,C,T,2h,2w]`
    """

    def __init__(self, config: RefinerConfig) -> None:
        super().__init__(config, 2 * config.in_channels, config.in_channels, window=config.window,
                         motion_head=False)

    def _ref_input(self, lat: torch.Tensor) -> torch.Tensor:
        return torch.cat([lat, downup(lat)], dim=1)

    def forward(self, x_noisy: torch.Tensor, lr_up: torch.Tensor, sigma: torch.Tensor | float,
                cond: DiTCondition, ref: ReferenceCache | None) -> torch.Tensor:
        """sigma: `[B, T]`, `[B]` or a float. Returns the velocity `[B, C, T, H, W]`."""
        x = torch.cat([x_noisy, lr_up.to(x_noisy.dtype)], dim=1)  # [B, 2C, T, H, W]
        return self.forward_sparse(x, sigma, cond, ref).velocity

    def forward_dense(self, x_noisy: torch.Tensor,  # type: ignore[override]
                      lr_up: torch.Tensor, sigma: torch.Tensor | float, cond: DiTCondition,
                      ref_latents: torch.Tensor, valid: torch.Tensor | None,
                      ref_t_pos: torch.Tensor) -> torch.Tensor:
        """Plain version: one sequence [ref ; gen] with the explicit window + reference mask."""
        x = torch.cat([x_noisy, lr_up.to(x_noisy.dtype)], dim=1)  # [B, 2C, T, H, W]
        return super().forward_dense(x, sigma, cond, ref_latents, valid, ref_t_pos).velocity

    def refine(self, lr: torch.Tensor, noise: torch.Tensor, cond: DiTCondition,
               ref: ReferenceCache | None, sigma: float = 0.6) -> torch.Tensor:
        """One Euler step from sigma: lr `[B,C,T,h,w]`, noise `[B,C,T,2h,2w]` -> HR x0 estimate."""
        up = upsample2x(lr.float()).to(noise.dtype)
        x = (1.0 - sigma) * up + sigma * noise
        b, _, t = x.shape[:3]
        v = self.forward(x, up, torch.full((b, t), float(sigma), device=x.device), cond, ref)
        return x - sigma * v.to(x.dtype)
