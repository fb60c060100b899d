"""Feedback alignment by group-relative policy optimisation (`stage = "grpo"`, Avatar V §3.5).

Each step draws `train.batch` conditions (train/conditions.py) and renders `group` rollouts of
each through the engine's own chunk loop (train/rollout.py: what `generate` runs, prefix hand-off
included) from the current policy; the rollouts are scored by named reward terms
(train/rewards.py) and each gets its group-normalised advantage A = (r − mean) / std over the
rollouts of its condition (clipped to ±`adv_clip`; a group whose rewards are all equal teaches
nothing). Two ways to turn advantages into a gradient (`method`):

- `flow-grpo` (Flow-GRPO / DanceGRPO): the rollouts use the stochastic sampler (the SDE form of
  the flow: `sample_stochastic_euler`, `overshoot`), so every step but the last is a Gaussian
  policy x_{j+1} ~ N(μ_θ(x_j), std_j²) with μ_θ = a·(x_j + (σ_o − σ)·v_θ(x_j, σ)). Per step, the
  log-probability of the recorded x_{j+1} (mean over the generated entries), the PPO ratio to
  the rollout policy's, the clipped surrogate −min(ρA, clip(ρ, 1 ± `clip`)A), and the KL to the
  anchor in closed form, |μ_θ − μ_ref|² / 2std² (same std). The sampler's last step is
  deterministic (x̂0), so it has no log-probability: with the bundled model's 2 steps, the
  policy gradient reaches the first step's velocity (σ = 1) only.
- `nft` (DiffusionNFT): likelihood-free. The rollouts use the model's own sampler; each clean
  sample x0 is noised to a random σ and the policy learns the flow-matching target with an
  implicit positive and negative policy, v± = v_old ± β(v_θ − v_old) (β = `nft_beta`):
  r·|v⁺ − (ε − x0)|² + (1 − r)·|v⁻ − (ε − x0)|², r = ½ + ½·A/`adv_clip` the rollout's
  optimality. Every σ is trained, so both of the 2 steps improve. KL: |v_θ − v_ref|² at the same
  noisy input (the path-space KL of two flows, up to the weight).

Rollouts are fresh every step (one update per round), so the rollout policy equals the policy:
the ratio is 1 and its clip inactive unless `sync_rollout_policy` is skipped (tests). EMA,
resume, checkpoints and torchrun come from the trainer; the loss is returned as one graph.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from avatarstream.errors import ConfigError
from avatarstream.train.objectives.align import AlignTask, flow_sigma, floor_weight, noisy_state
from avatarstream.train.objectives.base import pick
from avatarstream.train.rewards import DEFAULT_WEIGHTS, TERMS, Condition, RewardModel
from avatarstream.train.rollout import ChunkSteps, Rollout, denoiser_for, rollout

METHODS = ("flow-grpo", "nft")


def group_advantages(rewards: torch.Tensor, clip: float) -> torch.Tensor:
    """`[K, G]` rewards (K conditions × G rollouts) -> advantages (r − group mean) / group std,
    clipped to ±clip; 0 for a group whose rewards are equal."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    adv = torch.where(std > 1e-8, (rewards - mean) / std.clamp_min(1e-8), torch.zeros_like(rewards))
    return adv.clamp(-clip, clip)


