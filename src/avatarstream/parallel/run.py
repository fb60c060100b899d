"""The processes of timestep-forcing pipeline parallelism (`parallel/tpp.py`): one rank's body,
and the two ways to start the ranks.

- **torchrun** (`torchrun --nproc-per-node N -m avatarstream.parallel.launch generate ...`, or
  with `--nnodes`/`--rdzv-endpoint` across machines): every process runs `generate`, which finds
  torchrun's environment and runs `run_this_rank`. The group is joined by `env://` (torchrun's
  MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE), so it spans machines; CUDA ranks take the GPU of
  their LOCAL_RANK. A world size that does not match the plan (N denoise + 1 decode [+ 1 refine])
  is refused by every rank before it joins anything.
- **the CLI** (`generate --workers N`): `spawn` starts the N + 1 processes here with
  torch.multiprocessing and gives each the same environment torchrun would (a free local port),
  so both paths run the same `run_rank` over `env://`.

Both backends: NCCL when the job runs on CUDA, gloo on CPUs. Each rank loads only the networks
of its role (`parallel/roles.py`).

Faults: a rank that dies takes its links down; its peers stop at their next transfer with one
line naming it (`link.RankFailure`, waited with a deadline); a rank stopped by its launcher
(torchrun and `spawn` both send SIGTERM to the survivors of a failed rank) raises the same error
from its signal handler. Either way the publishing rank closes its sinks on the way out: the MP4
keeps every frame published before the failure (and stays playable even after kill -9:
`publish/file.py`). That MP4 is the partial file of `--out` (`publish/output.py`): locked, and
renamed over `--out` when the run succeeds, by the process that started the ranks (`spawn`) or,
under torchrun, by the publishing rank itself (`cli_generate.py`); a failed run keeps it and
names it. `AVATARSTREAM_TPP_FAULT=RANK:BLOCK` kills rank RANK (SIGKILL) when it starts block
BLOCK: fault injection for the tests.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.errors import AvatarStreamError, ConfigError, InputError
from avatarstream.parallel.roles import loaded_parts, rank_models, role_of
from avatarstream.parallel.link import RankFailure
from avatarstream.parallel.tpp import DecodeWorker, DenoiseWorker, TPPJob, _check_causal, split_steps

log = logging.getLogger(__name__)

FAULT_ENV = "AVATARSTREAM_TPP_FAULT"


class _FrameDump:
    """A sink appending raw uint8 frames to a file (`frames_out`: exact output, for comparisons)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.durable_frames = 0

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        self._f = open(self.path, "wb")

    def write_video(self, chunk: Any) -> None:
        self._f.write(np.ascontiguousarray(chunk.frames, dtype=np.uint8).tobytes())
        self._f.flush()
        self.durable_frames += int(chunk.frames.shape[0])

    def write_audio(self, chunk: Any) -> None:
        pass

    def close(self) -> None:
        self._f.close()

    abort = close


def read_frames(path: str | Path, size: int) -> np.ndarray:
    """Frames written by `frames_out`: `[F, size, size, 3]` uint8."""
    return np.fromfile(str(path), dtype=np.uint8).reshape(-1, size, size, 3)


def open_sinks(job: TPPJob, cfg: Any) -> list[Any]:
    sinks: list[Any] = []
    if job.out:
        from avatarstream.publish.file import FragmentedMP4Sink

        sinks.append(FragmentedMP4Sink(Path(job.out)))
    if job.hls:
        from avatarstream.publish.hls import HLSSink

        sinks.append(HLSSink(job.hls))
    if job.frames_out:
        sinks.append(_FrameDump(job.frames_out))
    for s in sinks:
        s.open(cfg.out_hw[1], cfg.out_hw[0], cfg.fps, cfg.sample_rate)
    return sinks


class _Fault(Stage):
    """Fault injection (`AVATARSTREAM_TPP_FAULT=RANK:BLOCK`): this process dies at that block."""

    name = "fault"
    reads = ()
    writes = ()

    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        if rec.plan.id == self.block:
            os.kill(os.getpid(), signal.SIGKILL)


def _fault_block(rank: int) -> int | None:
    spec = os.environ.get(FAULT_ENV, "")
    if ":" in spec and int(spec.split(":")[0]) == rank:
        return int(spec.split(":")[1])
    return None


