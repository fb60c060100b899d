"""ContextStage: audio tokens of the chunk, frame-conditioning mask, and the chunk's initial noise."""

from __future__ import annotations

import torch

from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage


class ContextStage(Stage):
    name = "context"
    reads = ()
    writes = ("given", "audio", "sigma_noise", "motion_noise")

    def __init__(self, *, latent_channels: int, latent_size: int | tuple[int, int], motion_dim: int,
                 seed: int) -> None:
        """latent_size: (h, w) of the DiT's latents, or the side of square ones."""
        super().__init__()
        self.c, self.dm, self.seed = latent_channels, motion_dim, seed
        self.hw = (latent_size, latent_size) if isinstance(latent_size, int) else tuple(latent_size)

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        plan = rec.plan
        rec.audio = state.audio.tokens(plan.positions)  # [1, T, A, Da]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + plan.id)
        t = plan.length
        rec.sigma_noise = torch.randn(1, self.c, t, *self.hw, generator=g)  # [1, C, T, h, w]
        rec.motion_noise = torch.randn(1, t, self.dm, generator=g)  # [1, T, Dm]
        rec.given = torch.tensor(plan.given_mask()).unsqueeze(0)  # [1, T]
