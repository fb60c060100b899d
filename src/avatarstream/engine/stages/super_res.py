"""SuperResStage: identity-aware refiner, one step from sigma 0.6, on the frames the chunk emits
(plus `window` frames of left context for the local temporal attention, dropped afterwards).
Refined latents go to the rolling store until their publication slot comes."""

from __future__ import annotations

import torch

from avatarstream.engine.module import Module
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.models.dit import DiTCondition


class SuperResStage(Stage):
    name = "super_res"
    reads = ("lr_latents", "motion", "audio")
    writes = ("hr_latents",)

    def __init__(self, refiner: Module | None, *, sigma: float = 0.6, window: int = 1, seed: int = 0) -> None:
        """refiner None: a `direct` model, whose DiT already made output-resolution latents; the
        stage passes the emitted frames through to the store unchanged."""
        super().__init__()
        self.refiner, self.sigma, self.window, self.seed = refiner, sigma, window, seed

    def run(self, rec: ChunkRecord, state: SessionState) -> None:
        plan = rec.plan
        e0, e1 = plan.emit
        if self.refiner is None:
            rec.hr_latents = rec.lr_latents[:, :, e0:e1].float()
            state.store.put(plan, rec.lr_latents, rec.motion, rec.hr_latents)
            return
        c0 = max(0, e0 - self.window)
        lr = rec.lr_latents[:, :, c0:e1]  # [1, C, E', h, w]
        b, c, t, h, w = lr.shape
        g = torch.Generator().manual_seed(self.seed * 104_729 + plan.id)
        noise = torch.randn(b, c, t, 2 * h, 2 * w, generator=g)  # [1, C, E', 2h, 2w]
        cond = DiTCondition(motion=rec.motion[:, c0:e1], audio=rec.audio[:, c0:e1], text=state.text,
                            text_mask=state.text_mask, t_pos=torch.arange(t, dtype=torch.float32))
        hr = self.refiner.call("refine", lr, noise, cond, state.refiner_reference, sigma=self.sigma)
        rec.hr_latents = hr[:, :, e0 - c0 :].float()  # [1, C, E, 2h, 2w]
        state.store.put(plan, rec.lr_latents, rec.motion, rec.hr_latents)
