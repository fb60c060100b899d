"""AudioToVideoStage: the VideoRef DiT denoises the chunks' low-resolution latents and motion
tokens jointly with a few-step sampler, given frames held clean (frame-conditioning mask).

Batch-first: the chunks of B sessions with the same length run as one batch through the one
guided denoiser (`engine/denoiser.py`); reference caches of different lengths are stacked with
masked padding (`ReferenceCache.stack`, exact). A file render is a batch of one.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import partial

import torch

from avatarstream.cache.reference import ReferenceCache
from avatarstream.engine.denoiser import Guidance, GuidedDenoiser
from avatarstream.engine.module import Module
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Item, Stage
from avatarstream.samplers import flow_sigmas, sample_euler, sample_stochastic_euler


def scene_anchor(state: SessionState) -> torch.Tensor | None:
    """The scene frame's LR latent `[1, C, h, w]` (the DiT's anchor input), or None."""
    scene = state.store.scene()
    return None if scene is None else scene[0]


def batch_text(states: Sequence[SessionState]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sessions' text tokens `[B, L, Dt]` and mask `[B, L]` (None when any has none)."""
    text = torch.cat([s.text for s in states], 0)
    masks = [s.text_mask for s in states]
    return text, None if any(m is None for m in masks) else torch.cat(masks, 0)


class AudioToVideoStage(Stage):
    name = "audio_to_video"
    reads = ("given", "audio", "sigma_noise", "motion_noise")
    writes = ("lr_latents", "motion")

    def __init__(self, dit: Module, *, steps: int, sampler: str = "euler", shift: float = 1.0,
                 overshoot: float = 0.2, seed: int = 0,
                 guidance: tuple[float, float] | None = None, guidance_input: bool = False) -> None:
        """guidance: (audio, reference) CFG scales, or None for the DiT's plain conditional
        prediction. A CFG-distilled DiT (`guidance_input`) takes them as inputs of one forward
        pass; any other DiT runs classifier-free guidance on its dropout streams (see
        `guided_velocity`): two forward passes a step, three when the reference scale is not 1."""
        super().__init__()
        self.dit = dit
        self.guidance = Guidance(guidance, distilled=guidance_input)
        self.sigmas = flow_sigmas(steps, shift)
        self.sampler = sampler
        self.overshoot = overshoot
        self.seed = seed

    def batch_key(self, rec: ChunkRecord, state: SessionState) -> Hashable | None:
        return ("length", rec.plan.length)

    def denoiser(self, items: Sequence[Item]) -> GuidedDenoiser:
        """The guided denoiser of a batch of chunks: initial noise with the given frames' clean
        latents and motion in place, their audio tokens, text, references and scene anchors."""
        xs, ms = [], []
        for rec, state in items:
            x, m = rec.sigma_noise.clone(), rec.motion_noise.clone()  # [1, C, T, h, w], [1, T, Dm]
            for idx, lat, mot in state.store.given(rec.plan):
                x[:, :, idx] = lat
                m[:, idx] = mot
            xs.append(x)
            ms.append(m)
        states = [state for _, state in items]
        anchors = [scene_anchor(s) for s in states]
        text, text_mask = batch_text(states)
        return GuidedDenoiser(
            partial(self.dit.call, "forward"), torch.cat(xs, 0), torch.cat(ms, 0),
            torch.cat([rec.given for rec, _ in items], 0),  # [B, T] bool
            audio=torch.cat([rec.audio for rec, _ in items], 0),  # [B, T, A, Da]
            text=text, text_mask=text_mask,
            reference=ReferenceCache.stack([s.dit_reference for s in states]),
            anchor=None if any(a is None for a in anchors) else torch.cat(anchors, 0),  # [B, C, h, w]
            guidance=self.guidance)

    def sample(self, den: GuidedDenoiser, items: Sequence[Item]) -> torch.Tensor:
        """The sampler's run from `den.initial()`: the final flat state of the batch. (Training's
        rollouts override this to record every step: train/rollout.py.)"""
        if self.sampler == "euler":
            return sample_euler(den, den.initial(), self.sigmas)
        gens = [torch.Generator().manual_seed(self.seed * 7919 + rec.plan.id) for rec, _ in items]
        return sample_stochastic_euler(den, den.initial(), self.sigmas, overshoot=self.overshoot,
                                       generator=gens)

    def run(self, items: Sequence[Item]) -> None:
        den = self.denoiser(items)
        xo, mo = den.clamp(self.sample(den, items))
        for i, (rec, _) in enumerate(items):
            rec.lr_latents, rec.motion = xo[i : i + 1], mo[i : i + 1]
