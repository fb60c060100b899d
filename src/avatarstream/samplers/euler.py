"""Flow-matching samplers over a velocity model.

`denoise(x, sigma) -> v` with x [B, ...], sigma a 0-d float tensor (an element of `sigmas`) and
v = ε − x0 the velocity of x_σ = (1 − σ)·x0 + σ·ε. From one evaluation:
x0̂ = x − σ·v and ε̂ = x + (1 − σ)·v (so x = (1 − σ)·x0̂ + σ·ε̂ exactly).

`callback(info)` (optional) is called after every step with a dict: i (step index), sigma,
sigma_next (floats), x (state after the step), denoised (x0̂ predicted at this step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Denoise = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Callback = Callable[[dict[str, Any]], None]


def _check(sigmas: torch.Tensor) -> None:
    if sigmas.dim() != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be 1-D with >= 2 values, got shape {tuple(sigmas.shape)}")


def _noise(x: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator] | None) -> torch.Tensor:
    """N(0, I) shaped like x, from one generator or one per row of x."""
    if generator is None or isinstance(generator, torch.Generator):
        dev = generator.device if generator is not None else x.device
        return torch.randn(x.shape, generator=generator, device=dev, dtype=x.dtype).to(x.device)
    if len(generator) != x.shape[0]:
        raise ValueError(f"{len(generator)} generators for a batch of {x.shape[0]}")
    return torch.cat([torch.randn((1, *x.shape[1:]), generator=g, device=g.device, dtype=x.dtype)
                      for g in generator]).to(x.device)


def sample_euler(denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, *,
                 callback: Callback | None = None) -> torch.Tensor:
    """Deterministic probability-flow ODE, Euler: x ← x + (σ_next − σ)·v(x, σ).

    x [B, ...] at σ = sigmas[0] (pure noise when sigmas[0] = 1); sigmas [S + 1] decreasing.
    Returns x at σ = sigmas[-1] (clean when 0), same shape. S model evaluations.
    """
    _check(sigmas)
    for i in range(sigmas.numel() - 1):
        sigma = sigmas[i]
        s, s_next = float(sigma), float(sigmas[i + 1])
        v = denoise(x, sigma)
        if callback is not None:
            callback({"i": i, "sigma": s, "sigma_next": s_next, "x": x + (s_next - s) * v,
                      "denoised": x - s * v})
        x = x + (s_next - s) * v
    return x


def sample_stochastic_euler(denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, *,
                            overshoot: float = 0.2,
                            generator: torch.Generator | Sequence[torch.Generator] | None = None,
                            callback: Callback | None = None) -> torch.Tensor:
    """Stochastic Euler ("overshoot" sampler): an ODE step past the target, then fresh noise back.

    Per step σ → σ_next (c = `overshoot` ≥ 0), with v = denoise(x, σ):
        x0̂ = x − σ·v,  ε̂ = x + (1 − σ)·v
        σ_o = max(σ_next − c·(σ − σ_next), 0)             overshoot target (below σ_next)
        x_o = (1 − σ_o)·x0̂ + σ_o·ε̂                         = x + (σ_o − σ)·v  (Euler to σ_o)
        a   = (1 − σ_next) / (1 − σ_o)
        x   ← a·x_o + sqrt(σ_next² − (a·σ_o)²)·z,   z ~ N(0, I) fresh
    so x = (1 − σ_next)·x0̂ + (a·σ_o)·ε̂ + sqrt(σ_next² − (a·σ_o)²)·z: the signal coefficient is
    1 − σ_next and the noise variance σ_next² (a·σ_o ≤ σ_next since σ_o ≤ σ_next), i.e. the
    state is re-noised onto the σ_next marginal with a fraction of fresh noise. The last step
    (σ_next = 0) returns x0̂.

    - c = 0 is exactly `sample_euler` (no fresh noise).
    - c > 0 injects fresh-noise variance ∝ c·(σ − σ_next) per step: a discretisation of a
      reverse SDE with the same marginals as the probability-flow ODE, so with the exact velocity
      it samples the same distribution as the ODE as steps → ∞ (and the injected noise corrects
      accumulated discretisation / model error instead of carrying it along).
    - c large (σ_o clipped to 0) is DMD / consistency-model multistep sampling:
      x ← (1 − σ_next)·x0̂ + σ_next·z — use that only with a distilled (x0-exact) generator.

    x [B, ...] at σ = sigmas[0]; sigmas [S + 1]; `generator` seeds the fresh noise (drawn on the
    generator's device, then moved to x's): one for the batch, or one per row (a batch of
    independent streams draws, row by row, what each would draw alone). Returns x at sigmas[-1].
    """
    _check(sigmas)
    if overshoot < 0:
        raise ValueError(f"overshoot must be >= 0, got {overshoot}")
    for i in range(sigmas.numel() - 1):
        sigma = sigmas[i]
        s, s_next = float(sigma), float(sigmas[i + 1])
        v = denoise(x, sigma)
        x0 = x - s * v
        s_o = max(s_next - overshoot * (s - s_next), 0.0)
        x_o = x + (s_o - s) * v
        if s_next > 0.0 and s_o < s_next:
            a = (1.0 - s_next) / (1.0 - s_o)
            std = max(s_next**2 - (a * s_o) ** 2, 0.0) ** 0.5
            z = _noise(x, generator)
            x = a * x_o + std * z
        else:
            x = x_o
        if callback is not None:
            callback({"i": i, "sigma": s, "sigma_next": s_next, "x": x, "denoised": x0})
    return x