def _on_sigterm(rank: int) -> Any:
    """SIGTERM (torchrun or `spawn` stopping the survivors of a failed rank) -> RankFailure, once:
    later ones are ignored (torchrun may send it twice), so the rank closes its output and says
    why instead of dying half-way through its cleanup."""

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise RankFailure(f"rank {rank}: stopped by the launcher (another rank failed); stopping")

    return signal.signal(signal.SIGTERM, stop)


def together(rank: int, what: str, collective: Any) -> None:
    """A collective of the start-up; a peer that failed before it (a missing file, say, that it
    reports itself) -> one line here too, not a transport traceback."""
    try:
        collective()
    except RuntimeError as e:
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise RankFailure(f"rank {rank}: another rank failed before {what} "
                          f"({first.split('] ', 1)[-1].split('. This is')[0][:120]}); stopping") from None


def join_group(rank: int, world: int, job: TPPJob, local_rank: int | None = None) -> tuple[str, Any]:
    """Threads, CPU affinity, the rank's device (CUDA: the GPU of its local rank), the SIGTERM
    handler (returns the previous one) and the process group over `env://`: NCCL on CUDA, gloo
    on CPUs."""
    torch.set_num_threads(max(1, job.threads))
    if job.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, job.cpus)
    cuda = job.device.startswith("cuda")
    device = "cpu"
    if cuda:
        local = rank if local_rank is None else local_rank
        device = f"cuda:{local % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    previous = _on_sigterm(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=rank,
                            world_size=world, timeout=timedelta(seconds=job.timeout_s),
                            **({"device_id": torch.device(device)} if cuda else {}))
    return device, previous


def close_rank(sinks: list[Any], ok: bool, previous: Any) -> None:
    """Close the sinks (a run that failed keeps what it published: the file stays playable).
    After a success: restore the SIGTERM handler and leave the group. After a failure: ignore
    SIGTERM from here on (the launcher's stop must not kill the rank before it has said why) and
    leave the group to the process's exit (tearing it down with transfers still pending on a
    broken link can crash gloo)."""
    if not ok:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for s in sinks:
        if ok or s.durable_frames > 0:
            s.close()
        else:
            s.abort()
    if ok:
        signal.signal(signal.SIGTERM, previous)
        dist.destroy_process_group()


def rank_inputs(job: TPPJob, load: Any) -> tuple[Any, Any, Any]:
    """What every rank reads itself: the reference, the audio, and its models (`load()`, the
    job's overrides applied). Reference frames `[F, 3, H, W]` uint8, an AudioReader, a ModelSet."""
    from avatarstream.media.audio import AudioReader
    from avatarstream.media.reference import load_reference
    from avatarstream.registry import model_spec_for

    spec_cfg = model_spec_for(job.model).pipeline()
    size = (job.overrides["height"], job.overrides["width"]) if "height" in job.overrides else spec_cfg.out_hw
    reference = load_reference(job.reference, size=size, max_frames=spec_cfg.ref_pixel_frames)
    reader = AudioReader(job.audio, sample_rate=spec_cfg.sample_rate, max_seconds=job.max_audio_seconds)
    models = load()
    for k, v in job.overrides.items():
        setattr(models.config, k, v)
    return reference.frames, reader, models


