"""Training under torchrun: data parallelism (DDP, or FSDP2 sharding parameters, gradients and
optimizer state), distributed checkpoints, Muon on sharded matrices (the launcher of
`avatarstream train --nproc N` is train/launch.py).

    torchrun --nproc-per-node N -m avatarstream.cli train RECIPE [--shard ddp|fsdp] ...
    avatarstream train RECIPE --nproc N ...          # starts that torchrun (standalone) for you

**The global batch.** A step's batch of `train.batch` samples is drawn as M micro-batches of
B / M samples, micro-batch m from its own generator `step_generator(seed, step, m)` (M = 1: the
one generator of a one-process run, so its trajectory is unchanged). Rank r of W computes the
micro-batches r·M/W ... (r+1)·M/W − 1 (its slice), each loss divided by its M/W micro-batches, and
the gradients are averaged over the ranks: the gradient of the mean loss over the M micro-batches.
M defaults to W (`--micro-batches`), so a two-process run draws exactly what a one-process run with
`--micro-batches 2` (gradient accumulation) draws: that is "the same global batch", and the tests
compare the two (tests/train/test_distributed.py, tolerances there). M is recorded in every
checkpoint; a resume with another M is refused (another trajectory).

**Wrapping.** The objectives call many methods of their networks (`audio.frames`,
`dit.encode_reference`, the blocks' `attn_in` / `cross` / ...), not just `forward`, so the trainable
networks go into one `TaskModule` whose `forward(g)` is the task's loss, and that is what is wrapped:
- `ddp`: `DistributedDataParallel(TaskModule)` (find_unused_parameters: a DMD generator skips
  steps, a dropped stream leaves parameters unused). Every rank holds everything; gradients are
  all-reduced in buckets during the backward pass.
- `fsdp`: FSDP2 (`fully_shard`), each DiT block its own unit, then the TaskModule (the rest).
  Parameters, gradients, optimizer state and EMA weights are DTensors sharded on dim 0 (each
  rank holds 1/W of every tensor) between steps. A block's unit all-gathers the block at each
  call of one of its methods (`mods`, `attn_in`, `attn_out`, `cross`, `ffn_out`, registered as
  forward methods) and frees it after: in the forward pass one block is whole at a time (tested);
  the backward re-gathers a block for each call's backward and frees it after (FSDP2's design,
  with its prefetch of the next block; not measured here). Its gradients are
  reduce-scattered after each call's backward; the root unit's once after the backward pass. A
  parameter one rank's data leaves unused is reduce-scattered as zeros
  (`set_reduce_scatter_unused_params`); one unused on every rank gets no gradient, as in one
  process (AdamW then skips it, weight decay included): the ranks OR a bitmap of the parameters
  each one's autograd graph reached (`graph_parameters`, the counterpart of DDP's
  find_unused_parameters).
  Every collective must be issued by every rank in the same order, so per-block units need every
  rank to call the blocks alike whatever it drew. a2v (and CFG distillation, its subclass) do:
  `Task.block_units`. What differed (counted per rank, a2v-tiny step 0): rank 1's micro-batch
  dropped every reference (p_drop_ref), so `encode_reference` kept no frame and called no block,
  while rank 0 called each block's `mods`/`attn_in` twice (reference and generation passes):
  the ranks' all-gathers no longer matched and the run hung. Under these units (`same_calls`)
  the objective then also runs the reference pass on its first frame and hands its outputs to
  `Task.masked`; TaskModule adds them to the loss times 0, so the backward visits them too, and
  `graph_parameters` does not follow them (the reference-only motion extractor stays unused, as
  in one process); the generation pass still sees no reference, so the loss and every gradient
  are one process's. FSDP2 also routes a call's inputs through one autograd node, which would
  sum the gradients text and audio get from a block's keys and values before the other blocks'
  (another float order, which Muon's bfloat16 Newton-Schulz grows past the tolerance within 4
  steps): `cross` hands them to its unit past that node (`_pass_context_through`). Two-process
  a2v-tiny then equals the one-process run bit for bit (tests/train/test_distributed.py). Every
  other task (causal, diffusion forcing and DMD, whose block calls were not audited for data
  dependence, DMD's rollouts varying; SR) is sharded as one unit, the TaskModule: gathered once
  when a step starts, gradients reduce-scattered once after its backward pass.
`auto` (the default) picks fsdp when a trained network has DiT blocks, ddp otherwise (the VAE).
Frozen networks (a teacher) are not wrapped: every rank keeps a whole copy.

**Muon under FSDP2.** Newton–Schulz orthogonalisation needs the whole matrix (it multiplies
X Xᵀ); a row shard orthogonalised alone is a different update. The momentum update (elementwise)
runs on the local shards; the Nesterov update matrix is then gathered whole (`full_tensor`, one
all-gather), matrix i is orthogonalised by rank i mod W only (round robin: the NS work is split
over the ranks), broadcast from that rank, and each rank applies its own rows with torch's step
(decoupled weight decay, `match_rms_adamw` learning-rate scale). The NS and learning-rate
functions are torch's own (`torch.optim._muon`), so a matrix gets the update `torch.optim.Muon`
gives it in one process, bit for bit when the gathered update is the same. AdamW needs nothing:
torch's AdamW is elementwise and runs on the shards. Under DDP every rank holds whole matrices and
`torch.optim.Muon` runs unchanged.

**Checkpoints** are torch's distributed checkpoint (DCP) folders `ckpt-<step>/` of the same keys as
a one-process run's safetensors file (model, EMA, optimizer state: each rank writes its shards),
plus each rank's RNG state; rank 0 writes the JSON sidecar after every rank finished (a checkpoint
exists once its sidecar does, train/checkpoints.py). The data position is the step: every batch is
drawn from generators seeded by (seed, step, micro-batch). Resume at the same world size, shard
mode and M continues bit for bit (tested); another world size loads too and continues the same
trajectory within float rounding (tested: a two-process run continued in one process; checked by
hand: a one-process run continued on two). A one-process reader (`train
export`, `[init]`, a one-process `--resume`) reads a DCP checkpoint whole: nothing to convert.

The run folder must be on a filesystem every rank sees (one machine: any folder).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from avatarstream.errors import ConfigError
from avatarstream.models.dit_blocks import DiTBlock
from avatarstream.train.checkpoints import prune, write_sidecar

SHARDS = ("auto", "ddp", "fsdp")
BLOCK_METHODS = ("mods", "attn_in", "attn_out", "cross_unit", "ffn_out")


def active() -> bool:
    """A process group is up: this process is one rank of a torchrun job."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def join(device: str) -> str:
    """Join torchrun's group over `env://` (NCCL on CUDA, gloo on CPUs) when this process is one of
    its ranks; returns the device this rank trains on (CUDA: the GPU of its local rank)."""
    from avatarstream.parallel.run import launched_by_torchrun

    if not launched_by_torchrun() or active():
        return device
    env = os.environ
    cuda = device.startswith("cuda")
    if cuda:
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here (use --device cpu)")
        device = f"cuda:{int(env.get('LOCAL_RANK', env['RANK'])) % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=int(env["RANK"]),
                            world_size=int(env["WORLD_SIZE"]), timeout=timedelta(minutes=30),
                            **({"device_id": torch.device(device)} if cuda else {}))
    return device


