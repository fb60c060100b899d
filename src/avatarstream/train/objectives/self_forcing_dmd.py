"""Self-Forcing distribution matching distillation (`stage = "dmd"`, Live Avatar stage 2, Fig. 2,
Algorithms 1–2) of the causal student into a `steps`-step generator, with three networks: the
generator (`dit`, the causal student, trained), the real score (`teacher`, the bidirectional
model, frozen) and the fake score (`fake`, bidirectional, trained on the generator's own samples).
Per iteration (Algorithm 2):
1. `self_forcing_rollout`: the generator produces `chunk // block` blocks autoregressively, each
   from noise through steps 0..s (s drawn once per iteration), exactly as the engine streams:
   the same Euler transitions, one rolling KV cache per step (timestep forcing), the sink
   (reference; with `adaptive_sink`, the first block's estimate after it) placed by Rolling RoPE.
   **History Corrupt**: every block's K/V is perturbed by Gaussian noise (std `history_corrupt`
   × the tensor's RMS) before it enters the caches, and no clean re-run refreshes them: later
   blocks always read noisy history. With `history_level = "next"` the K/V a block leaves in step
   j's cache come from one more forward on its state after step j (σ_{j+1}; after the last step,
   the clean block), as the engine computes them; corrupted the same way. No gradients here.
2. `dmd_gradient`: x̂0 of all blocks -> x_t at a random σ; real and fake scores give x0_real,
   x0_fake; the DMD gradient w.r.t. the sample is (x0_fake − x0_real) / mean|x̂0 − x0_real|,
   times the mouth/eye weight map (`mouth`, `eyes`, `radius`, as the flow-matching stages weight
   their loss; 0, 0: uniform), and by 1 + `block_start` at the first frame of every block after
   the first (the seams). The weights move no fixed point (fake == real still gives zero); they
   spend more of each update where lip sync and identity live, and where blocks meet.
3. **Block-wise gradient accumulation** (`blockwise_backward`): for each block from the last to
   the first, re-run the generator at step s on its stored input with the stored (detached) history
   and backpropagate that block's share of the DMD gradient; only one block's graph is alive at a
   time. Since the history is detached (Algorithm 1 detaches it too), the accumulated gradient is
   the full-graph gradient (`blockwise_grad = false` runs Algorithm 1's single graph; a test
   checks the two agree).
The fake score's flow-matching loss on the (detached) samples is the loss handed back to the
trainer; the generator's gradient is already accumulated when it is. Two time-scales (DMD2): the
generator gets its DMD gradient on a random 1 in `fake_updates` iterations (drawn from the step's
generator, so resume stays exact); on the others only the fake score learns, from a rollout
without gradients, so it keeps up with the generator's moving distribution.
"""

from __future__ import annotations

from typing import Any

import torch

from avatarstream.cache.kv import BlockKV, RollingKVCache
from avatarstream.cache.reference import ReferenceCache
from avatarstream.engine.causal import HISTORY_LEVELS
from avatarstream.engine.denoiser import guidance_tensor
from avatarstream.errors import ConfigError
from avatarstream.models.dit import VideoRefDiT
from avatarstream.models.sink import SinkCache
from avatarstream.models.transformer import DiTCondition
from avatarstream.samplers import flow_sigmas
from avatarstream.train.checkpoints import load_init, net_weights
from avatarstream.train.nets import dit_config, init_net
from avatarstream.train.objectives.base import pick, x0_floor_weight
from avatarstream.train.objectives.causal import CausalTask, guidance_scales, sink_positions


def history_corrupt(kv: BlockKV, scale: float, g: torch.Generator) -> BlockKV:
    """History Corrupt: K/V of a block, each tensor plus N(0, (scale · RMS)²) noise drawn from g."""
    if scale <= 0:
        return kv

    def noisy(x: torch.Tensor) -> torch.Tensor:
        rms = x.float().square().mean().sqrt()
        eps = torch.randn(x.shape, generator=g).to(x.device)
        return (x.float() + scale * rms * eps).to(x.dtype)

    return BlockKV([noisy(x) for x in kv.k], [noisy(x) for x in kv.v])


