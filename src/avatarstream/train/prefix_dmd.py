"""Distribution matching distillation of a *bidirectional* few-step student that streams with the
`prefix` strategy (`[dmd] strategy = "prefix"`): the same three networks and the same DMD gradient
as the causal student's Self-Forcing DMD (train/causal_tasks.py), with the rollout the engine's
prefix chunks make.

Why: flow matching's regression alone leaves a few-step sampler's prediction at the mean of the
mouth openings the audio allows (blurred, streaked open mouths; lip sync at about half of ground
truth's). DMD moves each sample toward where the teacher's (guided) distribution puts mass and away
from where the student's own distribution does — a mode-seeking objective. The causal student
trained this way scored higher lip sync than its own teacher; this task gives the bundled prefix
model the same objective without changing how it streams.

Rollout (`prefix_rollout`, no gradients but the exit step's): the window of `chunk` latent frames is
`n` prefix chunks of `prefix_chunk` frames, each after the first overlapping its predecessor by
`overlap` frames, exactly as `PrefixSchedule` lays them out. Chunk 0 is given the ground-truth
latents of its first `overlap` frames; chunk k > 0 is given the last `overlap` frames the student
itself produced for chunk k − 1 (self-forcing: the student learns from the history it streams
with, not from ground truth). Each chunk runs the engine's sampler (`AudioToVideoStage`: Euler on
`flow_sigmas(steps, shift)`, given frames at σ = 0 with zero velocity, chunk RoPE positions 0..P−1,
guidance scales as the CFG-distilled DiT's inputs) and exits at step s (drawn once per iteration):
the exit step keeps its graph, and its x̂0 is the chunk's sample. The rollout with s = steps − 1 is
what the engine produces from the same noise (tested).

The real and fake scores judge the window as `SelfForcingDMDTask._score_velocity` does (pieces of
`score_window` frames, each led by a clean frame: the bidirectional model's training regime); the
first `overlap` frames (ground truth, not the student's) are neither scored nor trained on by the
fake score. Chunks' graphs are independent (each is given the detached output of the one before),
so one backward over the exit steps of all chunks is the whole gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from avatarstream.engine.causal import guidance_tensor
from avatarstream.errors import ConfigError
from avatarstream.models.dit import DiTCondition, VideoRefDiT
from avatarstream.train.causal_tasks import SelfForcingDMDTask


class PrefixDMDTask(SelfForcingDMDTask):
    """DMD of a bidirectional student rolled out in prefix chunks (see the module docstring)."""

    blockwise = False

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        super().__init__(recipe, device)
        c = self.cfg
        P, o = c["prefix_chunk"], c["overlap"]
        if not (P >= 2 and 1 <= o < P) or self.T < P or (self.T - P) % (P - o):
            raise ConfigError(f"dmd (prefix): chunk ({self.T}) must be prefix_chunk ({P}) plus a whole number "
                              f"of prefix_chunk - overlap ({P - o}), with 1 <= overlap < prefix_chunk")
        if c["block_start"] or c["adaptive_sink"] or c["history_corrupt"] or c["history_level"] != "same":
            raise ConfigError("dmd (prefix): block_start, adaptive_sink, history_corrupt and history_level belong "
                              "to the causal strategy; set them to 0 / false / \"same\"")
        self.chunks = 1 + (self.T - P) // (P - o)

    def chunk_slices(self) -> list[slice]:
        """The window's prefix chunks, as `PrefixSchedule` lays them out."""
        P, o = self.cfg["prefix_chunk"], self.cfg["overlap"]
        return [slice(k * (P - o), k * (P - o) + P) for k in range(self.chunks)]

    def _step(self, gen: VideoRefDiT, x: torch.Tensor, m: torch.Tensor, gen_mask: torch.Tensor, sigma: float,
              b: dict[str, Any], sl: slice, ref: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(x̂0, m̂0) of one chunk at `sigma`: given frames (gen_mask 0) at σ = 0 with zero velocity,
        as `AudioToVideoStage` runs the DiT."""
        B, P = x.shape[0], x.shape[2]
        sig = sigma * gen_mask[None].expand(B, P)
        cond = DiTCondition(motion=m, audio=b["audio"][:, sl], text=b["text"], text_mask=b["text_mask"],
                            t_pos=torch.arange(P, dtype=torch.float32, device=self.device), anchor=b["anchor"],
                            guidance=guidance_tensor(self.guidance, B, self.device))
        out = gen(x, sig, cond, ref)
        v = out.velocity.float() * gen_mask[None, None, :, None, None]
        mv = out.motion_velocity.float() * gen_mask[None, :, None]
        return x - sigma * v, m - sigma * mv

    def prefix_rollout(self, b: dict[str, Any], s: int, g: torch.Generator, *, grad: bool = False,
                       noise: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, Any]:
        """x̂0 `[B,C,T,h,w]` and m̂0 `[B,T,Dm]` of the window (chunk by chunk, overlaps taken from the
        later chunk, the first `overlap` frames the ground truth); `grad`: the exit steps keep their
        graphs. `noise` (tests): each chunk's initial latents and motion (given frames overwritten)."""
        c, o = self.cfg, self.cfg["overlap"]
        gen: VideoRefDiT = self.nets["dit"]
        B, C, _, h, w = b["x0"].shape
        P = c["prefix_chunk"]
        sig = [float(v) for v in self.sigmas]
        gen_mask = torch.ones(P, device=self.device)
        gen_mask[:o] = 0.0
        with torch.enable_grad() if grad else torch.no_grad():
            ref = gen.encode_reference(b["ref_lat"], b["ref_valid"],
                                       torch.full((b["ref_lat"].shape[2],), float(c["ref_t_position"])))
        given_x, given_m = b["x0"][:, :, :o], b["m0"][:, :o]
        xs, ms = [given_x], [given_m]
        for k, sl in enumerate(self.chunk_slices()):
            if noise is None:
                x, m = self.randn(g, B, C, P, h, w), self.randn(g, B, P, self.motion_dim)
            else:
                x, m = (t.clone() for t in noise[k])
            x[:, :, :o], m[:, :o] = given_x.detach(), given_m.detach()
            for j in range(s + 1):
                with torch.enable_grad() if (grad and j == s) else torch.no_grad():
                    x0, m0 = self._step(gen, x, m, gen_mask, sig[j], b, sl, ref)
                if j < s:  # Euler to the next σ (x̂0 at σ_next = 0)
                    x = x0 + sig[j + 1] * (x - x0) / sig[j]
                    m = m0 + sig[j + 1] * (m - m0) / sig[j]
            xs.append(x0[:, :, o:])
            ms.append(m0[:, o:])
            given_x, given_m = x0[:, :, P - o:].detach(), m0[:, P - o:].detach()
        return {"x0_all": torch.cat(xs, dim=2), "m0_all": torch.cat(ms, dim=1)}

    def scored_frames(self) -> torch.Tensor:
        """`[T]`: 0 for the ground-truth given frames of chunk 0 (and the scores' lead frame), 1 else."""
        w = super().scored_frames()
        w[: self.cfg["overlap"]] = 0.0
        return w

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        b, s, gen_update = self.draws(g)
        logs: dict[str, float] = {}
        keep = self.scored_frames()  # [T]
        if gen_update:
            roll = self.prefix_rollout(b, s, g, grad=True)
            x0, m0 = roll["x0_all"], roll["m0_all"]
            gx, gm, logs = self.dmd_gradient(b, x0.detach(), m0.detach(), g)
            gx, gm = gx * keep[None, None, :, None, None], gm * keep[None, :, None]
            ((x0 * gx).sum() + (m0 * gm).sum()).backward()
        else:
            with torch.no_grad():
                roll = self.prefix_rollout(b, s, g)
        return self.fake_score_loss(b, roll, s, gen_update, logs, g)


__all__ = ["PrefixDMDTask"]
