"""σ schedules for flow matching: 1-D float32 tensors [steps + 1], from 1 (noise) down to 0."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 / Wan timestep shift σ' = shift·σ / (1 + (shift − 1)·σ) (fixes 0 and 1; shift > 1
    spends more steps at high noise). sigmas [...] -> same shape."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def flow_sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """`steps` uniform steps in σ from 1 to 0, then the timestep shift: tensor [steps + 1]."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    s = shift_sigmas(s, shift)
    s[0], s[-1] = 1.0, 0.0  # exact end points
    return s.float()


def few_step_sigmas(sigmas: Sequence[float]) -> torch.Tensor:
    """A hand-picked (distilled-model) schedule, e.g. [1.0, 0.75, 0.5, 0.25] -> tensor
    [1.0, 0.75, 0.5, 0.25, 0.0]: strictly decreasing values in [0, 1]; 0 is appended if absent."""
    vals = [float(s) for s in sigmas]
    if not vals:
        raise ValueError("few_step_sigmas needs at least one σ")
    if vals[-1] != 0.0:
        vals.append(0.0)
    if any(not 0.0 <= v <= 1.0 for v in vals):
        raise ValueError(f"σ values must lie in [0, 1], got {vals}")
    if any(a <= b for a, b in zip(vals, vals[1:])):
        raise ValueError(f"σ values must be strictly decreasing, got {vals}")
    if len(vals) < 2:
        raise ValueError("a schedule needs at least one step (two σ values)")
    return torch.tensor(vals, dtype=torch.float32)
