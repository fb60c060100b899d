"""Sequence-parallel generation under torchrun (`torchrun --nproc-per-node W -m
avatarstream.parallel.launch generate --strategy causal --sequence-parallel ...`).

Every rank runs the causal chunk loop with its DiT wrapped in `SequenceParallelDiT`
(`parallel/sequence.py`; LiveAvatar's: `SequenceParallelLiveAvatar`, `parallel/sp_liveavatar.py`):
each block's tokens are sharded over the W ranks, and the DiT's all-to-alls keep the ranks in
step. Rank 0 loads the whole model and runs every stage (SR
refiner, VAE decode, publishing); the other ranks load what denoising needs (`roles.py`'s
"denoise" parts) and run only the causal denoise stage and `FollowStage` (LiveAvatar: its audio
and denoise stages and `LiveAvatarFollowStage`). Same seeds on every rank, so every rank
plans the same blocks and draws the same noise, as in timestep-forcing pipeline parallelism.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from avatarstream.engine.module import Module
from avatarstream.engine.stage import Item, Stage
from avatarstream.engine.stages.decode_publish import DecodePublishStage
from avatarstream.engine.stages.super_res import SuperResStage
from avatarstream.errors import ConfigError
from avatarstream.parallel.roles import rank_models
from avatarstream.parallel.run import (close_rank, join_group, launched_by_torchrun, open_sinks, rank_inputs,
                                       together)
from avatarstream.parallel.sp_liveavatar import SequenceParallelLiveAvatar, follower_stages, sequence_parallel
from avatarstream.parallel.tpp import TPPJob
from avatarstream.parallel.ulysses import SPGroup


class FollowStage(Stage):
    """Ranks > 0 after their denoise stage: keep the block in the rolling store (the next block
    is given its last latent) and count its frames as rank 0 publishes them (where the chunk loop
    sees the stream end), without refining or decoding anything."""

    name = "sp_follow"
    reads = ("lr_latents", "motion")
    writes = ()

    def __init__(self, fps: int) -> None:
        super().__init__()
        self.keep = SuperResStage(None)  # the pass-through of a direct model: stores the block
        self.count = DecodePublishStage(None, fps=fps)  # `prepare` only: takes and counts

    def run(self, items: Sequence[Item]) -> None:
        self.keep.run(items)
        self.count.prepare(items)


def run_sequence_parallel(job: TPPJob) -> dict[str, Any] | None:
    """This torchrun rank of a sequence-parallel job; rank 0 returns the run's summary (plus
    `sequence_parallel`: the world size), the others None. `job.workers` is not used."""
    if not launched_by_torchrun():
        raise ConfigError("--sequence-parallel shards each block over torchrun's processes: run "
                          "torchrun --nproc-per-node N -m avatarstream.parallel.launch generate "
                          "--sequence-parallel ...")
    from avatarstream.engine.pipeline import Pipeline, default_stages
    from avatarstream.registry import load_model

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    device, previous = join_group(rank, world, job, int(env.get("LOCAL_RANK", rank)))
    sinks: list[Any] = []
    ok = False
    try:
        reference, reader, models = rank_inputs(  # rank 0 everything, the others the denoise parts
            job, lambda: load_model(job.model, device=device) if rank == 0
            else rank_models(job.model, "denoise", device=device))
        cfg = models.config
        if cfg.strategy != "causal":
            raise ConfigError("--sequence-parallel runs the causal strategy only (its DiT calls are "
                              "the causal block forwards); add --strategy causal")
        dit = models.dit
        models.dit = Module("dit", sequence_parallel(dit.model, SPGroup.default()), device=device,
                            dtype=dit.dtype, autocast_dtype=dit.autocast_dtype)
        if rank == 0:
            sinks = open_sinks(job, cfg)
        together(rank, "the start", dist.barrier)

        def stages(m: Any, c: Any) -> list:  # rank 0: all of them; the others: denoise, follow
            out = default_stages(m, c)
            if rank == 0:
                return out
            if isinstance(m.dit.model, SequenceParallelLiveAvatar):  # audio, denoise, follow
                return follower_stages(out)
            return [out[0], FollowStage(c.fps)]

        summary = Pipeline(models, stages=stages).run(reference, iter(reader), sinks,
                                                       prompt=job.prompt,
                                                       max_audio_seconds=job.max_audio_seconds)
        ok = True
        if rank:
            return None
        out = summary.as_dict()
        out.update(sequence_parallel=world, processes=world)
        return out
    finally:
        close_rank(sinks, ok, previous)
