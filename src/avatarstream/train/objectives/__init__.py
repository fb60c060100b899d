"""The stage objectives, one file each, and the registry `make_task` builds a recipe's from.

- `vae`: the causal VAE's reconstruction objective (pixel clips).
- `a2v`: audio-to-video flow matching of the DiT (pre-training, personality SFT).
- `cfg-distill`: the guidance streams folded into one pass that takes the scales as inputs.
- `sr`: the super-resolution refiner.
- `df`, `dmd`: the causal student (diffusion forcing, then Self-Forcing DMD).
- `grpo`, `dpo`: feedback alignment of a registry model's DiT (rewards on its own rollouts;
  preference pairs), with `align.AlignTask` their shared base.

`latent.LatentTask` is the shared base of every objective on a prepared file's latents,
`causal.CausalTask` that of the two causal ones; `base.Task` is what the trainer sees.
"""

from __future__ import annotations

from typing import Any

import torch

from avatarstream.train.objectives.a2v import A2VTask
from avatarstream.train.objectives.base import Task
from avatarstream.train.objectives.cfg_distill import CFGDistillTask
from avatarstream.train.objectives.diffusion_forcing import DiffusionForcingTask
from avatarstream.train.objectives.dpo import DPOTask
from avatarstream.train.objectives.grpo import GRPOTask
from avatarstream.train.objectives.self_forcing_dmd import SelfForcingDMDTask
from avatarstream.train.objectives.sr import SRTask
from avatarstream.train.objectives.vae import VAETask

OBJECTIVES: dict[str, type[Task]] = {"vae": VAETask, "a2v": A2VTask, "cfg-distill": CFGDistillTask, "sr": SRTask,
                                     "df": DiffusionForcingTask, "dmd": SelfForcingDMDTask,
                                     "grpo": GRPOTask, "dpo": DPOTask}


def make_task(recipe: dict[str, Any], device: torch.device) -> Task:
    """The objective of a resolved recipe's stage, its networks built and initialised."""
    return OBJECTIVES[recipe["stage"]](recipe, device)


__all__ = ["OBJECTIVES", "Task", "make_task"]
