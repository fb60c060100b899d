"""The few-step re-noising sampler (`samplers/renoise.py`): the recipe step for step, its place
among our samplers (stochastic Euler at an overshoot that clips to 0), the given-latents hook, and
the last step that needs no draw."""

from __future__ import annotations

import pytest
import torch

from avatarstream.samplers import flow_sigmas, sample_stochastic_euler
from avatarstream.samplers.renoise import sample_renoise

SIGMAS = flow_sigmas(4, 5.0)  # FlashHead's table: 1, 0.9375, 0.8333, 0.625, 0


def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A smooth stand-in for a model: depends on x and σ."""
    return torch.tanh(x) * (1.0 + float(sigma)) - 0.3 * x.roll(1, dims=-1)


def test_renoise_is_the_recipe_step_for_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=g)
    draws = torch.randn(4, 2, 3, 5, generator=g)
    seen: list[dict] = []
    out = sample_renoise(velocity, x, SIGMAS, noise=draws, callback=seen.append)
    want = x
    for i in range(4):
        s, s_next = SIGMAS[i], SIGMAS[i + 1]
        x0 = want - s * velocity(want, s)
        want = (1 - s_next) * x0 + s_next * draws[i]
        assert torch.equal(seen[i]["denoised"], x0) and torch.equal(seen[i]["x"], want)
    assert torch.equal(out, want)
    assert [c["sigma_next"] for c in seen] == pytest.approx(SIGMAS[1:].tolist())


def test_last_step_returns_the_clean_estimate_without_a_draw() -> None:
    x = torch.randn(1, 8)
    calls: list[int] = []

    def draw(i: int) -> torch.Tensor:
        calls.append(i)
        return torch.zeros(1, 8)

    out = sample_renoise(velocity, x, SIGMAS, noise=draw)
    assert calls == [0, 1, 2]  # σ_next = 0 at the last step: nothing drawn
    short = sample_renoise(velocity, x, SIGMAS, noise=torch.zeros(3, 1, 8))  # S − 1 draws suffice
    assert torch.equal(out, short)


def test_renoise_equals_stochastic_euler_with_overshoot_clipped_to_zero() -> None:
    x = torch.randn(2, 16)
    ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = sample_stochastic_euler(velocity, x, SIGMAS, overshoot=1e6, generator=ga)
    b = sample_renoise(velocity, x, SIGMAS, noise=lambda i: torch.randn(x.shape, generator=gb))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_given_latents_are_written_before_every_evaluation_and_after_the_last() -> None:
    known = torch.full((1, 2, 4), 7.0)
    inputs: list[torch.Tensor] = []

    def given(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, :2] = known
        return x

    def record(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        inputs.append(x)
        return velocity(x, sigma)

    out = sample_renoise(record, torch.randn(1, 5, 4), SIGMAS, noise=torch.randn(4, 1, 5, 4), given=given)
    assert len(inputs) == 4 and all(torch.equal(x[:, :2], known) for x in inputs)
    assert torch.equal(out[:, :2], known) and not torch.equal(out[:, 2:], known[:, :1].expand(1, 3, 4))


def test_a_model_that_knows_x0_lands_on_it() -> None:
    """With the exact clean estimate (a point mass at x0), every step re-noises the same x0 and the
    last returns it: the sampler adds no error of its own."""
    x0 = torch.randn(3, 6)

    def exact(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return (x - x0) / sigma  # v = (x − x0) / σ

    out = sample_renoise(exact, torch.randn(3, 6), SIGMAS, noise=torch.randn(4, 3, 6))
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
