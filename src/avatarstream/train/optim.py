"""Optimisers of the trainer: Muon for the 2-D weight matrices of transformer blocks, AdamW for
everything else (embeddings, norms, biases, modulation tables, heads, convolutions), one object
with a flat, tensor-only state so checkpoints are plain safetensors.

Muon (Jordan et al. 2024; Avatar V sec. 3.1): for a matrix parameter W `[out, in]` with gradient
G, keep a Nesterov momentum buffer `B <- mu B + G`, take `U = G + mu B`, orthogonalise it with a
quintic Newton–Schulz iteration (`newton_schulz`: `U ≈ UV^T` of its SVD `U S V^T`, i.e. all
singular values pushed to ≈ 1), and step `W <- W (1 - lr wd) - lr · s · O` with the shape scale
`s = 0.2 · sqrt(max(out, in))` so the update RMS matches AdamW's and one learning rate (`lr`)
serves both groups.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton–Schulz coefficients (Muon reference)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate orthogonalisation of a matrix `g [m, n]` -> `[m, n]` float32 whose singular
    values are ≈ 1 (in about [0.7, 1.2] after 5 steps: the quintic trades exactness for speed).
    The iteration runs in `dtype` (bfloat16 as in the Muon reference: half the time of float32
    on a CPU with AVX512-bf16 and on GPUs; float32 for exactness)."""
    if g.dim() != 2:
        raise ValueError(f"newton_schulz expects a matrix, got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFS
    x = g.float()
    x = (x / (x.norm() + eps)).to(dtype)  # spectral norm <= Frobenius norm <= 1
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    x = x.float()
    return x.T if transpose else x


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Muon group: 2-D weights inside transformer blocks (`blocks.N....weight`). Everything else
    (embeddings, norms, biases, AdamW-style modulation tables, heads, convolutions) -> AdamW."""
    return p.dim() == 2 and (name.startswith("blocks.") or ".blocks." in name) and name.endswith("weight")


class MuonAdamW:
    """Muon for `is_muon_param` matrices, AdamW for the rest. Parameters are given with stable
    names (`net.param`); `state_tensors()` / `load_state_tensors()` round-trip the whole state.

    step(lr): lr is the current learning rate of both groups (schedule applied by the caller).
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], *, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 ns_steps: int = 5, muon_scale: float = 0.2, ns_bf16: bool = True) -> None:
        self.params: dict[str, nn.Parameter] = {}
        self.muon: set[str] = set()
        for name, p in named_params:
            if not p.requires_grad:
                continue
            self.params[name] = p
            if is_muon_param(name.split(".", 1)[1] if "." in name else name, p):
                self.muon.add(name)
        self.wd, self.betas, self.eps = weight_decay, betas, eps
        self.momentum, self.ns_steps, self.muon_scale = momentum, ns_steps, muon_scale
        self.ns_dtype = torch.bfloat16 if ns_bf16 else torch.float32
        self.t = 0  # AdamW step count
        self.state: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            if name in self.muon:
                self.state[f"muon.{name}"] = torch.zeros_like(p, dtype=torch.float32)
            else:
                self.state[f"adam_m.{name}"] = torch.zeros_like(p, dtype=torch.float32)
                self.state[f"adam_v.{name}"] = torch.zeros_like(p, dtype=torch.float32)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for name, p in self.params.items():
            if p.grad is None:
                continue
            g = p.grad.float()
            if name in self.muon:
                buf = self.state[f"muon.{name}"]
                buf.mul_(self.momentum).add_(g)
                u = g.add(buf, alpha=self.momentum)  # Nesterov
                o = newton_schulz(u, self.ns_steps, dtype=self.ns_dtype)
                scale = self.muon_scale * math.sqrt(max(p.shape))
                p.mul_(1 - lr * self.wd).add_(o.to(p.dtype), alpha=-lr * scale)
            else:
                m, v = self.state[f"adam_m.{name}"], self.state[f"adam_v.{name}"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                upd = (m / bc1) / ((v / bc2).sqrt() + self.eps)
                decay = self.wd if p.dim() >= 2 else 0.0  # no decay on norms, biases, gains
                p.mul_(1 - lr * decay).add_(upd.to(p.dtype), alpha=-lr)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self.state.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], t: int) -> None:
        missing = set(self.state) - set(tensors)
        if missing:
            raise KeyError(f"optimizer state lacks {sorted(missing)[:3]}...")
        for k in self.state:
            self.state[k].copy_(tensors[k])
        self.t = int(t)


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_ratio · lr` at `total`."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    prog = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))
