"""The identity-aware super-resolution refiner (`stage = "sr"`): one Euler step from σ = 0.6 that
turns upsampled LR latents into HR ones, given an HR reference.
"""

from __future__ import annotations

import torch

from avatarstream.models.refiner import SRRefiner, upsample2x
from avatarstream.models.transformer import DiTCondition
from avatarstream.train.data import motion_descriptor
from avatarstream.train.objectives.latent import LatentTask


class SRTask(LatentTask):
    """Super-resolution refiner, one step from σ = 0.6: `x = (1 − σ) up(lr') + σ ε` with lr' the
    window's LR latents plus N(0, lr_noise²) (a stand-in for the DiT's errors), `x0̂ = x − σ v̂`,
    loss = mouth/eye-weighted MSE(x0̂, HR latents). σ jitters in ±sigma_jitter with prob
    p_sigma_jitter (robustness); audio/text encoders are frozen (from `[init]`, e.g. an a2v run);
    motion tokens are the clean motion descriptor (what the DiT outputs at inference)."""

    stage = "sr"
    trainable = ("refiner",)

    def uses(self) -> tuple[str, ...]:
        return ("refiner", "audio", "text")

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c, B, T = self.cfg, self.recipe["train"]["batch"], self.T
        ref_net: SRRefiner = self.nets["refiner"]
        clips, starts, lr, hr, mot, refs, valids = [], [], [], [], [], [], []
        for _ in range(B):
            i, p0 = self.window(g)
            clips.append(i)
            starts.append(p0)
            lr.append(self.data.latents(i, p0, T))
            hr.append(self.data.latents(i, p0, T, hr=True))
            mot.append(motion_descriptor(self.data.table(i), torch.arange(p0, p0 + T), self.motion_dim))
            lat, valid, _, _ = self.reference(g, i, hr=True, p_cross=1.0)
            refs.append(lat)
            valids.append(valid)
        lr_t = torch.stack(lr).to(self.device)
        hr_t = torch.stack(hr).to(self.device)
        sig = torch.full((B,), float(c["sigma"]))
        jit = torch.rand(B, generator=g) < c["p_sigma_jitter"]
        sig = torch.where(jit, sig + (2 * torch.rand(B, generator=g) - 1) * c["sigma_jitter"], sig)
        sig = sig.clamp(0.05, 0.95).to(self.device)
        lr_in = lr_t + c["lr_noise"] * self.randn(g, *lr_t.shape)
        up = upsample2x(lr_in)
        eps = self.randn(g, *hr_t.shape)
        s5 = sig[:, None, None, None, None]
        x = (1 - s5) * up + s5 * eps
        with torch.no_grad():
            audio = self.audio_tokens(self.nets["audio"], clips, starts, torch.zeros(B, dtype=torch.bool))
            text, tmask = self.text_tokens(self.nets["text"], g, clips)
        ref_lat = torch.stack(refs).to(self.device)
        t_ref = torch.full((ref_lat.shape[2],), float(c["ref_t_position"]))
        ref = ref_net.encode_reference(ref_lat, torch.stack(valids).to(self.device), t_ref)
        cond = DiTCondition(motion=torch.stack(mot).to(self.device), audio=audio, text=text,
                            text_mask=tmask, t_pos=torch.arange(T, dtype=torch.float32, device=self.device))
        v = ref_net(x, up, sig[:, None].expand(B, T), cond, ref).float()
        x0 = x - s5 * v
        w = self.latent_weight(clips, starts, hr_t.shape[-1])
        loss = ((x0 - hr_t).square() * w).mean()
        base = (up - hr_t).square().mean()
        return loss, {"loss": float(loss.detach()), "upsample_mse": float(base), "sigma": float(sig.mean())}
