"""CausalDenoiseStage: one block of the `causal` strategy through every denoising step
(Algorithm 3 of Live Avatar), with the rolling KV caches, the Rolling Sink Frame and timestep
forcing of `engine/causal.py`.

The chunk of a block holds the block's frames plus the previous block's last latent as a given
frame (SR context only): the DiT denoises the block's frames, the given frame is copied in from
the rolling store so the SR stage reads a complete chunk.
"""

from __future__ import annotations

import torch

from avatarstream.engine.causal import CausalDenoiser, CausalSettings
from avatarstream.engine.stages.audio_to_video import scene_anchor
from avatarstream.engine.module import Module
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.samplers import flow_sigmas


def block_noise(rec: ChunkRecord) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The block's initial noise (latents `[1, C, Tb, h, w]`, motion `[1, Tb, Dm]`), its frame
    indices in the chunk and their timeline positions."""
    idx = [i for i, g in enumerate(rec.plan.given_mask()) if not g]
    x = rec.sigma_noise[:, :, idx].clone()
    m = rec.motion_noise[:, idx].clone()
    return x, m, idx, [rec.plan.positions[i] for i in idx]


def write_block(rec: ChunkRecord, state: SessionState, idx: list[int], x: torch.Tensor,
                m: torch.Tensor) -> None:
    """rec.lr_latents / rec.motion: the denoised block at `idx`, given frames from the store."""
    lat = torch.zeros_like(rec.sigma_noise)
    mot = torch.zeros_like(rec.motion_noise)
    lat[:, :, idx], mot[:, idx] = x.to(lat.dtype), m.to(mot.dtype)
    for i, g_lat, g_mot in state.store.given(rec.plan):
        lat[:, :, i], mot[:, i] = g_lat, g_mot
    rec.lr_latents, rec.motion = lat, mot


def new_denoiser(dit: Module, state: SessionState, *, steps: int, shift: float,
                 settings: CausalSettings, sampler: str, overshoot: float, seed: int,
                 own_steps: list[int] | None = None) -> CausalDenoiser:
    """The session's denoiser (all steps, or a TPP worker's `own_steps`), its sink the reference."""
    den = CausalDenoiser(dit, flow_sigmas(steps, shift), settings, steps=own_steps,
                         sampler=sampler, overshoot=overshoot, seed=seed)
    den.start(state.dit_reference, scene_anchor(state))
    return den


class CausalDenoiseStage(Stage):
    name = "causal_denoise"
    reads = ("given", "audio", "sigma_noise", "motion_noise")
    writes = ("lr_latents", "motion")

    def __init__(self, dit: Module, *, steps: int, shift: float = 1.0,
                 settings: CausalSettings = CausalSettings(), sampler: str = "euler",
                 overshoot: float = 0.2, seed: int = 0) -> None:
        super().__init__()
        self.dit, self.steps, self.shift, self.settings = dit, steps, shift, settings
        self.sampler, self.overshoot, self.seed = sampler, overshoot, seed

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        if state.causal is None:
            state.causal = new_denoiser(self.dit, state, steps=self.steps, shift=self.shift,
                                        settings=self.settings, sampler=self.sampler,
                                        overshoot=self.overshoot, seed=self.seed)
        den: CausalDenoiser = state.causal
        x, m, idx, positions = block_noise(rec)
        first = den.blocks_done == 0
        x, m = den.denoise(x, m, audio=rec.audio[:, idx], text=state.text, text_mask=state.text_mask,
                           positions=positions, block=rec.plan.id)
        if first and self.settings.adaptive_sink:
            den.adaptive_attention_sink(x[:, :, :1])
        write_block(rec, state, idx, x, m)
