"""Timestep-forcing Pipeline Parallelism (Live Avatar sec. 4.3, Algorithm 4): the protocol.

`workers + 1` processes joined by torch.distributed (gloo on CPUs, NCCL when the job runs on
CUDA devices):

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

Faults: every transfer is waited for with a deadline (`TPPJob.recv_timeout_s`), so a rank whose
peer died stops with one line naming the peer (`RankFailure`) instead of hanging: gloo reports a
closed connection at once, NCCL by the deadline; a rank that torchrun (or the CLI's launcher)
terminates after another rank failed says so and closes its output, which stays playable up to
the last published frame (`publish/file.py`).

The transport is `parallel/link.py`; the processes themselves (who loads what, the CLI's spawn and
torchrun's `env://`) are in `parallel/run.py` and `parallel/roles.py`, and a job starts in
`parallel/start.py` (`run_tpp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from avatarstream.engine.denoiser import pack, unpack
from avatarstream.engine.pipeline import output_stages
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.stages.causal import block_noise, new_denoiser, write_block
from avatarstream.errors import ConfigError
from avatarstream.parallel.link import TAG_LATENT, TAG_SINK, Link



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
    timeout_s: float = 1800.0  # the process group's (collectives, the start barrier)
    recv_timeout_s: float = 600.0  # the longest wait for a peer's latents before giving up
    sequence_parallel: bool = False  # torchrun's ranks shard each DiT block instead (sp_run.py)

    @property
    def processes(self) -> int:
        """The world size this plan needs: N denoise workers + 1 decode (+ 1 refine)."""
        return self.workers + 1 + int(self.split_decode)


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


class TPPDenoiseStage(Stage):
    """One denoise worker's share of every block: receive, denoise its steps, send on."""

    name = "tpp_denoise"
    reads = ("given", "audio", "sigma_noise", "motion_noise")
    writes = ()

    def __init__(self, models: Any, config: Any, rank: int, shares: list[list[int]], link: Link) -> None:
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

    def __init__(self, src: int, link: Link) -> None:
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

    def __init__(self, dst: int, link: Link) -> None:
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

    def __init__(self, src: int, link: Link) -> None:
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
    timeout_s: float = 600.0  # the longest wait for a peer (`wait_for`)

    def __call__(self, models: Any, config: Any) -> list[Stage]:
        _check_causal(config)
        link = Link(self.rank, torch.device(self.device), self.timeout_s)
        from avatarstream.parallel import liveavatar_tpp  # a model family's own stages, same protocol

        if liveavatar_tpp.is_liveavatar(models):
            return liveavatar_tpp.denoise_rank_stages(models, config, self.rank, self.shares, link)
        return [TPPDenoiseStage(models, config, self.rank, self.shares, link)]


@dataclass
class DecodeWorker:
    """Stage builder of the decode rank: receive, SR, decode and publish; with
    `split_decode` the refine rank (receive, SR, send) and the decode rank (receive, decode,
    publish) instead."""

    workers: int
    role: str = "decode"  # "decode" (SR + decode) | "refine" (SR only) | "publish" (decode only)
    device: str = "cpu"
    timeout_s: float = 600.0

    def __call__(self, models: Any, config: Any) -> list[Stage]:
        _check_causal(config)
        n = self.workers
        link = Link(n + (self.role == "publish"), torch.device(self.device), self.timeout_s)
        from avatarstream.parallel import liveavatar_tpp

        if liveavatar_tpp.is_liveavatar(models):
            if self.role != "decode":
                raise ConfigError("--split-decode splits the SR refiner from the decode; LiveAvatar has "
                                  "no refiner: leave it out")
            return liveavatar_tpp.decode_rank_stages(models, config, n - 1, link)
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
