"""The training loop: recipe -> run folder with checkpoints, EMA weights, a loss log and plots.

Run folder (`runs/<recipe name>` unless `--run-dir`):

    recipe.json                      the resolved recipe (every default filled in)
    log.jsonl                        one JSON line per step: step, lr, losses, step_s, time_s
    ckpt-<step>.safetensors          model.<net>.<param> (every net the stage uses),
                                     ema.<net>.<param> (trained nets), optim.<state>
    ckpt-<step>.json                 sidecar: step, optimizer step count, recipe fingerprint,
                                     elapsed time; written after the weights: a checkpoint exists
                                     once its sidecar does (both written tmp + rename)
    plots/<key>.png                  loss curves (refreshed at every checkpoint and at the end)
    summary.json                     written when the run reaches its last step

(checkpoint files: train/checkpoints.py; the stage's objective: train/objectives/).

Determinism: the batch and every noise tensor of step s come from a CPU `torch.Generator`
seeded from (seed, s), so a run killed at any time and resumed from its last checkpoint draws
the same batches; with the same device and thread count the resumed weights equal the
uninterrupted run's bit for bit. The last `keep` checkpoints are kept.

Under torchrun (train/distributed.py) every rank runs this loop on its micro-batches of the step's
global batch (`step_generator(seed, step, m)` for micro-batch m), the networks wrapped in DDP or
FSDP2; checkpoints are DCP folders `ckpt-<step>/` with the same sidecar, and rank 0 alone writes
the log, plots, recipe.json and summary.json.

Lengthening a run: `--resume --set train.steps=N` on a run whose checkpoints differ from the
recipe only in `train.steps` continues it, with the learning-rate schedule from the checkpoint on
following the new length (so it is not the run a fresh N-step recipe would make). Each change is
recorded in the checkpoints' sidecars and in summary.json as `steps_changed`: [[step, from, to]].
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import ConfigError
from avatarstream.hardware import resolve_bf16
from avatarstream.train import distributed
from avatarstream.train.checkpoints import (CKPT_VERSION, atomic_write_bytes, list_checkpoints, load_checkpoint,
                                            load_init, net_weights, save_checkpoint)
from avatarstream.train.nets import vae_for
from avatarstream.train.objectives import Task, make_task
from avatarstream.train.optim import MuonAdamW, clip_grad_norm, lr_at
from avatarstream.train.recipe import fingerprint


def _with_steps(recipe: dict[str, Any], steps: int) -> dict[str, Any]:
    return {**recipe, "train": {**recipe["train"], "steps": steps}}


def _with_batch(recipe: dict[str, Any], batch: int) -> dict[str, Any]:
    return {**recipe, "train": {**recipe["train"], "batch": batch}}


def step_generator(seed: int, step: int, micro: int = 0) -> torch.Generator:
    """The CPU generator of one step (of its micro-batch `micro`; 0: the step's whole batch when it
    is one micro-batch): a 63-bit mix of (seed, step, micro)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + micro * 0xD6E8FEB86659FD93
         + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return torch.Generator().manual_seed(x & (2**63 - 1))


def resolve_device(name: str | None) -> torch.device:
    name = name or "cpu"
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ConfigError(f"--device must be cpu or cuda, got {name!r}")
    if name.startswith("cuda"):
        # deterministic cuBLAS (must be set before the first CUDA call) and kernels, so that
        # resuming reproduces the uninterrupted run on a GPU too
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here (use --device cpu)")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    return torch.device(name)


