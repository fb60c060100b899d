"""`avatarstream train personality`: a LoRA that fine-tunes a model to one person (Avatar V §3.3,
personality SFT on cross-scene pairs), for our models and the FlashHead and LiveAvatar families.

    avatarstream train personality --base MODEL --footage DIR [--out FILE] [--run-dir DIR]
        [--steps N] [--batch B] [--lr LR] [--rank R] [--alpha A] [--targets q,k,v,o,ffn.0,ffn.2]
        [--seed S] [--resume] [--max-steps N] [--checkpoint-every N] [--device cpu|cuda]

The adapter: every targeted linear of the DiT (PEFT's `target_modules` rule, weights/lora.py)
gets W' = W + (alpha / rank)·B@A as a parametrization of its weight, so whatever reads the
weight (a forward, a fused kernel, the sink prefill) sees the adapted one; the base weights are
frozen, A starts as PEFT's (Kaiming-uniform, from the run's seed), B at zero (the model starts
as the base), unless the family continues an adapter (LiveAvatar's own). Only A and B train
(AdamW, linear warmup + cosine, gradient clipping). The objective is the family's flow matching
(train/personality_families.py) on the footage's cross-scene pairs (train/personality_data.py).

Output: OUT (default RUN_DIR/personality.safetensors): PEFT keys
`base_model.model.<module>.lora_A.weight` / `lora_B`, the settings and the run in the header
(weights/lora_file.py). Loaded by `generate/serve --lora OUT` (any family: merged into the DiT) or,
for LiveAvatar, whose adapter replaces the release's, as `liveavatar:DIR,lora=OUT`.

Run folder: `ckpt-<step>.safetensors` (`lora.<key>`, `optim.<i>.<state>`) + sidecar through
train/checkpoints.py (written tmp + rename, the sidecar last; the last `keep` kept), `log.jsonl`,
the footage encoded once (ours). Determinism as the trainer's: step s draws from
`step_generator(seed, s)`, so `--resume` continues the uninterrupted run (bit for bit on the same
device and thread count; the tests allow 1e-6). A run folder whose checkpoints were made with
other settings is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from avatarstream.errors import ConfigError
from avatarstream.weights.lora import LoRASettings, target_modules
from avatarstream.weights.lora_file import lora_key, save_lora_file

OUT_NAME = "personality.safetensors"


class LoRADelta(nn.Module):
    """The parametrization W -> W + scale·B@A of one linear's weight `[out, in]`."""

    def __init__(self, out_f: int, in_f: int, rank: int, scale: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(rank, in_f))
        self.lora_B = nn.Parameter(torch.zeros(out_f, rank))
        self.scale = scale

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + (self.scale * (self.lora_B @ self.lora_A)).to(w.dtype)


def add_lora(net: nn.Module, settings: LoRASettings, g: torch.Generator,
             init: dict[str, torch.Tensor] | None = None) -> dict[str, LoRADelta]:
    """Parametrize every targeted weight of `net` (module name -> its `LoRADelta`); A from
    PEFT's init (`kaiming_uniform_(a=√5)`, drawn from g in module order), B zero; or both from
    `init` (PEFT keys, any of its two forms). The base weights stop requiring gradients."""
    from avatarstream.weights.lora import match_lora

    net.requires_grad_(False)
    shapes = {k: tuple(p.shape) for k, p in net.named_parameters()}
    targets = target_modules(shapes, settings)
    if not targets:
        raise ConfigError(f"--targets {','.join(settings.targets)}: no linear of the DiT matches")
    pairs = {}
    if init is not None:
        match = match_lora({k: tuple(t.shape) for k, t in init.items()}, targets, settings, "the adapter it continues")
        if match.problems:
            raise ConfigError("; ".join(match.problems))
        pairs = match.pairs
    deltas: dict[str, LoRADelta] = {}
    for module, (o, i) in sorted(targets.items()):
        d = LoRADelta(o, i, settings.rank, settings.scale)
        with torch.no_grad():
            if init is not None:
                d.lora_A.copy_(init[pairs[module][0]])
                d.lora_B.copy_(init[pairs[module][1]])
            else:  # PEFT: kaiming_uniform_(A, a=√5) -> U(±1/√in); B = 0
                bound = 1.0 / math.sqrt(i)
                d.lora_A.copy_(torch.rand(settings.rank, i, generator=g) * 2 * bound - bound)
        owner = net.get_submodule(module)
        d.to(owner.weight.device)
        parametrize.register_parametrization(owner, "weight", d)
        deltas[module] = d
    return deltas


