"""Training under torchrun (train/distributed.py): real `torchrun --standalone` processes on gloo.

A two-process run draws the global batch as two micro-batches, one per rank; a one-process run
with `micro_batches=2` (gradient accumulation) draws the same two. They compute the same step.
Each micro-batch's gradient is the same computation in both (measured: bit for bit before
clipping, DDP and FSDP2); what FSDP2 did in another order was the gradient clipping norm (each
rank's shards, then the ranks), which `optim.clip_grad_norm` now sums in float64 (2 ulp apart in
float32 on an AMD EPYC with AVX512-bf16 until then; tested below, bit for bit).

Tolerances (float32, a2v-tiny, 4 steps at lr 3e-3), measured on a 2-core AMD EPYC (AVX512-bf16,
gloo, one thread a rank):
- DDP and FSDP2 (each DiT block its own unit) equal the one-process run bit for bit: losses and
  every checkpoint tensor (an Intel Xeon also gave 0 before the float64 norm).
- Yet a CPU whose kernels round one gradient differently in the last bit is not excluded, and
  Muon's bfloat16 Newton–Schulz grows such a difference: with the clip coefficient 2 ulp apart at
  every step (the float32 norm), the runs differed by 4.7e-4 in the weights (3.3e-4 EMA, 2.3e-6
  optimizer state), up to 3.9 % of how far a DiT matrix moved (relative Frobenius norm), and by 4e-7
  relative in the losses. Another draw of the same global batch (one micro-batch instead of two)
  differs by at least 3.1e-3 on every DiT matrix and by 1.29-1.50 times its movement.
- So, written: losses within 1e-5 relative (25x the rounding case); every tensor within 1e-3
  absolute (2x it; 3x below the other batch); every DiT matrix within 0.2 of its movement
  (5x the rounding case; 6x below the other batch).
Muon on FSDP2 shards vs whole matrices, on fixed gradients: bit for bit (the same Newton–Schulz
on the same gathered matrix, thread counts alike: measured thread-independent here). Resume at the
same world size and shard mode: bit for bit (the same computation; losses and every checkpoint
tensor equal).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from avatarstream.train.checkpoints import list_checkpoints, load_checkpoint
from conftest import run_cli

from .helpers import RECIPES, losses, recipe

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 4
LOSS_RTOL, WEIGHT_ATOL, MOVE_RTOL = 1e-5, 1e-3, 0.2
OVER = {"train__steps": STEPS, "train__checkpoint_every": 2, "train__bf16": False, "train__batch": 2,
        "train__threads": 1}


def cli_sets(dataset: dict) -> list[str]:
    sets = [f'data.prepared="{dataset["prepared"]}"'] + [f"{k.replace('__', '.')}={json.dumps(v)}"
                                                       for k, v in OVER.items()]
    return [a for s in sets for a in ("--set", s)]


def train_cmd(dataset: dict, run_dir: Path, *extra: str) -> list[str]:
    return ["train", str(RECIPES / "a2v-tiny.toml"), *cli_sets(dataset), "--run-dir", str(run_dir),
            "--no-progress", *extra]


def torchrun(nproc: int, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "avatarstream.cli", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def checkpoint_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest checkpoint (either format), whole."""
    ck = load_checkpoint(run_dir)
    assert ck is not None
    return ck[1]


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory) -> dict[str, Path]:
    """The one-process reference (2 micro-batches), a two-process FSDP2 run (torchrun) and a
    two-process DDP run (`train --nproc 2`, which starts torchrun itself)."""
    from avatarstream.train.trainer import Trainer

    d = tmp_path_factory.mktemp("dist")
    Trainer(recipe("a2v-tiny", dataset, **OVER), d / "one", micro_batches=2, progress=False).run()
    torchrun(2, train_cmd(dataset, d / "fsdp", "--shard", "fsdp"))
    r = subprocess.run([sys.executable, "-m", "avatarstream.cli", *train_cmd(dataset, d / "ddp", "--shard", "ddp",
                                                                             "--nproc", "2", "--json")],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert (summary["world"], summary["shard"], summary["step"]) == (2, "ddp", STEPS)
    return {"one": d / "one", "fsdp": d / "fsdp", "ddp": d / "ddp", "dir": d}


def dit_start(run_dir: Path) -> dict[str, torch.Tensor]:
    """The DiT's weights before training (the run's recipe's init)."""
    from avatarstream.train.objectives import make_task

    rec = json.loads((run_dir / "recipe.json").read_text())
    return make_task(rec, torch.device("cpu")).nets["dit"].state_dict()


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_processes_equal_one_at_the_same_global_batch(runs, mode):
    one, two = losses(runs["one"]), losses(runs[mode])
    assert len(one) == len(two) == STEPS
    for a, b in zip(one, two):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (one, two)
    side = json.loads(list_checkpoints(runs[mode])[0][1].read_text())
    assert (side["world"], side["shard"], side["micro_batches"], side["step"]) == (2, mode, 2, STEPS)
    assert list_checkpoints(runs[mode])[0][2].is_dir()  # a DCP folder, read here whole
    assert_same_trajectory(checkpoint_tensors(runs["one"]), checkpoint_tensors(runs[mode]), dit_start(runs["one"]))


def assert_same_trajectory(t1: dict[str, torch.Tensor], t2: dict[str, torch.Tensor],
                           start: dict[str, torch.Tensor]) -> None:
    """Two runs' checkpoint tensors: every tensor within WEIGHT_ATOL, every DiT block matrix within
    MOVE_RTOL of how far it moved from `start` (relative Frobenius norm; module docstring)."""
    assert set(t1) == set(t2)
    for k, v in t1.items():
        assert torch.allclose(v.float(), t2[k].float(), rtol=0, atol=WEIGHT_ATOL), k
    muon = [k for k in start if k.startswith("blocks.") and start[k].dim() == 2]
    assert muon
    for pre in ("model", "ema"):
        for k in muon:
            a, b = t1[f"{pre}.dit.{k}"], t2[f"{pre}.dit.{k}"]
            moved = (a - start[k]).norm()
            assert (a - b).norm() <= MOVE_RTOL * moved, (pre, k, float((a - b).norm() / moved))
            assert (a - start[k]).abs().max() > WEIGHT_ATOL, (pre, k)  # it moved (2.4e-3 at least)


# -- Muon on FSDP2 shards -----------------------------------------------------------------------------
class _Blocks(torch.nn.Module):
    """Matrices with row counts that two ranks shard unevenly (5, 7 rows) and an AdamW bias."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 5), torch.nn.Linear(5, 7, bias=False)])


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=g) for k, v in _Blocks().state_dict().items()}


def _muon_steps(sharded: bool) -> dict[str, torch.Tensor]:
    """Three MuonAdamW steps on fixed gradients; the weights and Muon momenta, whole."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from avatarstream.train.optim import MuonAdamW

    torch.manual_seed(0)
    net = _Blocks()
    if sharded:
        fully_shard(net)
    opt = MuonAdamW([(f"n.{k}", p) for k, p in net.named_parameters()], weight_decay=0.1)
    assert len(opt.muon) == 2 and opt.sharded_muon == sharded
    for step in range(3):
        for k, p in net.named_parameters():
            g = _grads(step)[k]
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if sharded else g
        opt.step(0.05)
    whole = {k: (v.full_tensor() if sharded else v).detach().clone() for k, v in net.state_dict().items()}
    whole.update({k: (v.full_tensor() if sharded else v).clone() for k, v in opt.live_state().items()
                  if k.startswith("muon.")})
    return whole


def _muon_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        got = _muon_steps(sharded=True)
        if rank == 0:
            torch.save(got, out)
        dist.barrier()  # neither rank tears gloo down while the other still talks
    finally:
        dist.destroy_process_group()


def test_muon_on_fsdp2_shards_equals_muon_on_whole_matrices(tmp_path):
    """Two gloo processes, FSDP2-sharded MuonAdamW (uneven row shards) vs one process: bit for bit."""
    import torch.multiprocessing as mp

    from avatarstream.parallel.run import free_port

    out = tmp_path / "sharded.pt"
    mp.start_processes(_muon_rank, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    sharded, whole = torch.load(out), _muon_steps(sharded=False)
    assert set(sharded) == set(whole) and any(k.startswith("muon.") for k in whole)
    for k, v in whole.items():
        assert torch.equal(sharded[k], v), k


# -- gradient clipping on FSDP2 shards ------------------------------------------------------------------
class _Wide(torch.nn.Module):
    """Gradients large enough that float32 sums their squares in another order whole and as two
    row shards (96x77 and 77x130 matrices, biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(96, 77), torch.nn.Linear(77, 130)])


def _clipped(sharded: bool) -> dict[str, torch.Tensor]:
    """`clip_grad_norm(max 1)` of fixed gradients (norm ~140: scaled down); the gradients, whole."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from avatarstream.train.optim import clip_grad_norm

    torch.manual_seed(0)
    net = _Wide()
    if sharded:
        fully_shard(net)
    g = torch.Generator().manual_seed(0)
    for p in net.parameters():
        grad = torch.randn(p.shape, generator=g)
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None) if sharded else grad
    norm = clip_grad_norm(list(net.parameters()), 1.0)
    out = {k: (p.grad.full_tensor() if sharded else p.grad).clone() for k, p in net.named_parameters()}
    return out | {"norm": torch.tensor(norm, dtype=torch.float64)}


def _clip_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        got = _clipped(sharded=True)
        if rank == 0:
            torch.save(got, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_clipping_on_fsdp2_shards_equals_clipping_whole_gradients(tmp_path):
    """The clip coefficient does not depend on the sharding: two gloo processes' FSDP2 shards give
    the gradients one process gives, bit for bit. (With `torch.nn.utils.clip_grad_norm_`, whose
    float32 norm sums the shards and then the ranks, these gradients came out 1 ulp apart on
    the AMD EPYC: the cause of 4.7e-4 between the runs above.)"""
    import torch.multiprocessing as mp

    from avatarstream.parallel.run import free_port

    out = tmp_path / "sharded.pt"
    mp.start_processes(_clip_rank, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    sharded, whole = torch.load(out), _clipped(sharded=False)
    assert set(sharded) == set(whole) and len(whole) == 5
    n_sharded, n_whole = float(sharded.pop("norm")), float(whole.pop("norm"))
    for k, v in whole.items():
        assert torch.equal(sharded[k], v), (k, float((sharded[k] - v).abs().max()))
    assert 100 < n_whole < 200 and abs(n_sharded - n_whole) <= 1e-12 * n_whole  # clipped, by 1 / norm


# -- per-block FSDP2 units --------------------------------------------------------------------------------
def _units_rank(rank: int, port: int, prepared: str, out: str) -> None:
    """One a2v-tiny micro-batch per rank, wrapped as under `--shard fsdp`: what the units are, how
    each rank called its blocks, and how many blocks were whole (gathered) before any block call."""
    import collections

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from avatarstream.models.dit_blocks import DiTBlock
    from avatarstream.train import distributed
    from avatarstream.train.objectives import make_task
    from avatarstream.train.recipe import load_recipe
    from avatarstream.train.trainer import step_generator

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        rec = load_recipe(RECIPES / "a2v-tiny.toml", [f'data.prepared="{prepared}"', "train.batch=1"])
        task = make_task(rec, torch.device("cpu"))
        dropped = not bool(task.batch(step_generator(rec["train"]["seed"], 0, rank))["ref_valid"].any())
        model = distributed.wrap(task, "fsdp", torch.device("cpu"))
        blocks = [m for m in task.nets["dit"].modules() if isinstance(m, DiTBlock)]
        calls: collections.Counter = collections.Counter()
        whole: list[int] = []
        inside: list[int] = []

        def n_whole() -> int:
            return sum(b._get_fsdp_state()._fsdp_param_group.is_unsharded for b in blocks)

        def counted(f, key: str, log: list[int]):
            def call(*a, **k):
                calls[key] += 1
                log.append(n_whole())
                return f(*a, **k)
            return call

        for i, blk in enumerate(blocks):
            for name in distributed.BLOCK_METHODS:  # outside FSDP2's hooks: before the gather
                setattr(blk, name, counted(getattr(blk, name), f"{i}.{name}", whole))
            # inside attn_in, after FSDP2 gathered the block
            blk.self_attn.qkv = counted(blk.self_attn.qkv, f"{i}.qkv", inside)
        loss, _ = model(step_generator(rec["train"]["seed"], 0, rank))
        used = distributed.graph_parameters(model, loss)
        loss.backward()
        units = {"root": isinstance(model, FSDPModule), "blocks": [isinstance(b, FSDPModule) for b in blocks],
                 "block_params": [sorted(type(p).__name__ for p in b.parameters()) for b in blocks]}
        torch.save({"dropped": dropped, "calls": dict(calls), "whole": whole, "inside": inside, "units": units,
                    "used": sorted(used), "grads": {n: p.grad is not None for n, p in model.named_parameters()}},
                   f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp_shards_each_dit_block_as_its_own_unit(dataset, tmp_path):
    """Under `--shard fsdp` every DiT block is its own FSDP2 unit (then the root): before each
    block call no block is whole (so at most one is, during the call), and both ranks call the
    blocks alike although rank 1's drawn micro-batch drops every reference (step 0 of a2v-tiny:
    one process skips the reference pass there; the cause of the hang per-block units had)."""
    import torch.multiprocessing as mp

    from avatarstream.parallel.run import free_port
    from avatarstream.train.distributed import BLOCK_METHODS

    out = str(tmp_path / "units")
    ctx = mp.start_processes(_units_rank, args=(free_port(), str(dataset["prepared"]), out), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:  # ranks waiting on collectives the other never issues
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the two ranks hung in their first step")
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert (r0["dropped"], r1["dropped"]) == (False, True)  # the data-dependent case is exercised
    for r in (r0, r1):
        assert r["units"]["root"] and len(r["units"]["blocks"]) >= 2 and all(r["units"]["blocks"])
        assert all(set(names) == {"DTensor"} for names in r["units"]["block_params"])
        assert r["whole"] and max(r["whole"]) == 0 and set(r["inside"]) == {1}
        assert all(r["grads"].values())  # reduce-scattered (zeros where this rank did not use one)
    assert r0["calls"] == r1["calls"] and r0["calls"]["0.attn_in"] == 2  # reference and generation passes
    assert set(r0["calls"]) == {f"{i}.{m}" for i in range(len(r0["units"]["blocks"]))
                                for m in (*BLOCK_METHODS, "qkv")}
    # the masked reference pass does not count as use: the reference-only motion extractor is used
    # on rank 0 only, the blocks on both
    assert any(n.startswith("dit.blocks.0.") for n in r1["used"])
    extractor = {n for n in r0["used"] if n.startswith("dit.motion_extractor.")}
    assert extractor and not extractor & set(r1["used"])


# -- checkpoints ----------------------------------------------------------------------------------------
def test_dcp_resume_after_a_stop_is_bit_for_bit(runs, dataset):
    """Stop after step 2 (its DCP checkpoint), leave what a kill during step 3 leaves (a log line
    past the checkpoint, a DCP folder without its sidecar), resume: the same run as uninterrupted."""
    d = runs["dir"] / "resumed"
    torchrun(2, train_cmd(dataset, d, "--shard", "fsdp", "--max-steps", "2"))
    assert [c[0] for c in list_checkpoints(d)] == [2]
    with open(d / "log.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "loss": 99.0}) + "\n")
    shutil.copytree(d / "ckpt-00000002", d / "ckpt-00000003")  # data written, sidecar never
    torchrun(2, train_cmd(dataset, d, "--shard", "fsdp", "--resume"))
    assert losses(d) == losses(runs["fsdp"])
    assert not (d / "ckpt-00000003").exists()  # the torn save, pruned once a later one exists
    a, b = checkpoint_tensors(d), checkpoint_tensors(runs["fsdp"])
    assert set(a) == set(b) and any(k.startswith("optim.muon.") for k in a)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


def test_a_dcp_run_exports_and_resumes_in_one_process(runs, dataset, tmp_path):
    """`train export` reads a torchrun run's DCP checkpoint as it is (no conversion); a one-process
    run with the same micro-batches continues it (another world size: the same trajectory within
    the tolerance); other micro-batches are refused (another trajectory)."""
    from safetensors.torch import load_file

    from avatarstream.errors import ConfigError
    from avatarstream.train.export import export
    from avatarstream.train.trainer import Trainer

    export([runs["fsdp"]], tmp_path / "w", dtype="fp32")
    dit, t = load_file(str(tmp_path / "w" / "dit.safetensors")), checkpoint_tensors(runs["fsdp"])
    assert dit and all(torch.equal(v, t[f"ema.dit.{k}"]) for k, v in dit.items() if f"ema.dit.{k}" in t)

    d = tmp_path / "cont"
    shutil.copytree(runs["fsdp"], d)
    for js in d.glob("ckpt-00000004*"):
        shutil.rmtree(js) if js.is_dir() else js.unlink()
    with pytest.raises(ConfigError, match="micro-batches"):
        Trainer(recipe("a2v-tiny", dataset, **OVER), d, progress=False).run(resume=True)
    Trainer(recipe("a2v-tiny", dataset, **OVER), d, micro_batches=2, progress=False).run(resume=True)
    ref = losses(runs["one"])
    assert all(abs(a - b) <= LOSS_RTOL * abs(a) for a, b in zip(ref, losses(d)))
    assert list_checkpoints(d)[0][2].suffix == ".safetensors"  # one process writes its own format
    assert_same_trajectory(checkpoint_tensors(runs["one"]), checkpoint_tensors(d), dit_start(runs["one"]))


def test_a_global_batch_that_does_not_split_is_one_clear_error(dataset, tmp_path):
    from avatarstream.errors import ConfigError
    from avatarstream.train.trainer import Trainer

    with pytest.raises(ConfigError, match="does not split into 3 micro-batches"):
        Trainer(recipe("a2v-tiny", dataset, **OVER), tmp_path, micro_batches=3, progress=False)
    # `--nproc` checks before it starts any process: one line, exit 2, nothing written
    r = run_cli(*train_cmd(dataset, tmp_path / "run", "--nproc", "2", "--set", "train.batch=3"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "avatarstream: error: train.batch = 3 does not split into 2 micro-batches (one per process unless "
        "--micro-batches): use a batch that is a multiple"]
    assert not (tmp_path / "run").exists()
