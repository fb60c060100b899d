"""CFG distillation (`stage = "cfg-distill"`, Avatar V sec. 3.4): the audio and reference guidance
streams folded into one forward pass that takes the two scales as inputs.
"""

from __future__ import annotations

from typing import Any

import torch

from avatarstream.engine.denoiser import guided_velocity
from avatarstream.errors import ConfigError
from avatarstream.models.dit import VideoRefDiT
from avatarstream.train.nets import dit_config
from avatarstream.train.objectives.a2v import A2VTask
from avatarstream.train.objectives.latent import LatentTask


class CFGDistillTask(A2VTask):
    """CFG distillation (Avatar V sec. 3.4): fold the audio and reference guidance streams into one
    forward pass. Teacher = the DiT of `init.dit` (frozen), student = the same weights (trained);
    audio and text encoders frozen (from `init`). Per batch the teacher runs three streams,
    full `v(a, r)`, audio dropped `v(∅, r)`, both dropped `v(∅, ∅)`, and the target is

        v_cfg = v(∅, ∅) + ref_scale · (v(∅, r) − v(∅, ∅)) + audio_scale · (v(a, r) − v(∅, r))

    (same for the motion velocity: the engine's `guided_velocity`, which a guided DiT samples
    with); loss = weighted MSE(student v(a, r), v_cfg) + motion ·
    MSE(motion). With `guidance_input` (default) the scales are the student's inputs: drawn per
    sample from [audio_scale_min, audio_scale_max] x [ref_scale_min, ref_scale_max] and given to
    it as `DiTCondition.guidance`, so one forward pass serves any scale at inference (the engine's
    `--audio-scale` / `--ref-scale`; `audio_scale` / `ref_scale` are the exported defaults).
    Without it the scales are fixed per run. The student's guidance embedding starts at zero, so
    it starts as the teacher. The teacher must have been trained with audio/reference dropout
    (a2v `p_drop_audio`, `p_drop_ref`)."""

    stage = "cfg-distill"
    trainable = ("dit",)

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        if not recipe["init"]["dit"]:
            raise ConfigError("the cfg-distill recipe needs init.dit (the a2v run or weights to distill)")
        LatentTask.__init__(self, recipe, device)
        c = recipe["cfg-distill"]
        p = [c["p_ref2v"], c["p_prefix"], c["p_interp"]]
        self.mode_p = torch.tensor(p, dtype=torch.float64) / max(sum(p), 1e-9)
        self.nets["teacher"] = VideoRefDiT(dit_config(recipe["model"], self.direct))

    def uses(self) -> tuple[str, ...]:
        return ("dit", "audio", "text")

    def after_init(self) -> None:
        with torch.no_grad():  # the student starts as the teacher, whatever the scales
            self.nets["dit"].guidance_embedding[2].weight.zero_()
            self.nets["dit"].guidance_embedding[2].bias.zero_()
        self.nets["teacher"].load_state_dict(self.nets["dit"].state_dict())

    def scales(self, g: torch.Generator, batch: int) -> torch.Tensor:
        """`[B, 2]` (audio, reference) guidance scales of a step's samples."""
        c = self.cfg
        if not c["guidance_input"]:
            return torch.tensor([[c["audio_scale"], c["ref_scale"]]]).expand(batch, 2)
        u = torch.rand(batch, 2, generator=g)
        lo = torch.tensor([c["audio_scale_min"], c["ref_scale_min"]])
        hi = torch.tensor([c["audio_scale_max"], c["ref_scale_max"]])
        return lo + u * (hi - lo)

    def teacher_target(self, b: dict[str, Any], s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(v_cfg `[B,C,T,h,w]`, motion v_cfg `[B,T,Dm]`, the teacher's full v(a, r)) for scales s
        `[B, 2]`: the engine's guided combination (`engine.denoiser.guided_velocity`) row by row,
        over the teacher's streams run once for the batch, the unguided one only if a row's
        reference scale is not 1."""
        streams: dict[tuple[bool, bool], Any] = {}

        def stream(audio: bool, ref: bool) -> Any:  # DiTOutput of the teacher, whole batch
            if (audio, ref) not in streams:
                streams[audio, ref] = self.predict(self.nets["teacher"], b, audio=audio, ref=ref)[0]
            return streams[audio, ref]

        rows = []
        for i, (sa, sr) in enumerate(s.tolist()):
            audio = torch.zeros(1)  # stands for the row's audio tokens (guided_velocity zeroes a copy)

            def velocity(tokens: torch.Tensor, reference: Any, i: int = i, audio: torch.Tensor = audio
                         ) -> tuple[torch.Tensor, torch.Tensor]:
                out = stream(tokens is audio, reference is not None)
                return out.velocity[i:i + 1].float(), out.motion_velocity[i:i + 1].float()

            rows.append(guided_velocity(velocity, audio, "reference", (sa, sr)))
        return (torch.cat([v for v, _ in rows]), torch.cat([mv for _, mv in rows]),
                stream(True, True).velocity.float())

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        b = self.batch(g)
        s = self.scales(g, b["xs"].shape[0]).to(self.device)  # [B, 2]
        with torch.no_grad():
            v_cfg, mv_cfg, full = self.teacher_target(b, s)
        out, _ = self.predict(self.nets["dit"], b, guidance=s if c["guidance_input"] else None)
        loss_v, loss_m = self.flow_losses(b, out.velocity, out.motion_velocity, v_cfg, mv_cfg)
        total = loss_v + c["motion"] * loss_m
        gap = (full - v_cfg).square().mean()
        return total, {"loss": float(total.detach()), "flow": float(loss_v.detach()),
                       "motion": float(loss_m.detach()), "teacher_gap": float(gap),
                       "sigma": float(b["sig"].mean())}
