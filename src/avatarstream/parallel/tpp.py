"""Timestep-forcing Pipeline Parallelism (Live Avatar sec. 4.3, Algorithm 4).

`run_tpp(job)` starts `workers + 1` processes joined by torch.distributed (gloo on CPUs, NCCL
when the job runs on CUDA devices):

    rank 0 .. N-1   denoise workers: worker k owns a contiguous share of the denoising steps
                    (one step each when N = steps) and one rolling KV cache per step it owns;
    rank N          decode worker: SR refiner, streaming VAE decode, publishing (the output file);
                    with `split_decode` two processes: rank N refines (SR), rank N+1 decodes and
                    publishes (the paper's dedicated VAE device; our SR is one more stage to
                    overlap, and with 4 denoise workers SR + decode in one process would be the
                    slowest stage of the pipeline).

Every process runs the same chunk loop (`engine.pipeline.Pipeline`) over the same audio file with
the same seeds, so every process plans the same blocks and draws the same noise and audio tokens;
a worker's stage list is injected (`DenoiseWorker`, `DecodeWorker`). Between processes only
latents travel: block i goes rank 0 -> 1 -> ... -> N-1 -> N, as one flat float32 tensor (block
latents and motion tokens). While rank k denoises block i, rank k-1 already denoises block i+1:
after the warm-up the workers run at once and throughput is set by the slowest worker's share.

Adaptive Attention Sink across processes: the sink becomes the first block's clean first frame,
which only the last denoise worker has. When it starts block 1 it sends that latent to every other
denoise worker, each of which waits for it before its own block 1 (the second warm-up of the
paper's Fig. 8) and encodes it itself. So the sink every worker uses for block i is the one single-process generation uses,
and the output equals single-process causal generation with the same seeds.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from avatarstream.engine.denoiser import pack, unpack
from avatarstream.engine.pipeline import output_stages
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.stages.causal import block_noise, new_denoiser, write_block
from avatarstream.errors import AvatarStreamError, ConfigError, InputError

log = logging.getLogger(__name__)

TAG_LATENT, TAG_SINK = 1, 2


@dataclass
class TPPJob:
    """Everything a worker needs (picklable: workers are spawned)."""

    model: str
    reference: str
    audio: str
    workers: int = 2
    split_decode: bool = False  # SR and VAE decode in two processes (N + 2 in all)
    out: str | None = None  # fragmented MP4 written by the decode worker
    hls: str | None = None
    frames_out: str | None = None  # raw frames, uint8 [F, H, W, 3] little blocks appended (.u8)
    overrides: dict[str, Any] = field(default_factory=dict)  # PipelineConfig field -> value
    prompt: str = ""
    max_audio_seconds: float = 3600.0
    threads: int = 1  # torch threads per process
    cpus: list[int] | None = None  # CPU affinity of every process (None: inherit)
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one device per rank, round robin)
    timeout_s: float = 1800.0


def split_steps(steps: int, workers: int) -> list[list[int]]:
    """Contiguous shares of `steps` denoising steps over `workers` (earlier workers get the extra
    step): split_steps(4, 4) = [[0], [1], [2], [3]]; split_steps(4, 3) = [[0, 1], [2], [3]]."""
    if not 1 <= workers <= steps:
        raise ConfigError(f"--workers must be between 1 and the number of steps ({steps}), got {workers}")
    q, r = divmod(steps, workers)
    out, j = [], 0
    for k in range(workers):
        n = q + (1 if k < r else 0)
        out.append(list(range(j, j + n)))
        j += n
    return out


# ---------------------------------------------------------------------------------------------
# worker stages


class _Link:
    """Point-to-point latent transport of one rank (tensors staged on the rank's device)."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        dist.send(t.detach().float().contiguous().to(self.device), dst, tag=tag)

    def recv(self, shape: tuple[int, ...], src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.recv(buf, src, tag=tag)
        return buf.cpu()


class TPPDenoiseStage(Stage):
    """One denoise worker's share of every block: receive, denoise its steps, send on."""

    name = "tpp_denoise"
    reads = ("given", "audio", "sigma_noise", "motion_noise")
    writes = ()

    def __init__(self, models: Any, config: Any, rank: int, shares: list[list[int]], link: _Link) -> None:
        super().__init__()
        self.models, self.config = models, config
        self.rank, self.shares, self.link = rank, shares, link
        self.last = rank == len(shares) - 1
        self._first: torch.Tensor | None = None  # last worker: the AAS frame, until handed over

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        c = self.config
        settings = c.causal_settings()
        if state.causal is None:
            state.causal = new_denoiser(self.models.dit, state, steps=c.steps, shift=c.shift,
                                        settings=settings, sampler=c.sampler, overshoot=c.overshoot,
                                        seed=c.seed, own_steps=self.shares[self.rank])
        den = state.causal
        x, m, idx, positions = block_noise(rec)
        if den.blocks_done == 1 and settings.adaptive_sink:
            # second warm-up: the sink of block 1 is the first frame the last worker finished. It
            # is handed over when block 1 exists (a stream of one block has nothing to wait for).
            if self.last:
                for r in range(self.rank):
                    self.link.send(self._first, r, TAG_SINK)
            else:
                first = self.link.recv((x.shape[0], x.shape[1], 1, *x.shape[3:]), len(self.shares) - 1, TAG_SINK)
                den.adaptive_attention_sink(first)
        if self.rank > 0:
            flat = self.link.recv(tuple(pack(x, m).shape), self.rank - 1, TAG_LATENT)
            x, m = unpack(flat, x.shape, m.shape)
        x, m = den.denoise(x, m, audio=rec.audio[:, idx], text=state.text, text_mask=state.text_mask,
                           positions=positions, block=rec.plan.id)
        if self.last and den.blocks_done == 1 and settings.adaptive_sink:
            self._first = x[:, :, :1].clone()
            den.adaptive_attention_sink(self._first)
        self.link.send(pack(x, m), self.rank + 1, TAG_LATENT)


class ReceiveBlockStage(Stage):
    """The decode worker's source of denoised blocks: the last denoise worker."""

    name = "tpp_receive"
    reads = ("given", "sigma_noise", "motion_noise")
    writes = ("lr_latents", "motion")

    def __init__(self, src: int, link: _Link) -> None:
        super().__init__()
        self.src, self.link = src, link

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        x, m, idx, _ = block_noise(rec)
        flat = self.link.recv(tuple(pack(x, m).shape), self.src, TAG_LATENT)
        x, m = unpack(flat, x.shape, m.shape)
        write_block(rec, state, idx, x, m)


class SendRefinedStage(Stage):
    """The refine worker's output: the chunk's refined latents to the decode worker."""

    name = "tpp_send_refined"
    reads = ("hr_latents",)
    writes = ()

    def __init__(self, dst: int, link: _Link) -> None:
        super().__init__()
        self.dst, self.link = dst, link

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        for cid in rec.plan.publish:
            self.link.send(state.store.take_emitted(cid), self.dst, TAG_LATENT)


class ReceiveRefinedStage(Stage):
    """The decode worker's input when SR runs elsewhere: refined latents `[1, C, E, H, W]`."""

    name = "tpp_receive_refined"
    reads = ("sigma_noise",)
    writes = ("hr_latents",)

    def __init__(self, src: int, link: _Link) -> None:
        super().__init__()
        self.src, self.link = src, link

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        b, c, _, h, w = rec.sigma_noise.shape
        e = rec.plan.emit[1] - rec.plan.emit[0]
        for cid in rec.plan.publish:
            hr = self.link.recv((b, c, e, 2 * h, 2 * w), self.src, TAG_LATENT)
            state.store.put_emitted(cid, hr)
            rec.hr_latents = hr


@dataclass
class DenoiseWorker:
    """Stage builder of denoise rank `rank`: its steps (the chunk loop runs the context: noise,
    audio tokens)."""

    rank: int
    shares: list[list[int]]
    device: str = "cpu"

    def __call__(self, models: Any, config: Any) -> list[Stage]:
        _check_causal(config)
        link = _Link(self.rank, torch.device(self.device))
        return [TPPDenoiseStage(models, config, self.rank, self.shares, link)]


@dataclass
class DecodeWorker:
    """Stage builder of the decode rank: receive, SR, decode and publish; with
    `split_decode` the refine rank (receive, SR, send) and the decode rank (receive, decode,
    publish) instead."""

    workers: int
    role: str = "decode"  # "decode" (SR + decode) | "refine" (SR only) | "publish" (decode only)
    device: str = "cpu"

    def __call__(self, models: Any, config: Any) -> list[Stage]:
        _check_causal(config)
        n = self.workers
        link = _Link(n + (self.role == "publish"), torch.device(self.device))
        out = output_stages(models, config)  # SR, decode + publish
        if self.role == "publish":
            return [ReceiveRefinedStage(n, link), out[-1]]
        if self.role == "refine":
            return [ReceiveBlockStage(n - 1, link), out[0], SendRefinedStage(n + 1, link)]
        return [ReceiveBlockStage(n - 1, link), *out]


def _check_causal(config: Any) -> None:
    if config.strategy != "causal":
        raise ConfigError("--workers runs the causal strategy only (timestep forcing needs its "
                          "per-step KV caches); add --strategy causal")


# ---------------------------------------------------------------------------------------------
# processes


class _FrameDump:
    """A sink appending raw uint8 frames to a file (`frames_out`: exact output, for comparisons)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.durable_frames = 0
        self.shape: tuple[int, int] | None = None

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        self.shape = (height, width)
        self._f = open(self.path, "wb")

    def write_video(self, chunk: Any) -> None:
        self._f.write(np.ascontiguousarray(chunk.frames, dtype=np.uint8).tobytes())
        self.durable_frames += int(chunk.frames.shape[0])

    def write_audio(self, chunk: Any) -> None:
        pass

    def close(self) -> None:
        self._f.close()

    def abort(self) -> None:
        self._f.close()


def read_frames(path: str | Path, size: int) -> np.ndarray:
    """Frames written by `frames_out`: `[F, size, size, 3]` uint8."""
    return np.fromfile(str(path), dtype=np.uint8).reshape(-1, size, size, 3)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sinks(job: TPPJob, cfg: Any) -> list[Any]:
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
        s.open(cfg.hr_size, cfg.hr_size, cfg.fps, cfg.sample_rate)
    return sinks


def _worker(rank: int, job: TPPJob, port: int, results: Any) -> None:
    """Body of one spawned process (rank < workers: denoise; rank == workers: decode)."""
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.media.audio import AudioReader
    from avatarstream.media.reference import load_reference
    from avatarstream.registry import load_model, model_spec_for

    torch.set_num_threads(max(1, job.threads))
    if job.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, job.cpus)
    n = job.workers
    world = n + 1 + job.split_decode
    last = world - 1  # the rank that publishes
    cuda = job.device.startswith("cuda")
    device = f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=job.timeout_s))
    sinks: list[Any] = []
    ok = False
    try:
        spec_cfg = model_spec_for(job.model).pipeline()
        reference = load_reference(job.reference, size=spec_cfg.hr_size, max_frames=spec_cfg.ref_pixel_frames)
        reader = AudioReader(job.audio, sample_rate=spec_cfg.sample_rate, max_seconds=job.max_audio_seconds)
        models = load_model(job.model, device=device)
        for k, v in job.overrides.items():
            setattr(models.config, k, v)
        cfg = models.config
        shares = split_steps(cfg.steps, n)
        if rank < n:
            build: Any = DenoiseWorker(rank, shares, device)
        else:
            role = "decode" if not job.split_decode else ("refine" if rank == n else "publish")
            build = DecodeWorker(n, role, device)
        if rank == last:
            sinks = _sinks(job, cfg)
        dist.barrier()  # start together: the pipeline's fps and ttff are measured from here
        summary = Pipeline(models, stages=build).run(reference.frames, iter(reader), sinks,
                                                      prompt=job.prompt,
                                                      max_audio_seconds=job.max_audio_seconds)
        ok = True
        if rank == last:
            results.put({"summary": summary.as_dict(), "shares": shares})
    except AvatarStreamError as e:
        results.put({"error": str(e), "kind": type(e).__name__, "rank": rank})
        raise
    finally:
        for s in sinks:
            if ok or s.durable_frames > 0:
                s.close()
            else:
                s.abort()
        dist.destroy_process_group()


def run_tpp(job: TPPJob) -> dict[str, Any]:
    """Run the job on `workers + 1` (`+ 2` with split_decode) spawned processes; returns the
    publishing worker's summary (`RunSummary.as_dict()` plus `workers`, `processes`,
    `split_decode`, `step_shares`)."""
    import torch.multiprocessing as mp

    from avatarstream.registry import model_spec_for

    base = model_spec_for(job.model).pipeline()
    if job.overrides.get("strategy", base.strategy) != "causal":
        _check_causal(base)  # validate before starting anything
    split_steps(job.overrides.get("steps", base.steps), job.workers)
    if job.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    try:
        mp.start_processes(_worker, args=(job, port, results), nprocs=job.workers + 1 + job.split_decode,
                           join=True, start_method="spawn")
    except mp.ProcessRaisedException as e:
        msgs = []
        while not results.empty():
            msgs.append(results.get())
        err = next((m for m in msgs if "error" in m), None)
        if err is not None:  # a user mistake the workers found: the same error, one line
            cls = {"ConfigError": ConfigError, "InputError": InputError}.get(err["kind"], AvatarStreamError)
            raise cls(err["error"]) from None
        raise RuntimeError(f"a pipeline worker failed:\n{e}") from None
    out = None
    while not results.empty():
        item = results.get()
        if "summary" in item:
            out = item
    if out is None:
        raise RuntimeError("the decode worker finished without a summary")
    summary = dict(out["summary"])
    summary.update(workers=job.workers, processes=job.workers + 1 + job.split_decode,
                   split_decode=job.split_decode, step_shares=out["shares"])
    return summary