def clipped_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, adv: float, clip: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective as a loss: −min(ρA, clip(ρ, 1−c, 1+c)A), ρ = exp(logp − logp_old);
    and ρ (for the logs)."""
    ratio = torch.exp(logp - logp_old)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv), ratio.detach()


def step_mean(net: torch.nn.Module, ch: ChunkSteps, j: int) -> tuple[torch.Tensor, float]:
    """(μ of step j's Gaussian transition under `net`, its std)."""
    s, s_o, a, std = ch.step_params(j)
    x = ch.states[j]
    v = denoiser_for(net, ch)(x, torch.tensor(s))
    return a * (x + (s_o - s) * v), std


def gaussian_logp(sample: torch.Tensor, mean: torch.Tensor, std: float, free: torch.Tensor) -> torch.Tensor:
    """Mean over the free entries of log N(sample; mean, std²) without its constant (0-d)."""
    return -((sample - mean).square() * free).sum() / (2 * std ** 2) / free.sum()


class GRPOTask(AlignTask):
    stage = "grpo"
    progress_keys = ("reward", "sync", "kl")

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        super().__init__(recipe, device)
        c = self.cfg
        if c["method"] not in METHODS:
            raise ConfigError(f"grpo.method must be one of {', '.join(METHODS)}, got {c['method']!r}")
        if c["group"] < 2 or c["conditions"] < 1 or c["seconds"] <= 0 or c["adv_clip"] <= 0:
            raise ConfigError("grpo: group >= 2, conditions >= 1, seconds > 0 and adv_clip > 0 are required")
        if c["method"] == "flow-grpo" and c["overshoot"] <= 0:
            raise ConfigError("grpo.overshoot must be > 0 for flow-grpo (its rollouts need a stochastic sampler)")
        weights = dict(DEFAULT_WEIGHTS)
        weights.update({t: float(c[f"w_{t}"]) for t in TERMS if c[f"w_{t}"] >= 0})
        self.weights = weights
        self._reward: RewardModel | None = None
        self.pool: list[Condition] | None = None
        # tests may replace the scoring: frames, condition -> {"total": …, term: …}
        self.score: Callable[[list[np.ndarray], Condition], list[dict[str, float]]] | None = None

    def conditions(self) -> list[Condition]:
        if self.pool is None:
            from avatarstream.train.conditions import synthetic_conditions

            c = self.cfg
            self.pool = synthetic_conditions(c["conditions"], seconds=c["seconds"], seed=c["condition_seed"],
                                             size=self.models.config.hr_size)
        return self.pool

    def rewards(self, videos: list[np.ndarray], cond: Condition) -> list[dict[str, float]]:
        if self.score is not None:
            return self.score(videos, cond)
        if self._reward is None:
            self._reward = RewardModel(self.weights)
        with torch.autocast(self.device.type, enabled=False):  # the experts in float32, as eval runs them
            return self._reward.batch(videos, cond)

    def rollouts(self, g: torch.Generator) -> tuple[list[Condition], list[list[Rollout]]]:
        """This step's conditions and their groups of rollouts from the current policy."""
        c = self.cfg
        pool = self.conditions()
        conds = [pool[pick(g, len(pool))] for _ in range(self.recipe["train"]["batch"])]
        seeds = [[int(torch.randint(2 ** 31 - 1, (1,), generator=g)) for _ in range(c["group"])] for _ in conds]
        self.sync_rollout_policy()
        stochastic = c["method"] == "flow-grpo"
        groups = [[rollout(self.models, cond, s, sampler="stochastic" if stochastic else None,
                           overshoot=c["overshoot"] if stochastic else None) for s in ss]
                  for cond, ss in zip(conds, seeds)]
        return conds, groups

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        conds, groups = self.rollouts(g)
        scores = [self.rewards([r.frames for r in grp], cond) for cond, grp in zip(conds, groups)]
        totals = torch.tensor([[s["total"] for s in row] for row in scores], dtype=torch.float64)
        adv = group_advantages(totals, c["adv_clip"]).float()
        parts, logs = [], {"kl": 0.0, "ratio_dev": 0.0}
        n = 0
        for k, grp in enumerate(groups):
            for i, r in enumerate(grp):
                for ch in r.chunks:
                    part, extra = (self._flow_grpo(ch, float(adv[k, i])) if c["method"] == "flow-grpo"
                                   else self._nft(ch, float(adv[k, i]), g))
                    parts.append(part)
                    for key in logs:
                        logs[key] += extra.get(key, 0.0)
                    n += 1
        loss = torch.stack(parts).sum() / max(1, sum(len(grp) for grp in groups))
        logs = {key: v / max(1, n) for key, v in logs.items()}
        logs.update(loss=float(loss.detach()), reward=float(totals.mean()), reward_std=float(totals.std(dim=1).mean()),
                    adv_abs=float(adv.abs().mean()))
        for t in TERMS:
            vals = [s[t] for row in scores for s in row if s.get(t) is not None]
            if vals:
                logs[t] = float(np.mean(vals))
        return loss, logs

    def _flow_grpo(self, ch: ChunkSteps, adv: float) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        free = ch.free_mask()
        total = torch.zeros((), device=self.device)
        kl_sum, dev = 0.0, 0.0
        steps = [j for j in range(len(ch.states) - 1) if ch.step_params(j)[3] > 0]
        if not steps:
            raise ConfigError("grpo: the rollouts have no stochastic step (flow-grpo needs overshoot > 0 and "
                              "at least 2 sampler steps)")
        for j in steps:
            mean, std = step_mean(self.nets["dit"], ch, j)
            with torch.no_grad():
                mean_ref, _ = step_mean(self.nets["anchor"], ch, j)
                mean_old, _ = step_mean(self.models.dit.model, ch, j)
            logp = gaussian_logp(ch.states[j + 1], mean, std, free)
            logp_old = gaussian_logp(ch.states[j + 1], mean_old.float(), std, free)
            surr, ratio = clipped_surrogate(logp, logp_old, adv, c["clip"])
            kl = ((mean - mean_ref).square() * free).sum() / (2 * std ** 2) / free.sum()
            total = total + surr + c["kl"] * kl
            kl_sum += float(kl.detach())
            dev += abs(float(ratio) - 1.0)
        return total / len(steps), {"kl": kl_sum / len(steps), "ratio_dev": dev / len(steps)}

    def _nft(self, ch: ChunkSteps, adv: float, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        free = ch.free_mask()
        sigma = flow_sigma(g, c["logit_mean"], c["logit_std"])
        eps = self.randn(g, *ch.states[-1].shape)
        xt, target = noisy_state(ch, sigma, eps)
        v = denoiser_for(self.nets["dit"], ch)(xt, torch.tensor(sigma))
        with torch.no_grad():
            v_ref = denoiser_for(self.nets["anchor"], ch)(xt, torch.tensor(sigma))
            v_old = denoiser_for(self.models.dit.model, ch)(xt, torch.tensor(sigma)).float()
        r = 0.5 + 0.5 * adv / c["adv_clip"]
        beta = c["nft_beta"]
        v_pos = (1 - beta) * v_old + beta * v
        v_neg = (1 + beta) * v_old - beta * v
        w = floor_weight(sigma, bool(self.nets["dit"].config.x0_skip))
        mse = lambda a: ((a - target).square() * free).sum() / free.sum()  # noqa: E731
        kl = ((v - v_ref).square() * free).sum() / free.sum()
        return w * (r * mse(v_pos) + (1 - r) * mse(v_neg) + c["kl"] * kl), {"kl": float(w * kl.detach())}
