"""Optimisers of the trainer: `torch.optim.Muon` for the 2-D weight matrices of transformer
blocks, `torch.optim.AdamW` for everything else (embeddings, norms, biases, modulation tables,
heads, convolutions), as one object whose state is a flat dict of tensors, so checkpoints are
plain safetensors; plus the learning-rate schedule.

Muon (Jordan et al. 2024; Avatar V sec. 3.1): for a matrix W `[out, in]` with gradient G, a
Nesterov momentum buffer, the update orthogonalised by the quintic Newton–Schulz iteration
(coefficients (3.4445, −4.7750, 2.0315), 5 steps: all singular values pushed to ≈ 1), decoupled
weight decay `W <- W (1 − lr wd)`, and the step `lr · 0.2 · sqrt(max(out, in))`
(`adjust_lr_fn = "match_rms_adamw"`, Moonshot's) so the update RMS matches AdamW's and one
learning rate serves both groups.

This replaced our own implementation of the same update (until issue 27). What differs, measured
on fixed gradients (tests/train/test_optim.py, tolerance written there): torch's Newton–Schulz runs
in bfloat16 always (ours could run in float32: `train.muon_bf16`), normalises after the cast and
fuses its products (`addmm`), and keeps its momentum as an average (`lerp`) where ours kept a sum
— the same direction, which the normalisation makes the same update. Its update is within 1.6 %
(relative Frobenius norm) of our float32 one, nearer than our own bfloat16 path was (3.2 %).
AdamW's bias correction counts each parameter's own updates (torch's), where ours counted
optimiser steps; they differ only for a parameter that skips steps (a DMD generator with
`fake_updates` > 1), over its first ~100 updates.

Under FSDP2 (train/distributed.py) the Muon matrices are row shards (DTensors): their step gathers
each update matrix whole for the Newton–Schulz iteration (`distributed.muon_step_sharded`, with
torch's own NS); AdamW runs on the shards as it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# a checkpoint's optimizer state before issue 27 (our Muon): momentum kept as a sum, one AdamW step
# count for every parameter (the sidecar's `opt_t`)
SUM_MOMENTUM_VERSION = 1


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Muon group: 2-D weights inside transformer blocks (`blocks.N....weight`). Everything else
    (embeddings, norms, biases, AdamW-style modulation tables, heads, convolutions) -> AdamW."""
    return p.dim() == 2 and (name.startswith("blocks.") or ".blocks." in name) and name.endswith("weight")


class MuonAdamW:
    """Muon for `is_muon_param` matrices, AdamW for the rest (weight decay on matrices and
    convolutions only, not on norms, biases and gains). Parameters are given with stable names
    (`net.param`); `state_tensors()` / `load_state_tensors()` round-trip the whole state.

    step(lr): lr is the current learning rate of both groups (schedule applied by the caller).
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], *, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 ns_steps: int = 5) -> None:
        self.params = {name: p for name, p in named_params if p.requires_grad}
        self.muon = {name for name, p in self.params.items()
                     if is_muon_param(name.split(".", 1)[1] if "." in name else name, p)}
        self.momentum = momentum
        self.t = 0  # optimiser steps taken
        muon = [p for n, p in self.params.items() if n in self.muon]
        adam = [p for n, p in self.params.items() if n not in self.muon]
        groups = [{"params": [p for p in adam if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in adam if p.dim() < 2], "weight_decay": 0.0}]
        self.opts: list[torch.optim.Optimizer] = []
        # FSDP2 shards: Newton–Schulz needs whole matrices (distributed.muon_step_sharded)
        self.sharded_muon = any(isinstance(p, DTensor) for p in muon)
        if muon:
            self.opts.append(torch.optim.Muon(muon, lr=0.0, weight_decay=weight_decay, momentum=momentum,
                                              nesterov=True, ns_steps=ns_steps, adjust_lr_fn="match_rms_adamw"))
        if adam:
            self.opts.append(torch.optim.AdamW([g for g in groups if g["params"]], lr=0.0, betas=betas, eps=eps))
        # the state exists from the start (torch creates it lazily), so every checkpoint has all keys
        self._state: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            st = self._torch_state(name)
            if name in self.muon:
                st["momentum_buffer"] = self._state[f"muon.{name}"] = torch.zeros_like(p)
            else:
                st["step"] = self._state[f"adam_step.{name}"] = torch.tensor(0.0)
                st["exp_avg"] = self._state[f"adam_m.{name}"] = torch.zeros_like(p)
                st["exp_avg_sq"] = self._state[f"adam_v.{name}"] = torch.zeros_like(p)

    def _torch_state(self, name: str) -> dict[str, torch.Tensor]:
        opt = self.opts[0] if name in self.muon else self.opts[-1]
        return opt.state[self.params[name]]

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.t += 1
        for opt in self.opts:
            for group in opt.param_groups:
                group["lr"] = lr
            if self.sharded_muon and isinstance(opt, torch.optim.Muon):
                from avatarstream.train.distributed import muon_step_sharded

                muon_step_sharded(opt)
            else:
                opt.step()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self._state.items()}

    def live_state(self) -> dict[str, torch.Tensor]:
        """The state tensors themselves (shards where sharded), for in-place distributed
        checkpoint save and load (the step count `t` goes in the sidecar)."""
        return dict(self._state)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], t: int, version: int = 2) -> None:
        """Restore `state_tensors()` output and the step count `t`. A checkpoint written by our
        own Muon (`version` 1) has momentum sums (× (1 − momentum) gives torch's average) and one
        AdamW step count `t` for every parameter."""
        old = version <= SUM_MOMENTUM_VERSION
        want = {k for k in self._state if not (old and k.startswith("adam_step."))}
        missing = want - set(tensors)
        if missing:
            raise KeyError(f"optimizer state lacks {sorted(missing)[:3]}...")
        for k, v in self._state.items():
            if old and k.startswith("adam_step."):
                v.fill_(float(t))
            elif old and k.startswith("muon."):
                v.copy_(tensors[k] * (1 - self.momentum))
            else:
                v.copy_(tensors[k])
        self.t = int(t)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` (the same coefficient `max_norm / (norm + 1e-6)`, at most
    1), with the total norm summed in float64 so that it does not depend on how the gradients are
    sharded: FSDP2 sums the squares of each rank's shard and then over the ranks, one process over
    whole tensors. In float32 those orders differ in the last bits (a2v-tiny on two ranks: 2 ulp
    on an AMD EPYC), every gradient is then scaled by another float32 coefficient, and Muon's
    bfloat16 Newton–Schulz grows that to 4.7e-4 in the weights within 4 steps
    (tests/train/test_distributed.py). In float64 the orders differ ~1e-16 relative, and the
    coefficient, rounded to float32, is the same. Returns the total norm."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)  # a DTensor: reduced over the ranks
    norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
    coef = min(float(torch.tensor(max_norm / (norm + 1e-6), dtype=torch.float32)), 1.0)  # NaN stays NaN
    if coef != 1.0:
        torch._foreach_mul_(grads, coef)
    return norm


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_ratio · lr` at `total`."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    prog = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))