def run_rank(rank: int, world: int, job: TPPJob, local_rank: int | None = None) -> dict[str, Any] | None:
    """One rank of the job, joined by `env://` (MASTER_ADDR/MASTER_PORT set by the launcher).
    Returns the summary on the publishing rank (the last), None elsewhere."""
    from avatarstream.engine.pipeline import Pipeline

    if world != job.processes:
        raise ConfigError(
            f"the launcher started {world} processes, the plan needs {job.processes}: --workers "
            f"{job.workers} denoise + 1 {'refine + 1 decode' if job.split_decode else 'decode'}; "
            f"start {job.processes} (torchrun --nproc-per-node {job.processes}) or change --workers")
    n, last = job.workers, world - 1  # the last rank publishes
    role = role_of(rank, n, job.split_decode)
    device, previous = join_group(rank, world, job, local_rank)
    sinks: list[Any] = []
    ok = False
    try:
        reference, reader, models = rank_inputs(job, lambda: rank_models(job.model, role, device=device))
        cfg = models.config
        shares = split_steps(cfg.steps, n)
        if rank < n:
            build: Any = DenoiseWorker(rank, shares, device, job.recv_timeout_s)
        else:
            build = DecodeWorker(n, role, device, job.recv_timeout_s)
        fault = _fault_block(rank)
        if fault is not None:
            inner = build
            build = lambda m, c: [_Fault(fault), *inner(m, c)]  # noqa: E731
        parts: list[Any] = [None] * world
        together(rank, "the start", lambda: dist.all_gather_object(parts, loaded_parts(models)))
        log.info("rank %d (%s) loaded %s", rank, role, ", ".join(parts[rank]))
        if rank == last:
            sinks = open_sinks(job, cfg)
        together(rank, "the start", dist.barrier)  # fps and ttff are measured from here
        summary = Pipeline(models, stages=build).run(reference, iter(reader), sinks,
                                                      prompt=job.prompt,
                                                      max_audio_seconds=job.max_audio_seconds)
        ok = True
        if rank != last:
            return None
        out = summary.as_dict()
        out.update(workers=n, processes=world, split_decode=job.split_decode, step_shares=shares,
                   rank_parts=parts)
        return out
    finally:
        close_rank(sinks, ok, previous)


# ---------------------------------------------------------------------------------------------
# torchrun


def launched_by_torchrun() -> bool:
    """This process is one rank of a torchrun (or any `env://`) job."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def publishes_here(sequence_parallel: bool) -> bool:
    """This torchrun process is the rank that writes the outputs: the last of a pipeline, rank 0
    of a sequence-parallel job (`parallel/sp_run.py`)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank == 0 if sequence_parallel else rank == world - 1


def run_this_rank(job: TPPJob) -> dict[str, Any] | None:
    """Run the rank torchrun made this process (RANK, WORLD_SIZE, LOCAL_RANK from its env)."""
    if job.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here")
    env = os.environ
    return run_rank(int(env["RANK"]), int(env["WORLD_SIZE"]), job, int(env.get("LOCAL_RANK", env["RANK"])))


# ---------------------------------------------------------------------------------------------
# the CLI's own launcher


def free_port() -> int:
    """A free TCP port on the loopback interface (for a rendezvous or a test's server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(rank: int, job: TPPJob, port: int, results: Any) -> None:
    """Body of one process `spawn` started: torchrun's environment, then `run_rank`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(job.processes))
    try:
        out = run_rank(rank, job.processes, job)
    except AvatarStreamError as e:
        results.put({"error": str(e), "kind": type(e).__name__, "rank": rank})
        raise
    if out is not None:
        results.put({"summary": out})


def spawn(job: TPPJob) -> dict[str, Any]:
    """Run the job on `job.processes` processes started here; the publishing rank's summary."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from avatarstream.registry import model_spec_for

    base = model_spec_for(job.model).pipeline()
    if job.overrides.get("strategy", base.strategy) != "causal":
        _check_causal(base)  # validate before starting anything
    split_steps(job.overrides.get("steps", base.steps), job.workers)
    if job.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here")
    results = mp.get_context("spawn").SimpleQueue()
    try:
        mp.start_processes(_spawned, args=(job, free_port(), results), nprocs=job.processes,
                           join=True, start_method="spawn")
    except ProcessException as e:  # raised, or killed by a signal
        msgs = []
        while not results.empty():
            msgs.append(results.get())
        errs = [m for m in msgs if "error" in m]
        # a user mistake the workers found comes first; a peer's "lost rank k" after it
        err = next((m for m in errs if m["kind"] != "RankFailure"), errs[0] if errs else None)
        if err is not None:
            cls = {"ConfigError": ConfigError, "InputError": InputError,
                   "RankFailure": RankFailure}.get(err["kind"], AvatarStreamError)
            raise cls(err["error"]) from None
        raise RuntimeError(f"a pipeline worker failed:\n{e}") from None
    out = None
    while not results.empty():
        item = results.get()
        if "summary" in item:
            out = item["summary"]
    if out is None:
        raise RuntimeError("the decode worker finished without a summary")
    return out
