"""Samplers on a 2-D Gaussian-mixture flow with the exact velocity; schedules; text encoder.

For data x0 ~ Σ_k w_k N(μ_k, Σ_k) and x_σ = (1 − σ)·x0 + σ·ε, given component k
x_σ ~ N((1 − σ)μ_k, C_k), C_k = (1 − σ)²Σ_k + σ²I, so the posterior over components r_k(x) and
E[x0 | x_σ, k] = μ_k + (1 − σ)Σ_k C_k⁻¹(x − (1 − σ)μ_k) are closed form; the exact marginal
velocity is v(x, σ) = (x − E[x0 | x_σ]) / σ. A correct sampler driven by it must reproduce the
mixture: assignment fractions, per-component means and covariances, and a small energy distance
to true samples. Deliberately wrong samplers must fail the same check.
"""

from __future__ import annotations

import math

import pytest
import torch

from avatarstream.models.text import BOS, TextConfig, TextEncoder, tokenize
from avatarstream.samplers import (few_step_sigmas, flow_sigmas, sample_euler,
                                   sample_stochastic_euler)

DT = torch.float64
W = torch.tensor([0.5, 0.3, 0.2], dtype=DT)
MU = torch.tensor([[-2.0, 0.0], [2.0, 1.0], [0.0, -2.5]], dtype=DT)
SIG = torch.tensor([[[0.30, 0.10], [0.10, 0.20]],
                    [[0.15, -0.05], [-0.05, 0.40]],
                    [[0.25, 0.0], [0.0, 0.10]]], dtype=DT)
N = 4000


def sample_true(n: int, g: torch.Generator) -> torch.Tensor:
    """[n, 2] samples of the mixture."""
    k = torch.multinomial(W, n, replacement=True, generator=g)
    z = torch.randn(n, 2, generator=g, dtype=DT)
    return MU[k] + (torch.linalg.cholesky(SIG)[k] @ z[:, :, None])[:, :, 0]


def posterior(x: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, 2] at noise level s -> (responsibilities [n, K], E[x0 | x] [n, 2])."""
    c = (1 - s) ** 2 * SIG + s**2 * torch.eye(2, dtype=DT)  # [K, 2, 2]
    ci = torch.linalg.inv(c)
    d = x[:, None, :] - (1 - s) * MU[None]  # [n, K, 2]
    maha = ((d[:, :, None, :] * ci[None]).sum(-1) * d).sum(-1)  # [n, K]
    logp = W.log() - 0.5 * maha - 0.5 * torch.logdet(c) - math.log(2 * math.pi)
    r = torch.softmax(logp, dim=1)
    ek = MU[None] + (1 - s) * (d[:, :, None, :] * (SIG @ ci)[None]).sum(-1)  # [n, K, 2]
    return r, (r[:, :, None] * ek).sum(1)


def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    assert sigma.dim() == 0
    s = float(sigma)
    return (x - posterior(x, s)[1]) / s


def energy_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(2 * torch.cdist(a, b).mean() - torch.cdist(a, a).mean() - torch.cdist(b, b).mean())


def mixture_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Assign each sample to its most probable component: fractions [K], means [K, 2], covs [K, 2, 2]."""
    k = posterior(x, 0.0)[0].argmax(1)
    frac = torch.stack([(k == j).to(DT).mean() for j in range(3)])
    mu = torch.stack([x[k == j].mean(0) for j in range(3)])
    cov = torch.stack([torch.cov(x[k == j].T) for j in range(3)])
    return frac, mu, cov


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    big = sample_true(40000, g)  # assignment statistics of the true distribution (low noise)
    frac, mu, cov = mixture_stats(big)
    return {"frac": frac, "mu": mu, "cov": cov, "held_out": sample_true(N, g)}


def matches(x: torch.Tensor, ref: dict[str, torch.Tensor]) -> tuple[bool, dict[str, float]]:
    """Does x [N, 2] look like the mixture? Tolerances ≈ 3-4 standard errors at N = 4000."""
    if not bool(torch.isfinite(x).all()):
        return False, {"finite": 0.0}
    frac, mu, cov = mixture_stats(x)
    m = {"frac": float((frac - ref["frac"]).abs().max()),
         "mu": float((mu - ref["mu"]).abs().max()),
         "cov": float((cov - ref["cov"]).abs().max()),
         "energy": energy_distance(x, ref["held_out"])}
    ok = m["frac"] < 0.03 and m["mu"] < 0.09 and m["cov"] < 0.07 and m["energy"] < 0.005
    return ok, m


