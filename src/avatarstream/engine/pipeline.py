"""Pipeline: wires the stages, owns the session's rolling state, runs the chunk loop.

    Reference (once) -> [ Context -> AudioToVideo -> SuperRes -> (anchor) -> DecodePublish ]*
    causal strategy:    [ Context -> CausalDenoise -> SuperRes -> DecodePublish ]* (one block each)

The stage list comes from a *stage builder* (default: `default_stages`, everything in this
process); a timestep-forcing pipeline-parallel worker (`parallel/tpp.py`) injects its own, so the
chunk loop, the schedule and the rolling state are the same code in every process.

The loop asks the continuity schedule for the next chunk, makes sure the audio reaches as far as
that chunk needs (pulling from the source: a file, or a live stream that blocks), runs the
stages, then releases everything the chunk does not hand on. Published frames go through a
bounded queue to the sinks (back-pressure). With `max_lead_s` the loop is also paced against the
media clock: it never runs more than that far ahead of real-time playback (live sessions).
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from avatarstream.engine.audio_context import AudioContext
from avatarstream.engine.causal import CausalSettings
from avatarstream.engine.clock import MediaClock
from avatarstream.engine.module import Module
from avatarstream.engine.publisher import Publisher
from avatarstream.engine.schedule import ContinuitySchedule, make_schedule
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.stages.anchor import AppearanceAnchorStage
from avatarstream.engine.stages.audio_to_video import AudioToVideoStage
from avatarstream.engine.stages.causal import CausalDenoiseStage
from avatarstream.engine.stages.context import ContextStage
from avatarstream.engine.stages.decode_publish import DecodePublishStage
from avatarstream.engine.stages.reference import ReferenceStage
from avatarstream.engine.stages.super_res import SuperResStage
from avatarstream.errors import ConfigError
from avatarstream.publish.base import Sink

log = logging.getLogger(__name__)


@dataclass
class PipelineConfig:
    """Geometry and inference settings of one model family member (defaults come with the model)."""

    lr_size: int  # base DiT resolution in pixels (latent = lr_size // 8)
    hr_size: int  # output resolution in pixels
    latent_channels: int
    motion_dim: int
    chunk: int  # latent frames per chunk
    ref_frames: int  # reference latent frames at most (video: 1 + 4 (R - 1) pixel frames)
    steps: int
    sampler: str = "euler"  # "euler" | "stochastic"
    shift: float = 1.0
    overshoot: float = 0.2
    # CFG scales (audio, reference): inputs of a CFG-distilled DiT (one pass), classifier-free
    # guidance of any other (2-3 passes a step); both None: the plain conditional prediction, one
    # None: 1.0 (that stream unguided)
    audio_scale: float | None = None
    ref_scale: float | None = None
    guidance_input: bool = False  # the DiT is CFG-distilled: the scales are its inputs
    sr_sigma: float = 0.6
    sr_window: int = 1
    audio_window: int = 1
    strategy: str = "prefix"
    overlap: int = 2
    interp_gap: int = 1
    interp_anchor: int = 1
    block: int = 3  # causal: latent frames per block
    kv_blocks: int = 4  # causal: blocks of history in each rolling KV cache
    adaptive_sink: bool = True  # causal: Adaptive Attention Sink (first generated frame as sink)
    rolling_rope: bool = True  # causal: the sink's RoPE position moves with the window
    history_level: str = "same"  # causal: "same" (timestep forcing) or "next" (CausalSettings)
    decode_overlap: bool = True  # VAE decode + publish on a thread of its own (bit-identical video)
    # prefix/interp: chunks made from the reference are given the scene frame at frame 0 (the
    # reference's first usable frame: Avatar V's driving first frame); False: reference only
    scene_frame: bool = True
    seed: int = 0
    ref_t_position: float = -8.0
    fps: int = 25
    sample_rate: int = 16000

    @property
    def guidance(self) -> tuple[float, float] | None:
        """(audio, reference) scales for the DiT, or None (neither set: no guidance)."""
        if self.audio_scale is None and self.ref_scale is None:
            return None
        return (float(1.0 if self.audio_scale is None else self.audio_scale),
                float(1.0 if self.ref_scale is None else self.ref_scale))

    @property
    def ref_pixel_frames(self) -> int:
        return 1 + 4 * (self.ref_frames - 1)

    def chunk_for_seconds(self, seconds: float) -> int:
        """Latent frames a chunk of `seconds` of video takes (rounded; including the prefix
        overlap, at least what the strategy needs): `--seconds-per-chunk` of generate and serve."""
        if not seconds > 0:
            raise ConfigError(f"--seconds-per-chunk must be positive, got {seconds:g}")
        return max(self.overlap + 1, self.interp_anchor + 2, round(seconds * self.fps / 4))

    def causal_settings(self) -> CausalSettings:
        return CausalSettings(block=self.block, kv_blocks=self.kv_blocks,
                              adaptive_sink=self.adaptive_sink, rolling_rope=self.rolling_rope,
                              history_level=self.history_level,
                              ref_t_position=self.ref_t_position,
                              guidance=self.guidance if self.guidance_input else None)


@dataclass
class ModelSet:
    """The modules of one model: what the stages call through their protocols."""

    name: str
    dit: Module
    refiner: Module | None  # None: a direct model (the DiT works at the output resolution)
    vae: Module
    audio: Module
    text: Module
    config: PipelineConfig
    make_audio_stream: Callable[[], object]  # -> StreamingAudioFeatures for a new session

    def modules(self) -> list[Module]:
        return [m for m in (self.dit, self.refiner, self.vae, self.audio, self.text) if m is not None]


@dataclass
class RunSummary:
    frames: int = 0
    chunks: int = 0
    duration_s: float = 0.0  # media seconds produced
    wall_s: float = 0.0
    ttff_s: float | None = None
    fps: float = 0.0
    rtf: float = 0.0  # wall seconds per media second (< 1: faster than real time)
    peak_rss_mb: float = 0.0
    rolling_state_bytes: int = 0
    reference_ms: float = 0.0
    stage_ms: dict[str, float] = field(default_factory=dict)  # mean ms per chunk
    module_s: dict[str, float] = field(default_factory=dict)  # seconds inside each model
    overhead_share: float = 0.0  # share of wall time of the chunk loop outside model forwards

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _status_mb(field: str) -> float | None:
    """A memory line of /proc/self/status (`VmHWM`, `VmRSS`, ...) in MB, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    """Peak resident memory of this process (MB): VmHWM of its own address space.

    Not `ru_maxrss`: Linux carries that across fork + exec, so a process started by a parent that
    was large at the time reports the parent's peak (seen: a 600 s run "peaking" at 830 MB because
    the benchmark had just synthesised its audio; its own high-water mark was 294 MB)."""
    mb = _status_mb("VmHWM")
    return mb if mb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rss_mb() -> float:
    """Resident memory of this process now (MB, VmRSS; 0 where /proc is missing)."""
    return _status_mb("VmRSS") or 0.0


