"""The one guided denoiser (k-diffusion's `external.py` habit): everything between a sampler's
`denoise(x, sigma)` and the DiT's forward, for a batch of chunks.

- the sampler's state is one flat tensor per row: latents and motion tokens packed (`pack`);
- the frame-conditioning mask: given frames are held clean (σ = 0 in, velocity 0 out);
- guidance: a CFG-distilled DiT gets the (audio, reference) scales as inputs of one pass; any other
  DiT is guided from the streams its training dropped (`guided_velocity`).

The engine's prefix/interp denoising (`AudioToVideoStage`, a file render being a batch of one, a
round of live sessions a batch of many) and the CFG-distillation target in training call this
module; the causal strategy's block loop (`engine/causal.py`) uses its packing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from avatarstream.models.transformer import DiTCondition

Velocity = Callable[[torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]


def pack(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Latents [B,C,T,h,w] and motion [B,T,Dm] as one flat state [B, N] for the samplers."""
    return torch.cat([x.flatten(1), m.flatten(1)], dim=1)


def unpack(flat: torch.Tensor, x_shape: torch.Size, m_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    n = x_shape[1:].numel()
    return flat[:, :n].reshape(x_shape), flat[:, n:].reshape(m_shape)


def guided_velocity(velocity: Velocity, audio: torch.Tensor, ref: Any, cfg: tuple[float, float] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, motion v) of `velocity(audio_tokens, reference)` with classifier-free guidance on the
    streams the DiT was trained to drop (a2v `p_drop_audio`: zero audio tokens; `p_drop_ref`: no
    reference), the same combination CFG distillation learns:

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


def guidance_tensor(scales: tuple[float, float] | None, batch: int,
                    device: torch.device | str = "cpu") -> torch.Tensor | None:
    """`[batch, 2]` (audio, reference) scales for `DiTCondition.guidance`, or None."""
    if scales is None:
        return None
    return torch.tensor([scales], dtype=torch.float32, device=device).expand(batch, 2)


class Guidance:
    """How a DiT is guided: `scales` (audio, reference) or None, and whether the DiT is
    CFG-distilled (`distilled`: the scales are its input, one pass) or guided by CFG passes."""

    def __init__(self, scales: tuple[float, float] | None, *, distilled: bool) -> None:
        self.distilled = distilled
        self.scales = scales if distilled else None  # the distilled DiT's input
        self.cfg = None if distilled or scales is None else (float(scales[0]), float(scales[1]))

    def input_for(self, batch: int) -> torch.Tensor | None:
        """The distilled DiT's guidance input `[B, 2]`, or None."""
        return guidance_tensor(self.scales, batch)


class GuidedDenoiser:
    """`denoise(flat, sigma) -> flat velocity` of a batch of chunks for the samplers.

    x `[B, C, T, h, w]` and m `[B, T, Dm]`: the initial state with the given frames' clean latents
    and motion already in place; given `[B, T]` bool. `forward(x, sigma [B, T], cond, reference)` is
    the DiT's forward (a `Module.call`); cond carries text, audio tokens, anchor, positions."""

    def __init__(self, forward: Callable[..., Any], x: torch.Tensor, m: torch.Tensor, given: torch.Tensor,
                 *, audio: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor | None,
                 reference: Any, anchor: torch.Tensor | None, guidance: Guidance) -> None:
        self.forward = forward
        self.x_shape, self.m_shape = x.shape, m.shape
        self.given = given
        self.gx = given[:, None, :, None, None].expand_as(x)  # [B, C, T, h, w]
        self.gm = given[:, :, None].expand_as(m)  # [B, T, Dm]
        self.x_clean, self.m_clean = x.clone(), m.clone()
        self.audio, self.text, self.text_mask = audio, text, text_mask
        self.reference, self.anchor = reference, anchor
        self.guidance = guidance
        self.guidance_input = guidance.input_for(x.shape[0])  # [B, 2] or None, once per batch
        self.t_pos = torch.arange(x.shape[2], dtype=torch.float32)  # chunk-local positions

    def initial(self) -> torch.Tensor:
        return pack(self.x_clean, self.m_clean)

    def clamp(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, m) of a flat state with the given frames clean."""
        xs, ms = unpack(flat, self.x_shape, self.m_shape)
        return torch.where(self.gx, self.x_clean, xs), torch.where(self.gm, self.m_clean, ms)

    def __call__(self, flat: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        xs, ms = self.clamp(flat)
        sig = torch.full(self.given.shape, float(sigma)).masked_fill(self.given, 0.0)  # [B, T]

        def velocity(tokens: torch.Tensor, reference: Any) -> tuple[torch.Tensor, torch.Tensor]:
            cond = DiTCondition(motion=ms, audio=tokens, text=self.text, text_mask=self.text_mask,
                                t_pos=self.t_pos, guidance=self.guidance_input, anchor=self.anchor)
            out = self.forward(xs, sig, cond, reference)
            return out.velocity.float(), out.motion_velocity.float()

        v, mv = guided_velocity(velocity, self.audio, self.reference, self.guidance.cfg)
        return pack(v.masked_fill(self.gx, 0.0), mv.masked_fill(self.gm, 0.0))