def _flags(values: list[int]) -> torch.Tensor:
    """An int tensor on the device the group's backend reduces on (NCCL: this rank's GPU)."""
    on = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    return torch.tensor(values, dtype=torch.int32, device=on)


def leave() -> None:
    if active():
        dist.destroy_process_group()


# -- the global batch -------------------------------------------------------------------------------
def check_split(batch: int, micro: int, ranks: int) -> None:
    """A global batch of `batch` samples drawn as `micro` micro-batches shared by `ranks` ranks."""
    if ranks < 1:
        raise ConfigError("--nproc must be at least 1")
    if micro < 1 or batch % micro:
        raise ConfigError(f"train.batch = {batch} does not split into {micro} micro-batches (one per "
                          "process unless --micro-batches): use a batch that is a multiple")
    if micro % ranks:
        raise ConfigError(f"--micro-batches {micro} cannot be shared by {ranks} processes (use a multiple of {ranks})")


def my_micro_batches(batch: int, micro: int) -> range:
    """The micro-batches of the global batch this rank computes (a contiguous slice)."""
    w, r = world(), rank()
    check_split(batch, micro, w)
    per = micro // w
    return range(r * per, (r + 1) * per)


def mean_logs(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean of the logged values of every micro-batch of every rank (keys in first-seen
    order; a key some micro-batches lack is averaged over those that have it)."""
    if world() > 1:
        parts: list[Any] = [None] * world()
        dist.all_gather_object(parts, rows)
        rows = [r for part in parts for r in part]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: sum(r[k] for r in rows if k in r) / sum(1 for r in rows if k in r) for k in keys}


def agree(flag: bool) -> bool:
    """True on every rank when it is true on any (a time-based checkpoint decided by one clock)."""
    if world() == 1:
        return flag
    t = _flags([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def full_value(x: torch.Tensor) -> float:
    """A (possibly DTensor) scalar as a float."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


# -- wrapping ---------------------------------------------------------------------------------------
class TaskModule(nn.Module):
    """The trainable networks of a task as one module whose forward is the task's loss: the module
    DDP and FSDP2 wrap, so their hooks see every parameter a step uses, whichever methods of its
    networks the objective calls."""

    def __init__(self, task: Any) -> None:
        super().__init__()
        self.nets = nn.ModuleDict({n: task.nets[n] for n in task.trainable})
        self.task = task

    def forward(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        self.task.masked = []
        loss, logs = self.task.loss(g)
        if self.task.masked:  # in the graph, so every rank's backward calls the blocks alike
            loss = loss + 0.0 * sum(t.float().sum() for t in self.task.masked)
        return loss, logs


def resolve_shard(shard: str, task: Any) -> str:
    if shard not in SHARDS:
        raise ConfigError(f"--shard must be one of {', '.join(SHARDS)}, got {shard!r}")
    only = getattr(task, "shards", None)  # a task that runs under some wrappers only (alignment: ddp)
    if only is not None:
        if shard != "auto" and shard not in only:
            raise ConfigError(f"--shard {shard}: the {task.stage} stage runs under {' or '.join(only)} only")
        return only[0] if shard == "auto" else shard
    if shard != "auto":
        return shard
    has_blocks = any(isinstance(m, DiTBlock) for n in task.trainable for m in task.nets[n].modules())
    return "fsdp" if has_blocks else "ddp"


def wrap(task: Any, shard: str, device: torch.device) -> nn.Module:
    """The task's trainable networks wrapped for data parallelism (module docstring); FSDP2
    replaces their parameters by DTensor shards in place, so build the optimizer afterwards."""
    mod = TaskModule(task)
    if shard == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(mod, device_ids=[device] if device.type == "cuda" else None,
                                       find_unused_parameters=True, forward_sync_buffers=False)
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if task.block_units:
        task.same_calls = True
        for blk in (m for m in mod.modules() if isinstance(m, DiTBlock)):
            fully_shard(blk)
            _pass_context_through(blk)
            for method in BLOCK_METHODS:
                register_fsdp_forward_method(blk, method)
    fully_shard(mod)
    mod.set_reduce_scatter_unused_params(True)
    return mod


class _Context:
    """Tensors handed to a block unit past FSDP2's input hook (not a container FSDP2 looks into)."""

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        self.tensors = tensors


def _pass_context_through(blk: DiTBlock) -> None:
    """`blk.cross(x, text, text_mask, audio)` as the unit method `cross_unit(x, _Context(...))`.

    FSDP2 routes a unit call's inputs through one autograd node (its post-backward hook), so the
    gradient a call's uses send to an input is summed there before it joins the other calls'
    gradients: text and audio, read twice by every block's cross (keys and values) and by every
    block, would then be summed in another order than in one process (a float rounding that
    Muon's bfloat16 orthogonalisation grows past the tests' tolerance within 4 steps). Hidden from
    that hook, their gradients add up as in one process; the unit's hook still sees x."""
    cross = blk.cross

    def cross_unit(x: torch.Tensor, ctx: _Context) -> torch.Tensor:
        return cross(x, *ctx.tensors)

    blk.cross_unit = cross_unit
    blk.cross = lambda x, text, text_mask, audio: blk.cross_unit(x, _Context(text, text_mask, audio))


def graph_parameters(model: nn.Module, loss: torch.Tensor) -> set[str]:
    """Names (`net.param`) of the parameters `loss`'s autograd graph reaches, not through the
    task's `masked` tensors (call it after the forward pass, before the backward)."""
    reached: set[int] = set()
    assert isinstance(model, TaskModule)
    seen: set[Any] = {t.grad_fn for t in model.task.masked if t.grad_fn is not None}
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf, the parameter itself
        if var is not None:
            reached.add(id(var))
        stack.extend(f for f, _ in fn.next_functions)
    return {n.removeprefix("nets.") for n, p in _names(model).items() if p in reached}


def _names(model: nn.Module) -> dict[str, int]:
    """Parameter name -> id of the tensor autograd records for it: a per-block unit, resharded
    after its forward, holds its DTensor shard again, while the graph holds the whole parameter
    FSDP2 gathered (its `_unsharded_param`, the same object every step: torch internals)."""
    from torch.distributed.fsdp import FSDPModule

    ids = {n: id(p) for n, p in model.named_parameters()}
    prefix = {id(m): n for n, m in model.named_modules()}
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            if hasattr(fp, "_unsharded_param"):
                owner = prefix[id(fp._module_info.module)]
                ids[f"{owner}.{fp._module_info.param_name}" if owner else fp._module_info.param_name] = id(fp._unsharded_param)
    return ids


def drop_unused_grads(named: list[tuple[str, torch.Tensor]], used: set[str]) -> None:
    """No gradient for the parameters no rank used this step (their reduce-scattered zeros)."""
    if world() == 1:
        flags = [int(n in used) for n, _ in named]
    else:
        t = _flags([int(n in used) for n, _ in named])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flags = t.tolist()
    for (_, p), f in zip(named, flags):
        if not f:
            p.grad = None


def accumulating(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Gradient synchronisation only on a rank's last micro-batch of the step."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
    elif isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


# -- Muon on sharded matrices -----------------------------------------------------------------------
@torch.no_grad()
def muon_step_sharded(opt: torch.optim.Muon) -> None:
    """`torch.optim.Muon.step` for DTensor (FSDP2-sharded) parameters: the momentum on the shards,
    Newton–Schulz on the whole update matrix (gathered; matrix i orthogonalised by rank i mod W,
    then broadcast), each rank's rows applied (module docstring)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    w, r = world(), rank()
    todo = []
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            buf = opt.state[p]["momentum_buffer"]
            m = group["momentum"]
            buf.lerp_(p.grad, 1 - m)
            update = p.grad.lerp(buf, m) if group["nesterov"] else buf
            full = update.full_tensor()
            owner = len(todo) % w
            if owner == r:
                full = _zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"],
                                                   group["eps"]).float().contiguous()  # exact: bf16 in float32
            work = dist.broadcast(full, src=owner, async_op=True)
            todo.append((p, group, full, work))
    for p, group, full, work in todo:
        work.wait()
        ortho = distribute_tensor(full.bfloat16(), p.device_mesh, p.placements, src_data_rank=None)
        lr = float(group["lr"])
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


# -- checkpoints ------------------------------------------------------------------------------------
def _rng_key() -> str:
    return f"rng.rank{rank()}"


def save_dcp(run_dir: Path, step: int, state: dict[str, torch.Tensor], sidecar: dict[str, Any],
             keep: int) -> Path:
    """Checkpoint `step` as a DCP folder (every rank its shards, its RNG state), then rank 0's
    sidecar; all but the newest `keep` deleted. Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    folder = run_dir / f"ckpt-{step:08d}"
    if rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if folder.exists():  # a save killed before its sidecar: start that folder afresh
            shutil.rmtree(folder)
    dist.barrier()
    dcp.save({**state, _rng_key(): torch.get_rng_state()}, checkpoint_id=str(folder))
    dist.barrier()  # every rank's shards are on disk before the sidecar says the checkpoint exists
    if rank() == 0:
        write_sidecar(run_dir, step, sidecar)
        prune(run_dir, keep)
    dist.barrier()
    return folder


def load_dcp(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """Load a DCP checkpoint in place into `state` (the live tensors: shards where sharded) and
    restore this rank's RNG state when the checkpoint has it (same world size)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    saved = reader.read_metadata().state_dict_metadata
    want = dict(state)
    if _rng_key() in saved:
        want[_rng_key()] = torch.get_rng_state()
    dcp.load(want, storage_reader=reader)
    if _rng_key() in want:
        torch.set_rng_state(want[_rng_key()])


def copy_full(state: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors (a one-process checkpoint) into the live state, each rank its shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for k, t in state.items():
        src = full[k].to(t.device, t.dtype)
        if isinstance(t, DTensor):
            src = distribute_tensor(src, t.device_mesh, t.placements, src_data_rank=None)
        t.copy_(src)


@contextlib.contextmanager
def group(device: str) -> Iterator[str]:
    """`join` for the length of a run; the group is left on the way out, error or not (after a
    barrier when the run went well: no rank tears gloo down while another still talks)."""
    dev = join(device)
    try:
        yield dev
        if active():
            dist.barrier()
    finally:
        leave()