class Trainer:
    """One training run of a resolved recipe (see `recipe.py`) in `run_dir`. `micro_batches`: the
    global batch is drawn as that many micro-batches (default: one per rank; a one-process run
    with M accumulates the gradients of M, the same global batch as M ranks); `shard`: ddp, fsdp
    or auto under torchrun (train/distributed.py)."""

    def __init__(self, recipe: dict[str, Any], run_dir: str | Path, *, device: str | None = "cpu",
                 max_steps: int | None = None, progress: bool = True, shard: str = "auto",
                 micro_batches: int | None = None) -> None:
        self.recipe = recipe
        self.tr = recipe["train"]
        self.run_dir = Path(run_dir)
        self.device = resolve_device(device)
        self.max_steps = max_steps
        self.rank = distributed.rank()
        self.progress = progress and self.rank == 0
        if self.tr["threads"]:
            torch.set_num_threads(int(self.tr["threads"]))
        self.micro = micro_batches or distributed.world()
        self.mine = distributed.my_micro_batches(self.tr["batch"], self.micro)
        self.task: Task = make_task(_with_batch(recipe, self.tr["batch"] // self.micro), self.device)
        for net, src in recipe["init"].items():
            if src and net in self.task.nets:
                sd = net_weights(src, net)
                if net == "vae":  # the variant the weights were trained as (loaded: see vae_for)
                    self.task.nets[net] = vae_for(recipe["model"], sd)
                else:
                    load_init(self.task.nets[net], sd, f"init.{net} = {src}")
        self.task.after_init()
        for name, net in self.task.nets.items():
            net.to(self.device)
            train = name in self.task.trainable
            net.train(train)
            net.requires_grad_(train)
        self.task.freeze()
        self.shard = distributed.resolve_shard(shard, self.task) if distributed.active() else None
        # DDP / FSDP2 around the trainable nets (FSDP2 turns their parameters into shards in place)
        self.model = distributed.wrap(self.task, self.shard, self.device) if self.shard else None
        self.named = [(f"{n}.{k}", p) for n in self.task.trainable
                      for k, p in self.task.nets[n].named_parameters()]
        self.opt = MuonAdamW(self.named, weight_decay=self.tr["weight_decay"], betas=tuple(self.tr["betas"]),
                             momentum=self.tr["muon_momentum"])
        self.bf16 = resolve_bf16(self.tr["bf16"], self.device)
        self.ema = {k: p.detach().float().clone() for k, p in self.named}
        self.steps_changed: list[list[int]] = []  # [[step, from, to]] when --resume changed train.steps
        self.step = 0
        self.elapsed = 0.0
        self._timing = (0.0, 0.0)

    # -- state ------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        t: dict[str, torch.Tensor] = {}
        for name, net in self.task.nets.items():
            for k, v in net.state_dict().items():
                t[f"model.{name}.{k}"] = v.detach().cpu().clone().contiguous()
        for k, v in self.ema.items():
            t[f"ema.{k}"] = v.detach().cpu().clone().contiguous()
        for k, v in self.opt.state_tensors().items():
            t[f"optim.{k}"] = v.clone()
        return t

    def live_state(self) -> dict[str, torch.Tensor]:
        """The keys of `state_tensors` mapped to the live tensors (shards under FSDP2): what a
        distributed checkpoint saves from and loads into, in place."""
        t: dict[str, torch.Tensor] = {}
        for name, net in self.task.nets.items():
            for k, v in net.state_dict().items():
                t[f"model.{name}.{k}"] = v
        t.update({f"ema.{k}": v for k, v in self.ema.items()})
        t.update({f"optim.{k}": v for k, v in self.opt.live_state().items()})
        return t

    def save_checkpoint(self) -> Path:
        side = {"step": self.step, "opt_t": self.opt.t,
                "fingerprint": fingerprint(self.recipe), "stage": self.recipe["stage"],
                "model": self.recipe["model"], "trainable": list(self.task.trainable),
                "elapsed_s": round(self.elapsed, 3), "saved_at": time.time(),
                "steps": self.tr["steps"], "steps_changed": self.steps_changed,
                "micro_batches": self.micro, "world": distributed.world()}
        if self.shard:
            side["shard"] = self.shard
            return distributed.save_dcp(self.run_dir, self.step, self.live_state(), side, self.tr["keep"])
        return save_checkpoint(self.run_dir, self.step, self.state_tensors(), side, self.tr["keep"])

    def restore(self) -> bool:
        found = list_checkpoints(self.run_dir)
        if self.shard and found and found[0][2].is_dir():  # DCP: every rank loads its shards in place
            side = json.loads(found[0][1].read_text())
            self._check_resume(side)
            distributed.load_dcp(found[0][2], self.live_state())
        else:
            ck = load_checkpoint(self.run_dir)
            if ck is None:
                return False
            side, t = ck
            self._check_resume(side)
            if self.shard:  # a one-process checkpoint: each rank takes its part of the whole tensors
                if side.get("version", 1) != CKPT_VERSION:
                    raise ConfigError(f"{self.run_dir}: a checkpoint this old resumes in one process only")
                distributed.copy_full(self.live_state(), t)
            else:
                self._load_tensors(side, t)
        self.opt.t = int(side["opt_t"])
        self.step = int(side["step"])
        self.elapsed = float(side.get("elapsed_s", 0.0))
        return True

    def _check_resume(self, side: dict[str, Any]) -> None:
        """Refuse a checkpoint of another trajectory; record a changed `train.steps`."""
        if int(side.get("micro_batches", 1)) != self.micro:
            raise ConfigError(f"{self.run_dir}: its checkpoints split the global batch in "
                              f"{side.get('micro_batches', 1)} micro-batches, this run in {self.micro} "
                              f"(resume with --micro-batches {side.get('micro_batches', 1)})")
        self.steps_changed = [list(c) for c in side.get("steps_changed", [])]
        if side.get("fingerprint") != fingerprint(self.recipe):
            old = self._planned_steps(side)
            if old is None or fingerprint(_with_steps(self.recipe, old)) != side.get("fingerprint"):
                raise ConfigError(f"{self.run_dir}: its checkpoints were made with a different recipe "
                                  "(start a new --run-dir, or restore the recipe; only train.steps may "
                                  "change on --resume)")
            if self.tr["steps"] <= int(side["step"]):
                raise ConfigError(f"{self.run_dir}: train.steps={self.tr['steps']} is not past its last "
                                  f"checkpoint (step {side['step']})")
            self.steps_changed.append([int(side["step"]), int(old), int(self.tr["steps"])])

    def _load_tensors(self, side: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
        for name, net in self.task.nets.items():
            pre = f"model.{name}."
            net.load_state_dict({k[len(pre):]: v for k, v in t.items() if k.startswith(pre)})
        for k in self.ema:
            self.ema[k].copy_(t[f"ema.{k}"])
        self.opt.load_state_tensors({k[6:]: v for k, v in t.items() if k.startswith("optim.")},
                                    side["opt_t"], side.get("version", 1))

    def _planned_steps(self, side: dict[str, Any]) -> int | None:
        """The run length the checkpoint was trained for: its sidecar's, else the run's recipe.json
        (checkpoints written before sidecars carried it)."""
        if "steps" in side:
            return int(side["steps"])
        rec = self.run_dir / "recipe.json"
        if rec.is_file():
            return int(json.loads(rec.read_text())["train"]["steps"])
        return None

    # -- loop -------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    @torch.no_grad()
    def _ema_update(self) -> None:
        d = min(self.tr["ema"], (1 + self.step) / (10 + self.step))
        for k, p in self.named:
            if p.requires_grad:  # a frozen part keeps its exact weights (no rounding drift)
                self.ema[k].mul_(d).add_(p.detach().float(), alpha=1 - d)

    def train_step(self) -> dict[str, float]:
        """One optimiser step at self.step (this rank's micro-batches of the global batch, the
        gradients averaged over them and over the ranks); returns the logged values (means over
        the global batch)."""
        lr = lr_at(self.step, lr=self.tr["lr"], warmup=self.tr["warmup"], total=self.tr["steps"],
                   min_ratio=self.tr["min_lr_ratio"])
        t0 = time.perf_counter()
        rows, used = [], set()
        for j, m in enumerate(self.mine):
            g = step_generator(self.tr["seed"], self.step, m)
            last = j == len(self.mine) - 1
            with distributed.accumulating(self.model, last) if self.model else contextlib.nullcontext():
                with self._autocast():
                    loss, logs = self.model(g) if self.model else self.task.loss(g)
                if self.shard == "fsdp":
                    used |= distributed.graph_parameters(self.model, loss)
                if distributed.agree(not bool(torch.isfinite(loss))):
                    raise RuntimeError(f"non-finite loss at step {self.step}: {logs}")
                (loss if len(self.mine) == 1 else loss / len(self.mine)).backward()
            rows.append(logs)
        logs = distributed.mean_logs(rows)
        if self.shard == "fsdp":
            distributed.drop_unused_grads(self.named, used)
        t1 = time.perf_counter()
        if self.tr["grad_clip"] > 0:
            logs["grad_norm"] = clip_grad_norm([p for _, p in self.named], self.tr["grad_clip"])
        self.opt.step(lr)
        self.opt.zero_grad()
        self._ema_update()
        logs["lr"] = lr
        self._timing = (t1 - t0, time.perf_counter() - t1)
        return logs

    def run(self, *, resume: bool = False) -> dict[str, Any]:
        """Train until the recipe's `steps` (or `max_steps`); returns a summary dict."""
        from avatarstream.train.plot import plot_losses

        rd = self.run_dir
        if list_checkpoints(rd) and not resume:
            raise ConfigError(f"{rd} already holds checkpoints: pass --resume to continue, or another --run-dir")
        resumed = self.restore() if resume else False
        main = self.rank == 0  # the one rank that writes the log, plots and summary
        rd.mkdir(parents=True, exist_ok=True)
        log_path = rd / "log.jsonl"
        if main:
            (rd / "recipe.json").write_text(json.dumps(self.recipe, indent=1, sort_keys=True))
        if main and log_path.exists():  # drop lines logged after the checkpoint we continue from
            keep = [ln for ln in log_path.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] < self.step]
            atomic_write_bytes(log_path, "".join(ln + "\n" for ln in keep).encode())
        total = self.tr["steps"]
        stop = total if self.max_steps is None else min(total, self.max_steps)
        start = self.step
        bar = None
        if self.progress:
            import sys

            from tqdm import tqdm
            bar = tqdm(total=stop, initial=start, desc=f"train {self.recipe['name']}", unit="step",
                       file=sys.stderr, dynamic_ncols=True)
        last_ckpt = time.monotonic()
        step_times: list[float] = []
        logs: dict[str, float] = {}
        with open(log_path, "a") if main else open(os.devnull, "w") as log_f:
            while self.step < stop:
                t0 = time.perf_counter()
                logs = self.train_step()
                dt = time.perf_counter() - t0
                step_times.append(dt)
                self.elapsed += dt
                self.step += 1
                row = {"step": self.step - 1, **{k: round(v, 6) for k, v in logs.items()},
                       "step_s": round(dt, 4), "fwd_bwd_s": round(self._timing[0], 4),
                       "opt_s": round(self._timing[1], 4), "time_s": round(self.elapsed, 2)}
                log_f.write(json.dumps(row) + "\n")
                log_f.flush()
                if bar is not None:
                    bar.update(1)
                    shown = {k: f"{logs[k]:.4f}" for k in getattr(self.task, "progress_keys", ()) if k in logs}
                    bar.set_postfix(loss=f"{logs['loss']:.4f}", **shown, s_per_step=f"{dt:.2f}")
                due = (self.step % self.tr["checkpoint_every"] == 0
                       or distributed.agree(time.monotonic() - last_ckpt >= 60 * self.tr["checkpoint_minutes"])
                       or self.step == stop)
                if due:
                    self.save_checkpoint()
                    last_ckpt = time.monotonic()
                    if main and (self.step % max(1, self.tr["plot_every"]) == 0 or self.step == stop):
                        log_f.flush()
                        plot_losses(rd)
        if bar is not None:
            bar.close()
        if not main:
            return {"run_dir": str(rd), "rank": self.rank, "step": self.step}
        plots = plot_losses(rd)
        rows = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.strip()]
        first = [r["loss"] for r in rows[: max(1, min(10, len(rows) // 5))]]
        lastl = [r["loss"] for r in rows[-max(1, min(10, len(rows) // 5)):]]
        summary = {"run_dir": str(rd), "recipe": self.recipe["name"], "stage": self.recipe["stage"],
                   "model": self.recipe["model"], "device": str(self.device), "bf16": self.bf16,
                   "resumed": resumed, "start_step": start, "step": self.step, "steps": total,
                   "loss_first": round(sum(first) / max(1, len(first)), 5) if rows else None,
                   "loss_last": round(sum(lastl) / max(1, len(lastl)), 5) if rows else None,
                   "step_s_median": round(sorted(step_times)[len(step_times) // 2], 4) if step_times else None,
                   "params": {n: sum(p.numel() for p in self.task.nets[n].parameters())
                              for n in self.task.trainable},
                   "plots": [str(p) for p in plots]}
        if self.shard:
            summary.update(world=distributed.world(), shard=self.shard, micro_batches=self.micro)
        if self.steps_changed:
            summary["steps_changed"] = self.steps_changed
        if self.step >= total:
            (rd / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