def noise(seed: int) -> torch.Tensor:
    return torch.randn(N, 2, generator=torch.Generator().manual_seed(seed), dtype=DT)


def test_null_check_accepts_true_samples(reference):
    ok, m = matches(sample_true(N, torch.Generator().manual_seed(7)), reference)
    assert ok, m


def test_euler_many_steps_samples_the_mixture(reference):
    out = sample_euler(velocity, noise(1), flow_sigmas(200).to(DT))
    ok, m = matches(out, reference)
    assert ok, m


@pytest.mark.parametrize("overshoot,steps", [(0.2, 50), (1.0, 100)])
def test_stochastic_euler_samples_the_mixture(reference, overshoot, steps):
    g = torch.Generator().manual_seed(3)
    out = sample_stochastic_euler(velocity, noise(2), flow_sigmas(steps).to(DT),
                                  overshoot=overshoot, generator=g)
    ok, m = matches(out, reference)
    assert ok, m


def test_euler_with_shifted_schedule(reference):
    out = sample_euler(velocity, noise(4), flow_sigmas(200, shift=3.0).to(DT))
    ok, m = matches(out, reference)
    assert ok, m


# -- negative checks: the same test must reject wrong samplers -----------------------------------
def _buggy_stochastic(denoise, x, sigmas, *, overshoot, generator, bug):
    """sample_stochastic_euler with one deliberate mistake in the σ update."""
    for i in range(sigmas.numel() - 1):
        s, sn = float(sigmas[i]), float(sigmas[i + 1])
        v = denoise(x, sigmas[i])
        so = max(sn - overshoot * (s - sn), 0.0)
        xo = x + (so - s) * v
        if sn == 0:
            x = xo
            continue
        a = (1 - sn) / (1 - so)
        z = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        if bug == "no_rescale":  # forgets to move the signal coefficient to 1 − σ_next
            x = xo + (sn**2 - (a * so) ** 2) ** 0.5 * z
        elif bug == "renoise_to_sigma":  # re-noises to the current σ instead of σ_next
            x = a * xo + max(s**2 - (a * so) ** 2, 0.0) ** 0.5 * z
        else:
            raise ValueError(bug)
    return x


def test_sign_flipped_velocity_fails(reference):
    out = sample_euler(lambda x, s: -velocity(x, s), noise(1), flow_sigmas(200).to(DT))
    ok, m = matches(out, reference)
    assert not ok, m


@pytest.mark.parametrize("bug", ["no_rescale", "renoise_to_sigma"])
def test_wrong_sigma_update_fails(reference, bug):
    g = torch.Generator().manual_seed(3)
    out = _buggy_stochastic(velocity, noise(2), flow_sigmas(50).to(DT), overshoot=0.2,
                            generator=g, bug=bug)
    ok, m = matches(out, reference)
    assert not ok, m


def test_wrong_euler_step_fails(reference):
    """Euler stepping with the σ *ratio* instead of the σ difference (a wrong update rule)."""
    sig = flow_sigmas(200).to(DT)

    def bad(denoise, x, sigmas):
        for i in range(sigmas.numel() - 1):
            s, sn = float(sigmas[i]), float(sigmas[i + 1])
            x = x + (sn / s - 1.0) * denoise(x, sigmas[i]) * 0.5
        return x

    ok, m = matches(bad(velocity, noise(1), sig), reference)
    assert not ok, m


# -- sampler mechanics -------------------------------------------------------------------------
def test_overshoot_zero_is_euler_and_generator_reproducible():
    x = noise(5)[:64]
    sig = flow_sigmas(8).to(DT)
    a = sample_euler(velocity, x, sig)
    b = sample_stochastic_euler(velocity, x, sig, overshoot=0.0)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    c1 = sample_stochastic_euler(velocity, x, sig, generator=torch.Generator().manual_seed(0))
    c2 = sample_stochastic_euler(velocity, x, sig, generator=torch.Generator().manual_seed(0))
    assert torch.equal(c1, c2)
    assert not torch.equal(c1, a)


