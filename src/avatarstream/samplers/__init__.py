"""Samplers over `denoise(x, sigma) -> velocity` (pure functions; they never import models) and
their σ schedules. Conventions: x_σ = (1 − σ)·x0 + σ·ε, v = ε − x0, σ from 1 (noise) to 0."""

from avatarstream.samplers.euler import sample_euler, sample_stochastic_euler
from avatarstream.samplers.schedules import few_step_sigmas, flow_sigmas, shift_sigmas

__all__ = ["few_step_sigmas", "flow_sigmas", "sample_euler", "sample_stochastic_euler",
           "shift_sigmas"]