StageBuilder = Callable[["Pipeline", ContinuitySchedule, Publisher], list[Stage]]


def default_stages(pipe: "Pipeline", schedule: ContinuitySchedule, publisher: Publisher) -> list[Stage]:
    """Every stage of the chunk loop in this process."""
    c, m = pipe.config, pipe.models
    if schedule.name == "causal":
        return [pipe.context_stage(),
                CausalDenoiseStage(m.dit, steps=c.steps, shift=c.shift, settings=c.causal_settings(),
                                   sampler=c.sampler, overshoot=c.overshoot, seed=c.seed),
                *pipe.output_stages(schedule, publisher)]
    return [
        pipe.context_stage(),
        AudioToVideoStage(m.dit, steps=c.steps, sampler=c.sampler, shift=c.shift,
                          overshoot=c.overshoot, seed=c.seed, guidance=c.guidance,
                          guidance_input=c.guidance_input),
        *pipe.output_stages(schedule, publisher),
    ]


class Pipeline:
    def __init__(self, models: ModelSet, config: PipelineConfig | None = None, *,
                 stages: StageBuilder | None = None) -> None:
        self.models = models
        self.config = config or models.config
        self.clock = MediaClock(fps=self.config.fps, sample_rate=self.config.sample_rate)
        self._build_stages = stages or default_stages

    def _schedule(self) -> ContinuitySchedule:
        c = self.config
        return make_schedule(c.strategy, c.chunk, overlap=c.overlap, gap=c.interp_gap,
                             anchor=c.interp_anchor, block=c.block, scene=c.scene_frame)

    def context_stage(self) -> Stage:
        c = self.config
        return ContextStage(latent_channels=c.latent_channels, latent_size=c.lr_size // 8,
                            motion_dim=c.motion_dim, seed=c.seed)

    def output_stages(self, schedule: ContinuitySchedule, publisher: Publisher) -> list[Stage]:
        """SuperRes -> (appearance anchor) -> DecodePublish."""
        c, m = self.config, self.models
        out: list[Stage] = [SuperResStage(m.refiner, sigma=c.sr_sigma, window=c.sr_window, seed=c.seed)]
        if schedule.name != "causal":  # the causal strategy's anchor is its attention sink
            out.append(AppearanceAnchorStage(m.dit, m.refiner, enabled=schedule.uses_appearance_anchor,
                                             ref_t_position=c.ref_t_position))
        out.append(DecodePublishStage(m.vae, publisher, fps=c.fps))
        return out

    def run(
        self,
        reference: torch.Tensor,
        audio: Iterator[torch.Tensor],
        sinks: Sequence[Sink],
        *,
        prompt: str = "",
        max_audio_seconds: float | None = None,
        max_lead_s: float | None = None,
        progress: Callable[[int, int | None, float], None] | None = None,
        scene: torch.Tensor | None = None,
    ) -> RunSummary:
        """Generate until the audio ends. reference: [F, 3, H, W] uint8 at hr_size; scene:
        [1, 3, H, W] uint8, the first frame when it is not the reference's (`ReferenceStage`).

        audio: an iterator of 16 kHz mono float32 chunks (blocks while a live source waits).
        """
        c, m = self.config, self.models
        for mod in m.modules():
            mod.reset_stats()
        t_start = time.perf_counter()
        state = SessionState()
        publisher = Publisher(sinks)
        worker = None
        decode_s, decode_calls = 0.0, 0
        try:
            with torch.inference_mode():
                ReferenceStage(m.dit, m.refiner, m.vae, m.text, lr_size=c.lr_size,
                               ref_t_position=c.ref_t_position).run(state, reference, prompt, scene)
            t_ref = time.perf_counter()
            for mod in m.modules():
                mod.reset_stats()
            schedule = self._schedule()
            span = max(c.chunk, c.interp_gap + c.interp_anchor + 2, c.block + 1)
            state.audio = AudioContext(
                audio, m.audio, m.make_audio_stream(), self.clock, window=c.audio_window,
                keep_frames=4 * (3 * span + 4) + 8 * c.audio_window + 16,
                on_audio=lambda x, start: publisher.put_audio(x.numpy(), start, c.sample_rate),
                max_samples=None if max_audio_seconds is None
                else int(max_audio_seconds * c.sample_rate),
            )
            state.vae_cache = m.vae.call("new_cache")
            stages = self._build_stages(self, schedule, publisher)
            if c.decode_overlap:
                dec = next((s for s in stages if isinstance(s, DecodePublishStage)), None)
                worker = dec.start_worker(state) if dec is not None else None
            summary = RunSummary(reference_ms=(t_ref - t_start) * 1000)
            t_first_pub: float | None = None
            while True:
                state.audio.ensure_positions(schedule.horizon())
                state.total_frames = state.audio.total_frames
                plan = schedule.next_chunk(state.audio.total_latents)
                if plan is None:
                    break
                rec = ChunkRecord(plan)
                for stage in stages:
                    stage(rec, state)
                state.store.release(plan.release)
                state.chunks_done += 1
                summary.rolling_state_bytes = max(summary.rolling_state_bytes,
                                                  state.rolling_nbytes() + state.audio.nbytes())
                del rec
                if t_first_pub is None and state.frames_published:
                    t_first_pub = time.perf_counter()
                if progress is not None:
                    progress(state.frames_published, state.total_frames, time.perf_counter() - t_start)
                if max_lead_s is not None and t_first_pub is not None:
                    # frames made so far, the ones the decode thread still works on included
                    ahead = state.frames_emitted / c.fps - (time.perf_counter() - t_first_pub)
                    if ahead > max_lead_s:
                        time.sleep(ahead - max_lead_s)
            if worker is not None:
                worker.join()
                decode_s, decode_calls, worker = worker.seconds, worker.calls, None
            publisher.drain()
        except BaseException:
            if worker is not None:
                _quietly(worker.join)
            _quietly(publisher.drain)
            raise
        t_end = time.perf_counter()
        summary.frames = state.frames_published
        summary.chunks = state.chunks_done
        summary.duration_s = summary.frames / c.fps
        summary.wall_s = t_end - t_start
        if publisher.first_frame_time is not None:
            summary.ttff_s = publisher.first_frame_time - t_start
        summary.fps = summary.frames / summary.wall_s if summary.wall_s > 0 else 0.0
        summary.rtf = summary.wall_s / summary.duration_s if summary.duration_s else 0.0
        summary.peak_rss_mb = peak_rss_mb()
        summary.stage_ms = {s.name: 1000 * s.seconds / max(1, s.calls) for s in stages}
        if c.decode_overlap and "decode_publish" in summary.stage_ms:  # its own time, on its thread
            summary.stage_ms["decode_publish"] = 1000 * decode_s / max(1, decode_calls)
        summary.module_s = {mod.name: mod.forward_seconds for mod in m.modules()}
        loop_wall = t_end - t_ref
        model_s = sum(mod.forward_seconds for mod in m.modules())
        summary.overhead_share = max(0.0, 1.0 - model_s / loop_wall) if loop_wall > 0 else 0.0
        return summary


def _quietly(stop: Callable[[], None]) -> None:
    """Shut a helper thread down after a failure without hiding the failure."""
    try:
        stop()
    except BaseException:  # noqa: BLE001 - the original error is the one to report
        log.debug("%s failed while shutting down", stop, exc_info=True)
