"""Audio-to-video flow matching of the DiT (`stage = "a2v"`): pre-training and personality SFT,
in the three chunk modes the engine streams with (a driving scene frame, a prefix of given frames,
both ends given), with condition dropout so the model can be guided (classifier-free guidance).
"""

from __future__ import annotations

from typing import Any

import torch

from avatarstream.cache.reference import ReferenceCache
from avatarstream.errors import ConfigError
from avatarstream.models.dit import VideoRefDiT
from avatarstream.models.transformer import DiTCondition
from avatarstream.train.data import motion_descriptor
from avatarstream.train.nets import vae_for
from avatarstream.train.objectives.base import uniform, x0_floor_weight
from avatarstream.train.objectives.latent import LatentTask


class A2VTask(LatentTask):
    """Audio-to-video flow matching of the VideoRef DiT (+ AudioEncoder and TextEncoder trained
    jointly).

    Per element: a window of `chunk` latent frames, σ ~ logit-normal(logit_mean, logit_std)
    shared by the chunk's generated frames, a frame-conditioning mask (ref2v: frame 0 given, the
    driving scene image, when `first_frame` (else none), the window then starting at the clip's
    first latent with p_clip_start;
    prefix2v: the first `overlap`; interpolation: first and last) whose given frames are clean
    (σ = 0) and excluded from the loss, a cross-scene reference (see `reference`), condition
    dropout for classifier-free guidance (audio tokens zeroed with p_drop_audio, every reference
    key masked with p_drop_ref — the same as no reference — and the empty prompt with
    p_empty_text). Personality SFT is this task with `p_cross_scene = 1` started from a
    pre-training run (`[init]`).
    Loss = weighted MSE(v̂, ε − x0) over generated frames (mouth/eye-weighted)
         + motion · MSE(motion velocity, ε_m − m0) over generated frames
         + ref_motion · MSE(reference motion tokens, reference motion descriptor) over valid frames.
    """

    stage = "a2v"
    block_units = True  # a same-calls loss: `encode_reference` below

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        c = recipe["a2v"]
        t = ["dit"]
        if c["train_audio"]:
            t.append("audio")
        if c["train_text"]:
            t.append("text")
        self.trainable = tuple(t)
        super().__init__(recipe, device)
        p = [c["p_ref2v"], c["p_prefix"], c["p_interp"]]
        if min(p) < 0 or sum(p) <= 0:
            raise ConfigError("a2v: p_ref2v, p_prefix, p_interp must be >= 0 with a positive sum")
        if self.T < max(3, c["overlap"] + 1):
            raise ConfigError("a2v: chunk must exceed overlap and be at least 3")
        self.mode_p = torch.tensor(p, dtype=torch.float64) / sum(p)
        self.human = None
        if c["human_sync"] > 0 or c["human_identity"] > 0:
            from avatarstream.train.human import HumanLoss

            if c["human_context"] < 1:
                raise ConfigError("a2v: human_context must be at least 1 (the decoder needs the window's past)")
            if not self.data.vae_state:
                raise ConfigError(f"{recipe['data']['prepared']}: no VAE inside (needed by human_sync/"
                                  "human_identity); re-run `avatarstream train prepare`")
            vae = vae_for(recipe["model"], self.data.vae_state)
            self.human = HumanLoss(vae.to(device), context=c["human_context"])

    def uses(self) -> tuple[str, ...]:
        return ("dit", "audio", "text")

    def given_mask(self, g: torch.Generator) -> tuple[torch.Tensor, int]:
        mode = int(torch.multinomial(self.mode_p, 1, generator=g))
        m = torch.zeros(self.T, dtype=torch.bool)
        if mode == 0 and self.cfg["first_frame"]:
            m[0] = True  # the driving scene image (Avatar V's I2V first chunk)
        elif mode == 1:
            m[: self.cfg["overlap"]] = True
        elif mode == 2:
            m[0] = m[-1] = True
        return m, mode

    def batch(self, g: torch.Generator) -> dict[str, Any]:
        """Everything one step needs, drawn from g: clean latents `x0 [B,C,T,h,w]`, motion
        `m0 [B,T,Dm]`, noisy `xs`, `ms`, noise `eps`, `eps_m`, `sigma [B,T]`, `given [B,T]`,
        audio tokens `[B,T,A,Da]` (zeroed rows: dropped audio), text tokens/mask, reference
        latents `[B,C,R,h,w]`, `ref_valid [B,R]` (all False: dropped reference), descriptors."""
        c, B, T = self.cfg, self.recipe["train"]["batch"], self.T
        clips, starts, x0, m0, given, refs, valids, ref_mot, cross = [], [], [], [], [], [], [], [], 0
        for _ in range(B):
            i, p0 = self.window(g)
            gm, mode = self.given_mask(g)
            if mode == 0 and c["first_frame"] and uniform(g) < c["p_clip_start"]:
                p0 = 0  # the scene frame is then a one-image latent, as the engine encodes it
            clips.append(i)
            starts.append(p0)
            x0.append(self.data.latents(i, p0, T))
            m0.append(motion_descriptor(self.data.table(i), torch.arange(p0, p0 + T), self.motion_dim))
            given.append(gm)
            lat, valid, mot, cr = self.reference(g, i, hr=False, p_cross=c["p_cross_scene"])
            refs.append(lat)
            valids.append(valid)
            ref_mot.append(mot)
            cross += int(cr)
        b: dict[str, Any] = {"clips": clips, "starts": starts, "cross": cross / B}
        b["x0"] = x0t = torch.stack(x0).to(self.device)
        b["m0"] = m0t = torch.stack(m0).to(self.device)
        b["given"] = given_t = torch.stack(given).to(self.device)
        u = torch.randn(B, generator=g) * c["logit_std"] + c["logit_mean"]
        b["sig"] = sig = torch.sigmoid(u).to(self.device)  # [B] logit-normal
        b["sigma"] = sigma = sig[:, None].expand(B, T).masked_fill(given_t, 0.0)  # [B, T]
        b["eps"] = eps = self.randn(g, *x0t.shape)
        b["eps_m"] = eps_m = self.randn(g, *m0t.shape)
        s5 = sigma[:, None, :, None, None]
        b["xs"] = (1 - s5) * x0t + s5 * eps
        b["ms"] = (1 - sigma[..., None]) * m0t + sigma[..., None] * eps_m
        drop_a = torch.rand(B, generator=g) < c["p_drop_audio"]
        drop_r = torch.rand(B, generator=g) < c["p_drop_ref"]
        grad = torch.enable_grad() if "audio" in self.trainable else torch.no_grad()
        with grad:
            b["audio"] = self.audio_tokens(self.nets["audio"], clips, starts, drop_a)
        with torch.enable_grad() if "text" in self.trainable else torch.no_grad():
            b["text"], b["text_mask"] = self.text_tokens(self.nets["text"], g, clips)
        b["ref_lat"] = torch.stack(refs).to(self.device)
        b["ref_valid"] = (torch.stack(valids) & ~drop_r[:, None]).to(self.device)
        b["ref_mot"] = torch.stack(ref_mot).to(self.device)
        b["weight"] = self.latent_weight(clips, starts, x0t.shape[-1])  # [B, 1, T, h, w]
        b["anchor"] = self.scene_anchor(clips)
        return b

    def predict(self, dit: VideoRefDiT, b: dict[str, Any], *, audio: bool = True, ref: bool = True,  # type: ignore[no-untyped-def]
                guidance: torch.Tensor | None = None):
        """(DiTOutput, ReferenceCache | None) of `dit` on batch b, with the audio and/or reference
        stream dropped for every element when asked (CFG streams); guidance `[B, 2]`: the CFG
        scales of a distilled student."""
        c, T = self.cfg, self.T
        cache = None
        if ref:
            t_ref = torch.full((b["ref_lat"].shape[2],), float(c["ref_t_position"]))
            cache = self.encode_reference(dit, b["ref_lat"], b["ref_valid"], t_ref)
        tok = b["audio"] if audio else torch.zeros_like(b["audio"])
        cond = DiTCondition(motion=b["ms"], audio=tok, text=b["text"], text_mask=b["text_mask"],
                            t_pos=torch.arange(T, dtype=torch.float32, device=self.device), guidance=guidance,
                            anchor=b["anchor"])
        return dit(b["xs"], b["sigma"], cond, cache), cache

    def encode_reference(self, dit: VideoRefDiT, lat: torch.Tensor, valid: torch.Tensor,
                         t_ref: torch.Tensor) -> ReferenceCache:
        """`dit.encode_reference`. Where every element's reference is dropped it runs no block (no
        frame is left), which under per-block FSDP2 (`same_calls`) would leave this rank with fewer
        block calls, so fewer collectives, than another rank: there the pass also runs on the first
        frame, and its outputs go to `masked`, which the wrapper adds to the loss times 0 (the
        loss, the attention and every gradient stay those of one process, bit for bit)."""
        cache = dit.encode_reference(lat, valid, t_ref)
        if self.same_calls and cache.num_frames == 0:
            unused = dit.encode_reference(lat[:, :, :1], None, t_ref[:1])
            self.masked += [*unused.k, *unused.v, unused.motion]
        return cache

    def flow_losses(self, b: dict[str, Any], v: torch.Tensor, mv: torch.Tensor, v_target: torch.Tensor,
                    mv_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mouth/eye-weighted MSE of v `[B,C,T,h,w]` and MSE of mv `[B,T,Dm]` over generated
        frames (an `x0_skip` DiT's weighted by `x0_floor_weight`)."""
        gen = (~b["given"]).float()  # [B, T]
        w = b["weight"] * gen[:, None, :, None, None] * x0_floor_weight(b["sigma"], self.nets["dit"].config.x0_skip)
        loss_v = ((v.float() - v_target).square() * w).sum() / (w.sum() * v.shape[1]).clamp_min(1)
        m_err = (mv.float() - mv_target).square().mean(-1)
        return loss_v, (m_err * gen).sum() / gen.sum().clamp_min(1)

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        b = self.batch(g)
        out, cache = self.predict(self.nets["dit"], b)
        loss_v, loss_m = self.flow_losses(b, out.velocity, out.motion_velocity, b["eps"] - b["x0"],
                                          b["eps_m"] - b["m0"])
        valid = b["ref_valid"]
        keep = valid.any(0)  # frames encode_reference kept
        rv = valid[:, keep].float()
        if cache is not None and cache.motion.shape[1] > 0:
            rm_err = (cache.motion.float() - b["ref_mot"][:, keep]).square().mean(-1)
            loss_rm = (rm_err * rv).sum() / rv.sum().clamp_min(1)
        else:
            loss_rm = torch.zeros((), device=self.device)
        total = loss_v + c["motion"] * loss_m + c["ref_motion"] * loss_rm
        logs = {"loss": 0.0, "flow": float(loss_v.detach()), "motion": float(loss_m.detach()),
                "ref_motion": float(loss_rm.detach()), "sigma": float(b["sig"].mean()), "cross_scene": b["cross"]}
        if self.human is not None and uniform(g) < c["p_human"]:
            sync, ident = self.human_losses(b, out.velocity)
            total = total + c["human_sync"] * sync + c["human_identity"] * ident
            logs.update(human_sync=float(sync.detach()), human_identity=float(ident.detach()))
        logs["loss"] = float(total.detach())
        return total, logs

    def human_losses(self, b: dict[str, Any], v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert losses (train/human.py) on the batch's first element: its clean estimate
        x̂0 = x_σ − σ·v̂ decoded after up to `human_context` clean latents of the same clip."""
        i, p0 = b["clips"][0], b["starts"][0]
        s5 = b["sigma"][:1, None, :, None, None]
        x0_hat = b["xs"][:1] - s5 * v[:1].float()
        k = min(self.cfg["human_context"], p0)
        ctx = self.data.latents(i, p0 - k, k)[None].to(self.device) if k > 0 else None
        return self.human(x0_hat, b["x0"][:1], ctx, p0, self.data.wave_of(i))
