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


def guided_velocity(velocity, audio: torch.Tensor, ref, cfg: tuple[float, float] | None  # type: ignore[no-untyped-def]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, motion v) of `velocity(audio_tokens, reference)` with classifier-free guidance on the
    streams the DiT was trained to drop (a2v `p_drop_audio`: zero audio tokens; `p_drop_ref`: no
    reference), the same combination CFG distillation learns (train/tasks.py CFGDistillTask):

        v = v(∅, ∅) + ref_scale · (v(∅, r) − v(∅, ∅)) + audio_scale · (v(a, r) − v(∅, r))

    cfg None: the plain v(a, r), one pass. Reference scale 1 skips the v(∅, ∅) pass."""
    full = velocity(audio, ref)
    if cfg is None:
        return full
    sa, sr = cfg
    no_a = velocity(torch.zeros_like(audio), ref)
    base = no_a
    if sr != 1.0:
        none = velocity(torch.zeros_like(audio), None)
        base = tuple(n + sr * (r - n) for r, n in zip(no_a, none))  # type: ignore[assignment]
    return tuple(b + sa * (f - r) for f, r, b in zip(full, no_a, base))  # type: ignore[return-value]


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
        self.distilled = guidance_input
        scales = None if guidance is None else torch.tensor([guidance], dtype=torch.float32)  # [1, 2]
        self.guidance = scales if self.distilled else None  # the distilled DiT's input
        self.cfg = None if self.distilled or guidance is None else (float(guidance[0]), float(guidance[1]))
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

            def velocity(tokens: torch.Tensor, reference):  # type: ignore[no-untyped-def]
                cond = DiTCondition(motion=ms, audio=tokens, text=text, text_mask=text_mask, t_pos=t_pos,
                                    guidance=self.guidance, anchor=anchor)
                out = self.dit.call("forward", xs, sig, cond, reference)
                return out.velocity.float(), out.motion_velocity.float()

            v, mv = guided_velocity(velocity, audio, ref, self.cfg)
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
