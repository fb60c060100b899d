"""What every objective is: a `Task` builds the networks its stage uses, draws a step's batch and
noise from a `torch.Generator` seeded by (seed, step) (so a resumed run draws the same data and
noise), and returns the loss. Batches are drawn on the CPU and moved to the device: the same recipe
gives the same batches on any device. Draws go through `pick` / `uniform` / `Task.randn` only, in
a fixed order per objective: that order is part of the trajectory.
"""

from __future__ import annotations

from typing import Any

import torch

from avatarstream.train.nets import GEOMETRY, build_nets, init_net

X0_LOSS_FLOOR = 0.25


def x0_floor_weight(sigma: torch.Tensor, x0_skip: bool) -> torch.Tensor:
    """Per-frame loss weight `[B, 1, T, 1, 1]` of a velocity error at sigma `[B, T]`: an `x0_skip`
    DiT's velocity error is its x̂0 error / σ, so below σ = X0_LOSS_FLOOR the weight is
    (σ / floor)² and the loss there is the x̂0 error / floor², bounded instead of growing as
    1/σ² (the samplers query σ ≥ 0.25 at 4 steps). Any other DiT: 1."""
    s = sigma.float()
    w = (s / s.clamp_min(X0_LOSS_FLOOR)) ** 2 if x0_skip else torch.ones_like(s)
    return w[:, None, :, None, None]


def pick(g: torch.Generator, n: int) -> int:
    """A uniform index in 0..n−1 drawn from the step's generator."""
    return int(torch.randint(n, (1,), generator=g))


def uniform(g: torch.Generator) -> float:
    """A uniform number in [0, 1) drawn from the step's generator."""
    return float(torch.rand((), generator=g))


class Task:
    """Base: `nets` (every network the stage uses), `trainable` (names it updates)."""

    stage = ""
    trainable: tuple[str, ...] = ()
    # FSDP2 per-block units (train/distributed.py): a task whose loss can call every DiT block alike
    # on every rank, whatever the data, says so (`block_units`); the wrapper then sets `same_calls`.
    # The outputs of block calls such a loss makes only for that go into `masked`: the wrapper adds
    # them to the loss times 0, and the unused-parameter detection does not follow them.
    block_units = False
    same_calls = False
    masked: list[torch.Tensor]  # set by the wrapper before each loss

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        self.recipe, self.device = recipe, device
        self.cfg = recipe[self.stage]
        self.direct = bool(self.cfg.get("direct", False))
        self.geometry = dict(GEOMETRY[recipe["model"]])
        if self.direct:  # the DiT works on the output-resolution latents
            self.geometry["lr_size"] = self.geometry["hr_size"]
        all_nets = build_nets(recipe["model"], self.direct)
        self.nets = {k: all_nets[k] for k in self.uses()}
        for i, (k, net) in enumerate(sorted(self.nets.items())):
            init_net(k, net, recipe["train"]["seed"] * 101 + i)

    def uses(self) -> tuple[str, ...]:
        return self.trainable

    def after_init(self) -> None:
        """Called by the trainer after `[init]` weights are loaded (before any checkpoint)."""

    def freeze(self) -> None:
        """Called by the trainer after it set requires_grad on the trainable nets: a task may
        freeze parts of them (their parameters then get no optimizer state)."""

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def randn(self, g: torch.Generator, *shape: int) -> torch.Tensor:
        """Standard normal noise drawn on the CPU from the step's generator, on the device."""
        return torch.randn(*shape, generator=g).to(self.device)
