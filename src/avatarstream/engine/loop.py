"""ChunkLoop: one stream's side of the chunk loop, the same for a file render and a live session.

It owns what is per stream: the rolling `SessionState`, the continuity schedule and the speech
(`AudioContext`). `plan()` pulls the audio the next chunk needs, asks the schedule for the chunk
and runs its Context stage; an executor then runs the model stages on a batch of planned chunks
(one stream's, or many live sessions' at once); `finish(rec)` releases what the chunk does not hand
on. `Pipeline.run` is this loop for one stream; the live scheduler steps many of them.

A live source never blocks: its audio iterator raises (the live package's `NotReady`) when the
next chunk's speech has not arrived, and `plan` lets that through with nothing consumed that
matters, so it can be called again later.
"""

from __future__ import annotations

from collections.abc import Iterator
import torch

from avatarstream.engine.audio_context import AudioContext
from avatarstream.engine.clock import MediaClock
from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.engine.handoff_schedule import HandoffSchedule
from avatarstream.engine.schedule import (STRATEGIES, CausalSchedule, ContinuitySchedule, InterpSchedule,
                                          PrefixSchedule)
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord
from avatarstream.engine.stages.context import ContextStage
from avatarstream.errors import ConfigError


def make_schedule(strategy: str, chunk: int, *, overlap: int = 2, gap: int = 1,
                  anchor: int = 1, block: int = 3, scene: bool = False,
                  stride: int = 4, context: int = 1) -> ContinuitySchedule:
    """scene: prefix and interp chunks generated from the reference are given the scene frame
    (the causal student keeps its reference as attention sink instead); stride: video frames per
    latent of the model's VAE (handoff: FlashHead's own continuity, engine/handoff_schedule.py);
    context: causal blocks are given that many latents of the previous block (0: none)."""
    if strategy == "handoff":
        return HandoffSchedule(chunk=chunk, overlap=overlap, stride=stride)
    if strategy == "causal":
        return CausalSchedule(block=block, context=context)
    if strategy == "prefix":
        return PrefixSchedule(chunk=chunk, overlap=overlap, scene=scene)
    if strategy == "interp":
        return InterpSchedule(chunk=chunk, gap=gap, anchor=anchor, scene=scene)
    raise ConfigError(f"unknown strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}")


def make_config_schedule(c: PipelineConfig) -> ContinuitySchedule:
    """The continuity schedule a pipeline config asks for."""
    return make_schedule(c.strategy, c.chunk, overlap=c.overlap, gap=c.interp_gap,
                         anchor=c.interp_anchor, block=c.block, scene=c.scene_frame,
                         stride=c.latent_stride, context=c.block_context)


def context_stage(c: PipelineConfig) -> ContextStage:
    return ContextStage(latent_channels=c.latent_channels, latent_size=c.latent_hw,
                        motion_dim=c.motion_dim, seed=c.seed)


class ChunkLoop:
    def __init__(self, models: ModelSet, state: SessionState, audio: Iterator[torch.Tensor], *,
                 config: PipelineConfig | None = None, clock: MediaClock | None = None,
                 max_samples: int | None = None) -> None:
        """state: reference caches, text and scene set (by the ReferenceStage or a prepared
        reference) and `publisher` set; audio: 16 kHz mono float32 chunks."""
        c = config or models.config
        self.config = c
        self.schedule = make_config_schedule(c)
        self.context = context_stage(c)
        clock = clock or MediaClock(fps=c.fps, sample_rate=c.sample_rate)
        # audio features kept: as far back as the furthest chunk a schedule may still generate
        span = max(c.chunk, c.interp_gap + c.interp_anchor + 2, c.block + 1)
        pub = state.publisher
        state.audio = AudioContext(
            audio, models.audio, models.make_audio_stream(), clock, window=c.audio_window,
            keep_frames=4 * (3 * span + 4) + 8 * c.audio_window + 16,
            on_audio=lambda x, start: pub.put_audio(x.numpy(), start, c.sample_rate),
            max_samples=max_samples)
        state.vae_cache = models.vae.call("new_cache")
        self.state = state
        self.done = False

    def plan(self) -> ChunkRecord | None:
        """The next chunk, its Context stage run; None once the stream is done."""
        if self.done:
            return None
        st = self.state
        st.audio.ensure_positions(self.schedule.horizon())
        st.total_frames = st.audio.total_frames
        plan = self.schedule.next_chunk(st.audio.total_latents)
        if plan is None:
            self.done = True
            return None
        rec = ChunkRecord(plan)
        self.context([(rec, st)])
        return rec

    def finish(self, rec: ChunkRecord) -> None:
        """After the executor ran the chunk: release what it does not hand on."""
        st = self.state
        st.store.release(rec.plan.release)
        st.chunks_done += 1
        # every frame handed to the decode (published, or about to be by a decode thread)
        if st.total_frames is not None and st.frames_emitted >= st.total_frames:
            self.done = True