class SelfForcingDMDTask(CausalTask):
    """Stage 2: Self-Forcing DMD with History Corrupt and block-wise gradient accumulation (see
    the module docstring). `dmd.teacher`: the bidirectional model (run folder, weights folder or
    .safetensors) the real and fake scores start from; empty: a fresh init (tests)."""

    stage = "dmd"
    trainable = ("dit", "fake")

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        super().__init__(recipe, device)
        c = self.cfg
        if (c["steps"] < 1 or not 0 <= c["sigma_min"] < c["sigma_max"] <= 1 or c["fake_updates"] < 1
                or c["score_window"] < 0):
            raise ConfigError("dmd: steps >= 1, fake_updates >= 1, score_window >= 0 and "
                              "0 <= sigma_min < sigma_max <= 1 are required")
        if c["history_level"] not in HISTORY_LEVELS:
            raise ConfigError(f"dmd.history_level must be one of {', '.join(HISTORY_LEVELS)}, "
                              f"got {c['history_level']!r}")
        cfg = dit_config(recipe["model"], self.direct)
        self.teacher_guidance = guidance_scales(c["teacher_guidance"], "dmd.teacher_guidance")
        self.nets["teacher"] = VideoRefDiT(cfg)
        self.nets["fake"] = VideoRefDiT(cfg)
        init_net("dit", self.nets["teacher"], recipe["train"]["seed"] * 101 + 77)
        self.sigmas = flow_sigmas(c["steps"], c["shift"])

    def after_init(self) -> None:
        if self.cfg["teacher"]:
            load_init(self.nets["teacher"], net_weights(self.cfg["teacher"], "dit"),
                      f"dmd.teacher = {self.cfg['teacher']}")
        if self.cfg["fake_init"]:
            load_init(self.nets["fake"], net_weights(self.cfg["fake_init"], "fake"),
                      f"dmd.fake_init = {self.cfg['fake_init']}")
        else:
            self.nets["fake"].load_state_dict(self.nets["teacher"].state_dict())

    # -- generator ---------------------------------------------------------------------------------
    def _sink(self, gen: VideoRefDiT, b: dict[str, Any], first: torch.Tensor | None) -> SinkCache:
        """Sink of the generator: the reference, or (AAS) the first block's first frame `first`."""
        c = self.cfg
        t = float(c["ref_t_position"])
        if first is None:
            ref = gen.encode_reference(b["ref_lat"], b["ref_valid"], torch.full((b["ref_lat"].shape[2],), t))
        else:
            ref = gen.encode_reference(first, None, torch.full((1,), t))
        cfg = gen.config
        return SinkCache(ref, t, head_dim=cfg.dim // cfg.heads, theta=cfg.rope_theta)

    def _block_cond(self, b: dict[str, Any], i: int, m: torch.Tensor) -> DiTCondition:
        blk = self.cfg["block"]
        sl = slice(i * blk, (i + 1) * blk)
        return DiTCondition(motion=m, audio=b["audio"][:, sl], text=b["text"], text_mask=b["text_mask"],
                            t_pos=torch.arange(sl.start, sl.stop, dtype=torch.float32), anchor=b["anchor"],
                            guidance=guidance_tensor(self.guidance, m.shape[0], self.device))

    def _placed(self, sink: SinkCache, i: int) -> ReferenceCache:
        c = self.cfg
        return sink.at(sink_positions(self.blocks, c["block"], c["history"], c["ref_t_position"],
                                      c["rolling_rope"])[i])

    def _gen_step(self, gen: VideoRefDiT, x: torch.Tensor, m: torch.Tensor, sigma: float, cond: DiTCondition,
                  sink: ReferenceCache, history: RollingKVCache | None
                  ) -> tuple[torch.Tensor, torch.Tensor, BlockKV]:
        """(x0 estimate, motion x0 estimate, the block's K/V) of the generator at `sigma`."""
        b, _, tb = x.shape[:3]
        out, kv = gen.forward_causal_block(x, torch.full((b, tb), sigma, device=x.device), cond, sink, history)
        return x - sigma * out.velocity.float(), m - sigma * out.motion_velocity.float(), kv

    def self_forcing_rollout(self, b: dict[str, Any], s: int, g: torch.Generator, *,
                             grad: bool = False,
                             noise: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, Any]:
        """Algorithm 2, lines 6–22 (Algorithm 1 with `grad`: the exit step keeps its graph).

        Returns x̂0 `[B,C,T,h,w]`, m̂0 `[B,T,Dm]` (exit-step estimates of every block), and per
        block its exit-step input, its history at step s (corrupted K/V, detached) and its sink
        source (None: the reference; else the AAS frame). `noise` (tests): each block's initial
        latents and motion instead of draws from g."""
        c, blk = self.cfg, self.cfg["block"]
        gen: VideoRefDiT = self.nets["dit"]
        B, C, T, h, w = b["x0"].shape
        sig = [float(v) for v in self.sigmas]
        caches = {j: RollingKVCache(gen.config.depth, c["history"]) for j in range(s + 1)}
        exit_kv: list[BlockKV] = []
        out: dict[str, Any] = {"x_in": [], "m_in": [], "hist": [], "first": [], "x0": [], "m0": []}
        track = torch.enable_grad() if grad else torch.no_grad()  # the sink is part of G_theta
        with track:
            sink = self._sink(gen, b, None)
        first = None
        for i in range(self.blocks):
            if noise is None:
                x, m = self.randn(g, B, C, blk, h, w), self.randn(g, B, blk, self.motion_dim)
            else:
                x, m = noise[i]
            placed = self._placed(sink, i)
            for j in range(s + 1):
                cond = self._block_cond(b, i, m)
                if j == s:
                    out["x_in"].append(x)
                    out["m_in"].append(m)
                    out["hist"].append(exit_kv[max(0, i - c["history"]):i] if c["history"] else [])
                    out["first"].append(first)
                    with torch.enable_grad() if grad else torch.no_grad():
                        x0, m0, kv = self._gen_step(gen, x, m, sig[j], cond, placed, caches[j])
                    out["x0"].append(x0)
                    out["m0"].append(m0)
                else:
                    with torch.no_grad():
                        x0, m0, kv = self._gen_step(gen, x, m, sig[j], cond, placed, caches[j])
                if j < s or c["history_level"] == "next":
                    with torch.no_grad():  # Euler to σ_{j+1} (the exit step: only for its K/V)
                        v, mv = (x - x0.detach()) / sig[j], (m - m0.detach()) / sig[j]
                        x, m = x + (sig[j + 1] - sig[j]) * v, m + (sig[j + 1] - sig[j]) * mv
                        if c["history_level"] == "next":  # the K/V of the step's output
                            _, _, kv = self._gen_step(gen, x, m, sig[j + 1], self._block_cond(b, i, m),
                                                      placed, caches[j])
                kv = history_corrupt(kv.detach(), c["history_corrupt"], g)
                caches[j].append(kv, i * blk)
                if j == s:
                    exit_kv.append(kv)
            if i == 0 and c["adaptive_sink"]:
                first = out["x0"][0][:, :, :1].detach()
                with torch.enable_grad() if grad else torch.no_grad():
                    sink = self._sink(gen, b, first)
        out["x0_all"] = torch.cat(out["x0"], dim=2)
        out["m0_all"] = torch.cat(out["m0"], dim=1)
        return out

    # -- DMD ---------------------------------------------------------------------------------------
    def _score_velocity(self, net: VideoRefDiT, b: dict[str, Any], xt: torch.Tensor, mt: torch.Tensor,
                        sigma: torch.Tensor, clean: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(velocity, motion velocity) of a bidirectional score (teacher or fake) at sigma `[B]`,
        over the window in pieces of `score_window` frames (0: whole), each placed at timeline
        0.. as the bidirectional model was trained, so a window longer than its training chunk
        is never scored at temporal distances it has not seen.

        With `score_given` and `clean` (the sample's own clean estimates `x0`, `m0`), every piece
        is led by the clean frame before it, at σ = 0: the regime the bidirectional model was
        trained in (its ref2v / prefix2v / interpolation chunks always hold a clean given frame),
        and continuity across a piece's start is judged too. Frame 0 of the window
        leads the first piece and is not scored: its velocity is 0 here, so real and fake agree
        on it and the DMD gradient and the fake score's loss skip it (`scored_frames`)."""
        T, n = self.T, self.cfg["score_window"] or self.T
        ref = net.encode_reference(b["ref_lat"], b["ref_valid"],
                                   torch.full((b["ref_lat"].shape[2],), float(self.cfg["ref_t_position"])))
        given = self.cfg["score_given"] and clean is not None
        B = xt.shape[0]
        v_all = torch.zeros(xt.shape, dtype=torch.float32, device=xt.device)
        mv_all = torch.zeros(mt.shape, dtype=torch.float32, device=mt.device)
        step = n - 1 if given else n
        for a in range(1 if given else 0, T, step):
            sl = slice(a, min(a + step, T))
            x_in, m_in = xt[:, :, sl], mt[:, sl]
            sig = sigma[:, None].expand(-1, sl.stop - sl.start)
            lo = a
            if given:
                assert clean is not None
                x_in = torch.cat([clean[0][:, :, a - 1 : a].to(xt.dtype), x_in], dim=2)
                m_in = torch.cat([clean[1][:, a - 1 : a].to(mt.dtype), m_in], dim=1)
                sig = torch.cat([torch.zeros(B, 1, device=sigma.device), sig], dim=1)
                lo = a - 1
            k = x_in.shape[2]
            cond = DiTCondition(motion=m_in, audio=b["audio"][:, lo : lo + k], text=b["text"],
                                text_mask=b["text_mask"],
                                t_pos=torch.arange(k, dtype=torch.float32, device=self.device), anchor=b["anchor"],
                                guidance=guidance_tensor(self.teacher_guidance, B, self.device))
            out = net(x_in, sig, cond, ref)
            v_all[:, :, sl] = out.velocity.float()[:, :, k - (sl.stop - sl.start):]
            mv_all[:, sl] = out.motion_velocity.float()[:, k - (sl.stop - sl.start):]
        return v_all, mv_all

    def scored_frames(self) -> torch.Tensor:
        """`[T]` float: 1 for the frames the scores judge, 0 for the given lead frame (see
        `_score_velocity`)."""
        w = torch.ones(self.T, device=self.device)
        if self.cfg["score_given"]:
            w[0] = 0.0
        return w

    def block_start_weight(self) -> torch.Tensor:
        """`[T]`: 1 + `block_start` at the first latent frame of every block after the first, 1
        elsewhere."""
        w = torch.ones(self.T, device=self.device)
        w[self.cfg["block"]::self.cfg["block"]] += float(self.cfg["block_start"])
        return w

    def _score(self, net: VideoRefDiT, b: dict[str, Any], xt: torch.Tensor, mt: torch.Tensor,
               sigma: torch.Tensor, clean: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """x0 and motion-x0 predictions of a bidirectional score (see `_score_velocity`)."""
        v, mv = self._score_velocity(net, b, xt, mt, sigma, clean)
        s5 = sigma[:, None, None, None, None]
        return xt - s5 * v, mt - sigma[:, None, None] * mv

    def dmd_gradient(self, b: dict[str, Any], x0: torch.Tensor, m0: torch.Tensor, g: torch.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """d(DMD loss)/d(sample) for latents `[B,C,T,h,w]` and motion `[B,T,Dm]` (no graph)."""
        c = self.cfg
        B = x0.shape[0]
        sigma = (c["sigma_min"] + (c["sigma_max"] - c["sigma_min"]) * torch.rand(B, generator=g)).to(self.device)
        eps, eps_m = self.randn(g, *x0.shape), self.randn(g, *m0.shape)
        s5 = sigma[:, None, None, None, None]
        xt = (1 - s5) * x0 + s5 * eps
        mt = (1 - sigma[:, None, None]) * m0 + sigma[:, None, None] * eps_m
        with torch.no_grad():
            xr, mr = self._score(self.nets["teacher"], b, xt, mt, sigma, (x0, m0))
            xf, mf = self._score(self.nets["fake"], b, xt, mt, sigma, (x0, m0))
        on = self.scored_frames().bool()  # the normaliser over the frames the scores judge
        wx = (x0 - xr)[:, :, on].abs().mean(dim=(1, 2, 3, 4), keepdim=True).clamp_min(1e-6)
        wm = (m0 - mr)[:, on].abs().mean(dim=(1, 2), keepdim=True).clamp_min(1e-6)
        gx = (xf - xr) / wx / x0[0].numel() / B
        if c["mouth"] or c["eyes"]:  # emphasis only: the gradient still vanishes where fake == real
            gx = gx * self.latent_weight(b["clips"], b["starts"], x0.shape[-1])
        if c["block_start"]:  # emphasis on the block seams (the first frame of blocks 1..)
            gx = gx * self.block_start_weight()[None, None, :, None, None]
        gm = c["motion"] * (mf - mr) / wm / m0[0].numel() / B
        gap = float((xf - xr).square().mean())
        return gx, gm, {"dmd": float(0.5 * ((xf - xr) / wx).square().mean()), "score_gap": gap,
                        "dmd_sigma": float(sigma.mean())}

    def blockwise_backward(self, b: dict[str, Any], roll: dict[str, Any], s: int, gx: torch.Tensor,
                           gm: torch.Tensor) -> None:
        """Algorithm 2, lines 23–38: per block, last to first, re-run the exit step with grad on
        the stored input and history, backpropagate its share of the DMD gradient."""
        c, blk = self.cfg, self.cfg["block"]
        gen: VideoRefDiT = self.nets["dit"]
        sig = float(self.sigmas[s])
        for i in reversed(range(self.blocks)):
            cache = RollingKVCache(gen.config.depth, c["history"])
            for k, kv in enumerate(roll["hist"][i]):
                cache.append(kv, (i - len(roll["hist"][i]) + k) * blk)
            with torch.enable_grad():
                sink = self._placed(self._sink(gen, b, roll["first"][i]), i)
                x0, m0, _ = self._gen_step(gen, roll["x_in"][i], roll["m_in"][i], sig,
                                           self._block_cond(b, i, roll["m_in"][i]), sink, cache)
                sl = slice(i * blk, (i + 1) * blk)
                part = (x0 * gx[:, :, sl]).sum() + (m0 * gm[:, sl]).sum()
            part.backward()
            roll["hist"][i] = None  # free the block's history (Alg. 2 line 37)

    def draws(self, g: torch.Generator) -> tuple[dict[str, Any], int, bool]:
        """An iteration's conditions, exit step (shared by all its blocks) and whether the
        generator updates on it (two time-scales: 1 in `fake_updates`)."""
        c = self.cfg
        b = self.conditions(g)
        s = pick(g, c["steps"])
        return b, s, c["fake_updates"] == 1 or pick(g, c["fake_updates"]) == 0

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        b, s, gen_update = self.draws(g)
        logs: dict[str, float] = {}
        if not gen_update:  # the fake score alone learns from the generator's samples
            with torch.no_grad():
                roll = self.self_forcing_rollout(b, s, g)
        elif c["blockwise_grad"]:
            roll = self.self_forcing_rollout(b, s, g)
            gx, gm, logs = self.dmd_gradient(b, roll["x0_all"], roll["m0_all"], g)
            self.blockwise_backward(b, roll, s, gx, gm)
        else:  # Algorithm 1: one graph through every block's exit step
            roll = self.self_forcing_rollout(b, s, g, grad=True)
            gx, gm, logs = self.dmd_gradient(b, roll["x0_all"].detach(), roll["m0_all"].detach(), g)
            ((roll["x0_all"] * gx).sum() + (roll["m0_all"] * gm).sum()).backward()
        return self.fake_score_loss(b, roll, s, gen_update, logs, g)

    def fake_score_loss(self, b: dict[str, Any], roll: dict[str, Any], s: int, gen_update: bool,
                        logs: dict[str, float], g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        """The fake score's flow-matching loss on the generator's (detached) samples `roll`, over
        the frames the scores judge; `logs` completed with it."""
        c = self.cfg
        x0, m0 = roll["x0_all"].detach(), roll["m0_all"].detach()
        B = x0.shape[0]
        u = torch.randn(B, generator=g) * c["logit_std"] + c["logit_mean"]
        sigma = torch.sigmoid(u).to(self.device)
        eps, eps_m = self.randn(g, *x0.shape), self.randn(g, *m0.shape)
        s5 = sigma[:, None, None, None, None]
        xt = (1 - s5) * x0 + s5 * eps
        mt = (1 - sigma[:, None, None]) * m0 + sigma[:, None, None] * eps_m
        fake: VideoRefDiT = self.nets["fake"]
        v, mv = self._score_velocity(fake, b, xt, mt, sigma, (x0, m0))
        wf = x0_floor_weight(sigma[:, None].expand(-1, self.T), fake.config.x0_skip)
        keep = self.scored_frames()  # [T]
        wf = wf * keep[None, None, :, None, None]
        loss_f = ((v - (eps - x0)).square() * wf).mean() * self.T / keep.sum()
        loss_fm = ((mv - (eps_m - m0)).square() * keep[None, :, None]).mean() * self.T / keep.sum()
        fake_loss = loss_f + c["motion"] * loss_fm
        logs.update(loss=float(fake_loss.detach()), fake=float(loss_f.detach()), exit_step=s,
                    sample_rms=float(x0.square().mean().sqrt()), gen_update=int(gen_update))
        return fake_loss, logs
