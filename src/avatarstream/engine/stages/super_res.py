"""SuperResStage: identity-aware refiner, one step from sigma 0.6, on the frames the chunks emit
(plus `window` frames of left context for the local temporal attention, dropped afterwards).
Refined latents go to each session's rolling store until their publication slot comes.

Batch-first: chunks with the same emitted span (and left context) are refined in one call, their
reference caches stacked (`ReferenceCache.stack`); each chunk's noise comes from its own seed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from avatarstream.cache.reference import ReferenceCache
from avatarstream.engine.module import Module
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Item, Stage
from avatarstream.engine.stages.audio_to_video import batch_text
from avatarstream.models.transformer import DiTCondition


class SuperResStage(Stage):
    name = "super_res"
    reads = ("lr_latents", "motion", "audio")
    writes = ("hr_latents",)

    def __init__(self, refiner: Module | None, *, sigma: float = 0.6, window: int = 1, seed: int = 0) -> None:
        """refiner None: a `direct` model, whose DiT already made output-resolution latents; the
        stage passes the emitted frames through to the store unchanged."""
        super().__init__()
        self.refiner, self.sigma, self.window, self.seed = refiner, sigma, window, seed

    def span(self, rec: ChunkRecord) -> tuple[int, int, int]:
        """(first context frame, first emitted frame, end) of the chunk's refined window."""
        e0, e1 = rec.plan.emit
        return max(0, e0 - self.window), e0, e1

    def batch_key(self, rec: ChunkRecord, state: SessionState) -> Hashable | None:
        c0, e0, e1 = self.span(rec)
        return ("span", e1 - c0, e0 - c0)

    def run(self, items: Sequence[Item]) -> None:
        if self.refiner is None:
            for rec, state in items:
                e0, e1 = rec.plan.emit
                rec.hr_latents = rec.lr_latents[:, :, e0:e1].float()
                state.store.put(rec.plan, rec.lr_latents, rec.motion, rec.hr_latents)
            return
        lrs, noises, motions, audios = [], [], [], []
        for rec, _ in items:
            c0, _, e1 = self.span(rec)
            lr = rec.lr_latents[:, :, c0:e1]  # [1, C, E', h, w]
            b, c, t, h, w = lr.shape
            g = torch.Generator().manual_seed(self.seed * 104_729 + rec.plan.id)
            noises.append(torch.randn(b, c, t, 2 * h, 2 * w, generator=g))  # [1, C, E', 2h, 2w]
            lrs.append(lr)
            motions.append(rec.motion[:, c0:e1])
            audios.append(rec.audio[:, c0:e1])
        states = [state for _, state in items]
        text, text_mask = batch_text(states)
        cond = DiTCondition(motion=torch.cat(motions, 0), audio=torch.cat(audios, 0), text=text,
                            text_mask=text_mask, t_pos=torch.arange(lrs[0].shape[2], dtype=torch.float32))
        ref = ReferenceCache.stack([s.refiner_reference for s in states])
        hr = self.refiner.call("refine", torch.cat(lrs, 0), torch.cat(noises, 0), cond, ref,
                               sigma=self.sigma)
        for i, (rec, state) in enumerate(items):
            c0, e0, _ = self.span(rec)
            rec.hr_latents = hr[i : i + 1, :, e0 - c0 :].float()  # [1, C, E, 2h, 2w]
            state.store.put(rec.plan, rec.lr_latents, rec.motion, rec.hr_latents)
