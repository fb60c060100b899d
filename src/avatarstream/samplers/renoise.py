"""Few-step re-noising sampler (the multistep sampling of consistency models, Song et al. 2023,
Alg. 1; DMD2 and FlashHead's distilled checkpoints sample this way).

`denoise(x, sigma) -> v` as in `samplers/euler.py` (v = ε − x0, x_σ = (1 − σ)·x0 + σ·ε). Per step
σ → σ_next:

    x0̂ = x − σ·v(x, σ)
    x  ← (1 − σ_next)·x0̂ + σ_next·z        z ~ N(0, I), fresh

so every step jumps to the clean estimate and re-noises it onto the σ_next marginal with new noise
(nothing of the old ε̂ is kept). The last step (σ_next = 0) returns x0̂ and needs no draw. It is
`sample_stochastic_euler` at an overshoot large enough to clip σ_o to 0, with two things the
stochastic Euler sampler does not offer: the draws are given (`noise`: a tensor of draws, one per
step, or a function of the step), so a fixture's recorded draws or an official RNG stream can be
replayed, and `given` rewrites parts of x that are known before every model evaluation and once
after the last step (FlashHead writes its clean motion latents into the first frames: the model
sees them at the chunk's σ, never re-noised).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from avatarstream.samplers.euler import Callback, Denoise, _check

Noise = torch.Tensor | Callable[[int], torch.Tensor]
"""Draw for step i (used after step i when σ_{i+1} > 0): `noise[i]` of a tensor `[S, *x.shape]`
(S = steps, or steps − 1: the last step's draw is never read), or `noise(i)`."""


def sample_renoise(denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, *, noise: Noise,
                   given: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   callback: Callback | None = None) -> torch.Tensor:
    """x `[B, ...]` at σ = sigmas[0] (pure noise when 1); sigmas `[S + 1]` decreasing; returns x
    at sigmas[-1] (clean when 0), same shape. S model evaluations; `given(x) -> x` (optional)
    overwrites the known parts of x before each of them and of the result (see the module
    docstring). `callback` as in `samplers/euler.py`."""
    _check(sigmas)
    for i in range(sigmas.numel() - 1):
        sigma = sigmas[i]
        s, s_next = float(sigma), float(sigmas[i + 1])
        if given is not None:
            x = given(x)
        x0 = x - s * denoise(x, sigma)
        if s_next > 0.0:
            z = noise[i] if isinstance(noise, torch.Tensor) else noise(i)
            x = (1.0 - s_next) * x0 + s_next * z.to(device=x0.device, dtype=x0.dtype)
        else:
            x = x0
        if callback is not None:
            callback({"i": i, "sigma": s, "sigma_next": s_next, "x": x, "denoised": x0})
    return given(x) if given is not None else x
