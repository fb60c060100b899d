"""Diffusion forcing (`stage = "df"`, Live Avatar stage 1): pre-training of the causal student
from the bidirectional model. A window of `chunk` latent frames cut into blocks of `block`, every
block noised at its own σ (block-wise independent noise; with prob `p_shared_sigma` one σ for all
blocks, the regime timestep forcing streams in), one pass with the block-causal mask
(`VideoRefDiT.forward_block_causal`: a block sees itself and the previous `history` blocks, and
the sink), flow-matching loss on every frame.
"""

from __future__ import annotations

import torch

from avatarstream.engine.denoiser import guidance_tensor
from avatarstream.models.transformer import DiTCondition
from avatarstream.train.objectives.base import x0_floor_weight
from avatarstream.train.objectives.causal import CausalTask


class DiffusionForcingTask(CausalTask):
    """Stage 1: block-wise independent noise, block-causal mask (see the module docstring).
    Loss = mouth/eye-weighted MSE(v̂, ε − x0) + motion · MSE(motion velocity)."""

    stage = "df"
    trainable = ("dit",)

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c, B, T, blk = self.cfg, self.recipe["train"]["batch"], self.T, self.cfg["block"]
        b = self.conditions(g)
        u = torch.randn(B, self.blocks, generator=g) * c["logit_std"] + c["logit_mean"]
        shared = torch.rand(B, generator=g) < c["p_shared_sigma"]
        u = torch.where(shared[:, None], u[:, :1].expand_as(u), u)
        sig = torch.sigmoid(u).repeat_interleave(blk, dim=1).to(self.device)  # [B, T] per block
        eps = self.randn(g, *b["x0"].shape)
        eps_m = self.randn(g, *b["m0"].shape)
        s5 = sig[:, None, :, None, None]
        xs = (1 - s5) * b["x0"] + s5 * eps
        ms = (1 - sig[..., None]) * b["m0"] + sig[..., None] * eps_m
        cond = DiTCondition(motion=ms, audio=b["audio"], text=b["text"], text_mask=b["text_mask"],
                            t_pos=torch.arange(T, dtype=torch.float32, device=self.device), anchor=b["anchor"],
                            guidance=guidance_tensor(self.guidance, B, self.device))
        pos, index = self.sink_index()
        sinks = [(b["ref_lat"], b["ref_valid"], p) for p in pos]
        out = self.nets["dit"].forward_block_causal(xs, sig, cond, sinks, index, block=blk,
                                                    history=c["history"])
        w = self.latent_weight(b["clips"], b["starts"], b["x0"].shape[-1])  # [B, 1, T, h, w]
        w = w * x0_floor_weight(sig, self.nets["dit"].config.x0_skip)
        loss_v = ((out.velocity.float() - (eps - b["x0"])).square() * w).mean()
        loss_m = (out.motion_velocity.float() - (eps_m - b["m0"])).square().mean()
        total = loss_v + c["motion"] * loss_m
        return total, {"loss": float(total.detach()), "flow": float(loss_v.detach()),
                       "motion": float(loss_m.detach()), "sigma": float(sig.mean())}
