"""What the feedback-alignment stages (`grpo`, `dpo`) share: the registry model they align, its
DiT as the trained policy and as the frozen KL anchor, and the flow-matching pieces on recorded
chunks (train/rollout.py).

Networks: `dit` (the policy, trained; its EMA is what export writes) and `anchor` (the same
weights, frozen: the KL term's reference and DPO's reference model). The rest of the model (VAE,
audio and text encoders) stays in `self.models`, the `load_model` ModelSet the rollouts run
through; its DiT module is a third copy that `sync_rollout_policy` loads from the policy before
each round of rollouts (the "old" policy of the round).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from avatarstream.errors import ConfigError
from avatarstream.hardware import resolve_bf16
from avatarstream.train.objectives.base import X0_LOSS_FLOOR, Task
from avatarstream.train.rollout import ChunkSteps, denoiser_for


def flow_sigma(g: torch.Generator, mean: float, std: float) -> float:
    """A logit-normal σ in (0, 1) from the step's generator (the a2v stages' draw)."""
    return float(torch.sigmoid(torch.randn((), generator=g) * std + mean))


def floor_weight(sigma: float, x0_skip: bool) -> float:
    """`x0_floor_weight` for one σ: an x0-output DiT's velocity error is its x̂0 error / σ."""
    return (sigma / max(sigma, X0_LOSS_FLOOR)) ** 2 if x0_skip else 1.0


def noisy_state(ch: ChunkSteps, sigma: float, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_σ, velocity target ε − x0) over the chunk's flat state, x0 its recorded clean sample;
    the given entries stay clean (the denoiser holds them, its velocity there is 0)."""
    x0 = ch.states[-1]
    free = ch.free_mask()
    xt = torch.where(free, (1 - sigma) * x0 + sigma * eps, x0)
    return xt, torch.where(free, eps - x0, torch.zeros_like(x0))


def velocity_error(net: torch.nn.Module, ch: ChunkSteps, xt: torch.Tensor, target: torch.Tensor,
                   sigma: float) -> torch.Tensor:
    """Mean squared velocity error of `net` over the generated entries of a recorded chunk, with
    the x0 floor weight (0-d)."""
    free = ch.free_mask()
    v = denoiser_for(net, ch)(xt, torch.tensor(sigma))
    w = floor_weight(sigma, bool(getattr(net.config, "x0_skip", False)))
    return w * ((v - target).square() * free).sum() / free.sum()


class AlignTask(Task):
    """Base of `grpo` and `dpo` (see the module docstring). Recipe section keys used here:
    `model` (registry name or weights folder), `kl`, `bf16_rollouts` (auto | true | false)."""

    trainable = ("dit",)
    # under torchrun: DDP (the rollouts read the policy's whole weights every step; FSDP2's shards
    # would be gathered for that each time, for DiTs small enough to hold whole anyway)
    shards = ("ddp",)

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        from avatarstream.registry import load_model

        self.recipe, self.device = recipe, device
        self.cfg = recipe[self.stage]
        if any(recipe["init"].values()):
            raise ConfigError(f"{self.stage}: [init] does not apply; {self.stage}.model names the model to align")
        bf16 = resolve_bf16(self.cfg["bf16_rollouts"], device)
        self.models = load_model(self.cfg["model"], device=str(device), bf16=bf16)
        if self.models.stages is not None:
            raise ConfigError(f"{self.stage}: {self.cfg['model']} is not of avatarstream's own DiT family "
                              "(other families' alignment is not built yet)")
        base = self.models.dit.model
        policy = copy.deepcopy(base).float()
        anchor = copy.deepcopy(base).float()
        self.nets = {"dit": policy, "anchor": anchor}
        self.geometry = {"hr_size": self.models.config.hr_size}

    def uses(self) -> tuple[str, ...]:
        return ("dit", "anchor")

    def after_init(self) -> None:
        self.nets["anchor"].requires_grad_(False)

    @torch.no_grad()
    def sync_rollout_policy(self) -> None:
        """The rollout model's DiT := the current policy (the round's "old" policy)."""
        mod = self.models.dit
        dtype = next(mod.model.parameters()).dtype
        full = lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v  # noqa: E731 - FSDP2 shards
        mod.model.load_state_dict({k: full(v).to(device=mod.device, dtype=dtype)
                                   for k, v in self.nets["dit"].state_dict().items()})