def test_denoise_gets_schedule_elements_and_callback():
    sig = flow_sigmas(4, shift=2.0)
    seen, infos = [], []

    def den(x, s):
        assert isinstance(s, torch.Tensor) and s.dim() == 0
        seen.append(float(s))
        return torch.zeros_like(x)

    x = torch.randn(2, 3)
    out = sample_euler(den, x, sig, callback=infos.append)
    assert seen == sig[:-1].tolist()
    assert [i["i"] for i in infos] == [0, 1, 2, 3] and torch.equal(out, x)
    assert infos[-1]["sigma_next"] == 0.0
    seen.clear()
    sample_stochastic_euler(den, x, sig, generator=torch.Generator().manual_seed(0))
    assert seen == sig[:-1].tolist()


def test_one_step_exact_for_point_mass():
    """Data = a single point: v = ε − x0 is exact, so one Euler step lands on x0."""
    x0 = torch.tensor([[1.5, -0.5]])
    eps = torch.randn(16, 2)
    den = lambda x, s: (x - x0) / float(s)  # noqa: E731
    out = sample_euler(den, eps, flow_sigmas(1))
    torch.testing.assert_close(out, x0.expand(16, 2))
    out = sample_stochastic_euler(den, eps, few_step_sigmas([1.0, 0.6, 0.3]),
                                  generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, x0.expand(16, 2))


# -- schedules ---------------------------------------------------------------------------------
def test_flow_sigmas():
    s = flow_sigmas(10)
    assert s.shape == (11,) and s.dtype == torch.float32
    assert s[0] == 1.0 and s[-1] == 0.0 and bool((s[1:] < s[:-1]).all())
    torch.testing.assert_close(s, torch.linspace(1, 0, 11))
    sh = flow_sigmas(10, shift=3.0)
    u = torch.linspace(1, 0, 11, dtype=torch.float64)
    torch.testing.assert_close(sh, (3 * u / (1 + 2 * u)).float())
    assert bool((sh[1:-1] > s[1:-1]).all())  # shift > 1 spends more steps at high noise
    with pytest.raises(ValueError):
        flow_sigmas(0)


def test_few_step_sigmas():
    torch.testing.assert_close(few_step_sigmas([1.0, 0.75, 0.5, 0.25]),
                               torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    torch.testing.assert_close(few_step_sigmas([1.0, 0.5, 0.0]), torch.tensor([1.0, 0.5, 0.0]))
    for bad in ([0.5, 0.7], [1.2, 0.5], [], [0.0]):
        with pytest.raises(ValueError):
            few_step_sigmas(bad)


# -- text encoder ------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [TextConfig.tiny(), TextConfig.small()])
def test_text_encoder_shapes_and_mask(cfg):
    enc = TextEncoder(cfg)
    enc.init_random_(0)
    enc.eval()
    prompts = ["", "a person talking", "ünïcødé ✓ " * 10]
    with torch.no_grad():
        tok, mask = enc.encode(prompts)
    lengths = [1, min(1 + len("a person talking"), cfg.max_len), cfg.max_len]
    assert tok.shape == (3, cfg.max_len, cfg.dim) and mask.shape == (3, cfg.max_len)
    assert mask.dtype == torch.bool
    assert mask.sum(1).tolist() == lengths
    assert bool(mask[:, 0].all())  # BOS always valid: never an all-False mask
    assert bool(torch.isfinite(tok).all())
    assert float(tok[~mask].abs().max()) == 0.0
    # padding does not change the valid tokens; prompts change them
    with torch.no_grad():
        alone, _ = enc.encode(["a person talking"])
        other, _ = enc.encode(["a person walking"])
        empty, me = enc.encode([""])
    torch.testing.assert_close(alone[0], tok[1, : lengths[1]], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(other, alone)
    assert empty.shape == (1, 1, cfg.dim) and me.tolist() == [[True]]


def test_tokenizer_bytes_and_determinism():
    ids, mask = tokenize(["hé"], 16)
    assert ids.tolist() == [[BOS, 104, 0xC3, 0xA9]] and mask.all()
    a, b = TextEncoder(TextConfig.tiny()), TextEncoder(TextConfig.tiny())
    a.init_random_(3)
    b.init_random_(3)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
