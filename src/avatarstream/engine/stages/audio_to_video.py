"""AudioToVideoStage: the VideoRef DiT denoises the chunk's low-resolution latents and motion
tokens jointly with a few-step sampler, given frames held clean (frame-conditioning mask)."""

from __future__ import annotations

import torch

from avatarstream.engine.module import Module
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.models.dit import DiTCondition
from avatarstream.samplers import flow_sigmas, sample_euler, sample_stochastic_euler


def pack(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Latents [B,C,T,h,w] and motion [B,T,Dm] as one flat state [B, N] for the samplers."""
    return torch.cat([x.flatten(1), m.flatten(1)], dim=1)


def unpack(flat: torch.Tensor, x_shape: torch.Size, m_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    n = x_shape[1:].numel()
    return flat[:, :n].reshape(x_shape), flat[:, n:].reshape(m_shape)


def scene_anchor(state: SessionState) -> torch.Tensor | None:
    """The scene frame's LR latent `[1, C, h, w]` (the DiT's anchor input), or None."""
    scene = state.store.scene()
    return None if scene is None else scene[0]


class AudioToVideoStage(Stage):
    name = "audio_to_video"
    reads = ("given", "audio", "sigma_noise", "motion_noise")
    writes = ("lr_latents", "motion")

    def __init__(self, dit: Module, *, steps: int, sampler: str = "euler", shift: float = 1.0,
                 overshoot: float = 0.2, seed: int = 0,
                 guidance: tuple[float, float] | None = None) -> None:
        """guidance: (audio, reference) CFG scales for a CFG-distilled DiT (one forward pass takes
        them as inputs), or None for its plain conditional prediction."""
        super().__init__()
        self.dit = dit
        self.guidance = None if guidance is None else torch.tensor([guidance], dtype=torch.float32)  # [1, 2]
        self.sigmas = flow_sigmas(steps, shift)
        self.sampler = sampler
        self.overshoot = overshoot
        self.seed = seed

    def run(self, rec: ChunkRecord, state: SessionState) -> None:
        plan = rec.plan
        x = rec.sigma_noise.clone()  # [1, C, T, h, w]
        m = rec.motion_noise.clone()  # [1, T, Dm]
        for idx, lat, mot in state.store.given(plan):
            x[:, :, idx] = lat
            m[:, idx] = mot
        given = rec.given[0]  # [T]
        x_clean, m_clean = x[:, :, given].clone(), m[:, given].clone()
        t_pos = torch.arange(plan.length, dtype=torch.float32)
        audio, text, text_mask, ref = rec.audio, state.text, state.text_mask, state.dit_reference
        anchor = scene_anchor(state)

        def denoise(flat: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            xs, ms = unpack(flat, x.shape, m.shape)
            xs, ms = xs.clone(), ms.clone()
            xs[:, :, given], ms[:, given] = x_clean, m_clean  # given frames stay clean
            sig = torch.full((1, plan.length), float(sigma))
            sig[:, given] = 0.0
            cond = DiTCondition(motion=ms, audio=audio, text=text, text_mask=text_mask, t_pos=t_pos,
                                guidance=self.guidance, anchor=anchor)
            out = self.dit.call("forward", xs, sig, cond, ref)
            v, mv = out.velocity.float(), out.motion_velocity.float()
            v[:, :, given], mv[:, given] = 0.0, 0.0
            return pack(v, mv)

        state0 = pack(x, m)
        if self.sampler == "euler":
            out = sample_euler(denoise, state0, self.sigmas)
        else:
            g = torch.Generator().manual_seed(self.seed * 7919 + plan.id)
            out = sample_stochastic_euler(denoise, state0, self.sigmas, overshoot=self.overshoot,
                                          generator=g)
        xo, mo = unpack(out, x.shape, m.shape)
        xo[:, :, given], mo[:, given] = x_clean, m_clean
        rec.lr_latents, rec.motion = xo, mo
