"""The optimiser pair: which parameters Muon takes, and that torch's Muon and AdamW compute the
updates of our former implementation (train/optim.py before issue 27, written out here as the
reference) on fixed gradients, to the tolerances below; checkpoints of the former optimiser load."""

from __future__ import annotations

import math

import pytest
import torch

from avatarstream.train.nets import build_nets
from avatarstream.train.optim import MuonAdamW, is_muon_param

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def former_newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Our former quintic Newton–Schulz iteration, in float32 (`train.muon_bf16 = false`)."""
    a, b, c = NS_COEFFS
    x = g.float()
    x = x / (x.norm() + eps)
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if transpose else x


def former_muon_steps(w: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, mu: float) -> torch.Tensor:
    """Our former Muon: momentum kept as a sum, Nesterov, decoupled decay, 0.2·sqrt(max(shape))."""
    w, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        buf.mul_(mu).add_(g)
        o = former_newton_schulz(g.add(buf, alpha=mu))
        w.mul_(1 - lr * wd).add_(o, alpha=-lr * 0.2 * math.sqrt(max(w.shape)))
    return w


def former_adamw_steps(w: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float,
                       b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8) -> torch.Tensor:
    """Our former AdamW (no decay on vectors), one step count for every parameter."""
    w, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, 1):
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        upd = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        w.mul_(1 - lr * (wd if w.dim() >= 2 else 0.0)).add_(upd, alpha=-lr)
    return w


def test_muon_update_is_orthogonal_and_groups_are_right():
    nets = build_nets("tiny")
    named = [(f"dit.{k}", p) for k, p in nets["dit"].named_parameters()]
    groups = {k for k, p in named if is_muon_param(k.split(".", 1)[1], p)}
    assert "dit.blocks.0.self_attn.q.weight" in groups and "dit.blocks.1.ffn.2.weight" in groups
    for k in ("dit.patch_embedding.weight", "dit.blocks.0.modulation", "dit.blocks.0.self_attn.q.bias",
              "dit.head.head.weight", "dit.text_embedding.0.weight", "dit.blocks.0.norm3.weight"):
        assert k not in groups, k
    w = torch.nn.Parameter(torch.randn(32, 64))
    opt = MuonAdamW([("net.blocks.0.w.weight", w)], weight_decay=0.0, momentum=0.0)
    assert opt.muon == {"net.blocks.0.w.weight"}
    before = w.detach().clone()
    w.grad = torch.randn(32, 64)
    opt.step(lr=0.01)
    delta = (before - w.detach()) / (0.01 * 0.2 * 64 ** 0.5)
    s = torch.linalg.svdvals(delta)
    assert s.min() > 0.6 and s.max() < 1.25


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (48, 48), (256, 1024)])
def test_torch_muon_computes_our_former_update(shape):
    """Three steps (momentum 0.95, weight decay 0.01, lr 0.01) on fixed gradients: the change of
    the weights is our former float32 update within 3 % (relative Frobenius norm). Measured
    0.009-0.016: torch's Newton–Schulz runs in bfloat16 (our former bfloat16 path, the default
    where bf16 is fast, was 0.020-0.032 from the float32 one), and its momentum is an average,
    (1 − μ)× our sum, which the normalisation before the iteration cancels."""
    g = torch.Generator().manual_seed(sum(shape))
    w0 = torch.randn(*shape, generator=g)
    grads = [torch.randn(*shape, generator=g) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = MuonAdamW([("net.blocks.0.w.weight", p)], weight_decay=0.01, momentum=0.95)
    want = former_muon_steps(w0, grads, lr=0.01, wd=0.01, mu=0.95)
    for grad in grads:
        p.grad = grad.clone()
        opt.step(0.01)
    err = float((p.detach() - want).norm() / (want - w0).norm())
    assert err < 0.03, err


@pytest.mark.parametrize("name,shape", [("net.head.weight", (32, 16)), ("net.norm.bias", (16,)),
                                        ("net.conv.weight", (4, 3, 3, 3))])
def test_torch_adamw_computes_our_former_update(name, shape):
    """Seven steps on fixed gradients: torch's AdamW is our former update to float rounding
    (tolerance 3e-7 relative to each weight, about 2 ulp; measured: equal, or 1 ulp apart),
    decay on matrices and convolutions only."""
    g = torch.Generator().manual_seed(len(shape))
    w0 = torch.randn(*shape, generator=g)
    grads = [torch.randn(*shape, generator=g) for _ in range(7)]
    p = torch.nn.Parameter(w0.clone())
    opt = MuonAdamW([(name, p)], weight_decay=0.01)
    assert not opt.muon
    for grad in grads:
        p.grad = grad.clone()
        opt.step(1e-3)
    want = former_adamw_steps(w0, grads, lr=1e-3, wd=0.01)
    assert torch.allclose(p.detach(), want, rtol=3e-7, atol=0.0)
    assert not torch.allclose(want, w0, rtol=1e-4, atol=0.0)  # the steps moved the weights


def test_state_round_trips_and_a_former_checkpoint_loads():
    """`state_tensors` holds every key from the start and loads back exactly; a checkpoint of the
    former optimiser (version 1: momentum sums, one step count) loads as torch's state: the sum
    × (1 − μ), every AdamW step count = the sidecar's."""
    params = [("net.blocks.0.w.weight", torch.nn.Parameter(torch.randn(8, 4))),
              ("net.norm.weight", torch.nn.Parameter(torch.randn(4)))]
    opt = MuonAdamW(params, momentum=0.9)
    assert set(opt.state_tensors()) == {"muon.net.blocks.0.w.weight", "adam_m.net.norm.weight",
                                        "adam_v.net.norm.weight", "adam_step.net.norm.weight"}
    for _, p in params:
        p.grad = torch.randn(p.shape)
    opt.step(1e-3)
    saved = opt.state_tensors()
    other = MuonAdamW(params, momentum=0.9)
    other.load_state_tensors(saved, opt.t)
    assert all(torch.equal(v, saved[k]) for k, v in other.state_tensors().items())
    old = {"muon.net.blocks.0.w.weight": torch.full((8, 4), 2.0), "adam_m.net.norm.weight": torch.ones(4),
           "adam_v.net.norm.weight": torch.ones(4)}
    other.load_state_tensors(old, 7, version=1)
    st = other.state_tensors()
    assert torch.allclose(st["muon.net.blocks.0.w.weight"], torch.full((8, 4), 0.2))
    assert float(st["adam_step.net.norm.weight"]) == 7.0 and other.t == 7
    with pytest.raises(KeyError):
        other.load_state_tensors(old, 7)  # version 2 needs the step counts