def adapter_tensors(deltas: dict[str, LoRADelta]) -> dict[str, torch.Tensor]:
    """The adapter under PEFT's keys."""
    out = {}
    for module, d in deltas.items():
        out[lora_key(module, "A")] = d.lora_A.detach().float().cpu().clone()
        out[lora_key(module, "B")] = d.lora_B.detach().float().cpu().clone()
    return out


class PersonalityRun:
    """One personality fine-tuning run (see the module docstring)."""

    def __init__(self, ns: argparse.Namespace) -> None:
        from avatarstream.train.personality_data import Footage
        from avatarstream.train.personality_families import DEFAULT_TARGETS, make_family
        from avatarstream.publish.file import check_writable
        from avatarstream.train.trainer import resolve_device

        self.ns = ns
        self.device = resolve_device(ns.device)
        self.run_dir = Path(ns.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.out = Path(ns.out) if ns.out else self.run_dir / OUT_NAME
        check_writable(self.out)  # before any training: the adapter is written at the end
        if ns.threads:
            torch.set_num_threads(ns.threads)
        self.footage = Footage(ns.footage)
        self.family = make_family(ns.base, self.footage, self.run_dir, batch=ns.batch, seed=ns.seed,
                                  device=str(self.device))
        targets = tuple(t for t in (ns.targets or ",".join(DEFAULT_TARGETS)).split(",") if t)
        self.settings = LoRASettings(rank=ns.rank, alpha=ns.alpha if ns.alpha else float(ns.rank), targets=targets)
        fixed = self.family.fixed
        if fixed is not None and (ns.rank, ns.alpha, ns.targets) != (16, None, None) and self.settings != fixed:
            raise ConfigError(f"{self.family.name}: its loader reads an adapter of rank {fixed.rank}, alpha "
                              f"{fixed.alpha}, targets {','.join(fixed.targets)}; --rank/--alpha/--targets "
                              "cannot change them")
        self.settings = fixed or self.settings
        g = torch.Generator().manual_seed(ns.seed)
        self.deltas = add_lora(self.family.net, self.settings, g, self.family.init_adapter)
        self.params = [p for d in self.deltas.values() for p in (d.lora_A, d.lora_B)]
        self.opt = torch.optim.AdamW(self.params, lr=ns.lr, betas=(0.9, 0.999), weight_decay=0.0)
        self.step = 0
        self.elapsed = 0.0

    # -- identity of a run ------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """What determines the trajectory (not where files are, nor how long to run)."""
        ns = self.ns
        key = {"base": ns.base, "footage": str(Path(ns.footage).resolve()), "settings": [self.settings.rank,
               self.settings.alpha, list(self.settings.targets)], "steps": ns.steps, "batch": ns.batch,
               "lr": ns.lr, "warmup": ns.warmup, "seed": ns.seed, "grad_clip": ns.grad_clip}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    # -- checkpoints ------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        t = {f"lora.{k}": v for k, v in adapter_tensors(self.deltas).items()}
        for i, st in self.opt.state_dict()["state"].items():
            for k, v in st.items():
                t[f"optim.{i}.{k}"] = torch.as_tensor(v).detach().cpu().clone()
        return t

    def save(self) -> Path:
        from avatarstream.train.checkpoints import save_checkpoint

        side = {"step": self.step, "fingerprint": self.fingerprint(), "family": self.family.name,
                "elapsed_s": round(self.elapsed, 3), "saved_at": time.time()}
        return save_checkpoint(self.run_dir, self.step, self.state_tensors(), side, self.ns.keep)

    def restore(self) -> bool:
        from avatarstream.train.checkpoints import load_checkpoint

        ck = load_checkpoint(self.run_dir)
        if ck is None:
            return False
        side, t = ck
        if side.get("fingerprint") != self.fingerprint():
            raise ConfigError(f"{self.run_dir}: its checkpoints were made with other settings (base, footage, "
                              "rank, steps, ...); start a new --run-dir or give the same ones")
        with torch.no_grad():
            for module, d in self.deltas.items():
                d.lora_A.copy_(t[f"lora.{lora_key(module, 'A')}"])
                d.lora_B.copy_(t[f"lora.{lora_key(module, 'B')}"])
        sd = self.opt.state_dict()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in t.items():
            if k.startswith("optim."):
                _, i, name = k.split(".", 2)
                state.setdefault(int(i), {})[name] = v
        sd["state"] = state
        self.opt.load_state_dict(sd)
        self.step = int(side["step"])
        self.elapsed = float(side.get("elapsed_s", 0.0))
        return True

    # -- the loop ---------------------------------------------------------------------------------
    def lr(self) -> float:
        from avatarstream.train.optim import lr_at

        return lr_at(self.step, lr=self.ns.lr, warmup=self.ns.warmup, total=self.ns.steps, min_ratio=0.1)

    def train_step(self) -> dict[str, float]:
        from avatarstream.train.trainer import step_generator

        g = step_generator(self.ns.seed, self.step)
        lr = self.lr()
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss, logs = self.family.loss(g)
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss at step {self.step}: {logs}")
        loss.backward()
        if self.ns.grad_clip > 0:
            logs["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, self.ns.grad_clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        logs["lr"] = lr
        return logs

    @torch.no_grad()
    def eval_loss(self, draws: int = 4) -> float:
        """Mean loss over `draws` fixed generators (the same batches and noise every call): how
        the adapter does, independent of the step's draw."""
        from avatarstream.train.trainer import step_generator

        return float(sum(float(self.family.loss(step_generator(self.ns.seed + 7919, -1 - k))[0])
                         for k in range(draws)) / draws)

    def run(self, progress: Callable[[int, int, int, dict[str, float]], None] | None = None) -> dict[str, Any]:
        """Train to `--steps` (or `--max-steps`); `progress(step, start, stop, logs)` is called before
        the first step (logs empty) and after each one (the CLI draws its bar from it)."""
        from avatarstream.train.checkpoints import atomic_write_bytes, list_checkpoints

        rd, ns = self.run_dir, self.ns
        if list_checkpoints(rd) and not ns.resume:
            raise ConfigError(f"{rd} already holds checkpoints: pass --resume to continue, or another --run-dir")
        resumed = self.restore() if ns.resume else False
        stop = ns.steps if ns.max_steps is None else min(ns.steps, ns.max_steps)
        log_path = rd / "log.jsonl"
        if log_path.exists():  # drop lines logged after the checkpoint we continue from
            keep = [ln for ln in log_path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < self.step]
            atomic_write_bytes(log_path, "".join(ln + "\n" for ln in keep).encode())
        start = self.step
        before = self.eval_loss() if ns.eval_draws and start == 0 else None
        if progress is not None:
            progress(self.step, start, stop, {})
        with open(log_path, "a") as log_f:
            while self.step < stop:
                t0 = time.perf_counter()
                logs = self.train_step()
                dt = time.perf_counter() - t0
                self.elapsed += dt
                self.step += 1
                log_f.write(json.dumps({"step": self.step - 1, **{k: round(v, 6) for k, v in logs.items()},
                                        "step_s": round(dt, 4), "time_s": round(self.elapsed, 2)}) + "\n")
                log_f.flush()
                if self.step % ns.checkpoint_every == 0 or self.step == stop:
                    self.save()
                if progress is not None:
                    progress(self.step, start, stop, logs)
        summary: dict[str, Any] = {"run_dir": str(rd), "family": self.family.name, "base": ns.base,
                                   "resumed": resumed, "start_step": start, "step": self.step, "steps": ns.steps,
                                   "rank": self.settings.rank, "alpha": self.settings.alpha,
                                   "targets": list(self.settings.targets), "pairs": len(self.footage.pairs),
                                   "adapted_linears": len(self.deltas), "time_s": round(self.elapsed, 2)}
        if before is not None:
            summary["eval_loss_before"] = round(before, 6)
        if ns.eval_draws and self.step >= stop:
            summary["eval_loss_after"] = round(self.eval_loss(), 6)
        if self.step >= ns.steps:
            info = {"base": ns.base, "family": self.family.name, "steps": self.step, "footage": str(ns.footage),
                    "pairs": len(self.footage.pairs), "load": self.family.load_hint(ns.base, self.out)}
            if self.family.replaces:
                info["replaces"] = self.family.replaces
            save_lora_file(self.out, adapter_tensors(self.deltas), self.settings, info)
            summary["out"] = str(self.out)
            summary["load"] = info["load"]
            (rd / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def parser(cls: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = cls(prog="avatarstream train personality", add_help=False)
    p.add_argument("--base", required=True, help="the model to adapt: a registry name or weights folder, "
                   "flashhead-pro:DIR / flashhead-lite:DIR, liveavatar:DIR")
    p.add_argument("--footage", required=True, help="a footage folder (avatarstream curate / synth)")
    p.add_argument("--out", default=None, help=f"the adapter file (default RUN_DIR/{OUT_NAME})")
    p.add_argument("--run-dir", default="runs/personality")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop (with a checkpoint) after this many steps in total; the schedule stays --steps'")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="default: the rank (scale 1)")
    p.add_argument("--targets", default=None, help="comma-separated PEFT target_modules "
                   "(default q,k,v,o,ffn.0,ffn.2: attention and FFN linears)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--eval-draws", type=int, default=4, help="fixed draws the loss is measured on before "
                   "and after (0: none)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def run(ns: argparse.Namespace) -> dict[str, Any]:
    for k in ("steps", "batch", "rank", "checkpoint_every", "keep"):
        if getattr(ns, k) < 1:
            raise ConfigError(f"--{k.replace('_', '-')} must be at least 1")
    if ns.max_steps is not None and ns.max_steps < 1:
        raise ConfigError("--max-steps must be at least 1")
    if not ns.lr > 0:
        raise ConfigError("--lr must be positive")
    if ns.no_progress:
        return PersonalityRun(ns).run()
    import sys

    from tqdm import tqdm

    tqdm.write(f"train personality: loading {ns.base} and the footage of {ns.footage} (the first run "
               "encodes it)...", file=sys.stderr)
    r = PersonalityRun(ns)
    tqdm.write(f"train personality: {r.family.name}, {len(r.footage.pairs)} cross-scene pairs, "
               f"{len(r.deltas)} adapted linears" + ("; measuring the loss before..." if ns.eval_draws else ""),
               file=sys.stderr)
    bar: Any = None

    def progress(step: int, start: int, stop: int, logs: dict[str, float]) -> None:
        nonlocal bar
        if bar is None:  # step/total, loss, it/s and ETA (tqdm's)
            bar = tqdm(total=stop, initial=start, desc="train personality", unit="step", file=sys.stderr,
                       dynamic_ncols=True)
        if logs:
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{logs.get('loss', float('nan')):.4f}", refresh=False)

    try:
        return r.run(progress)
    finally:
        if bar is not None:
            bar.close()
