"""Pipeline: one stream (a file render) through the chunk loop.

    Reference (once) -> [ Context -> AudioToVideo -> SuperRes -> (anchor) -> DecodePublish ]*
    causal strategy:    [ Context -> CausalDenoise -> SuperRes -> DecodePublish ]* (one block each)

The model stages come from a *stage builder* (default: `default_stages`, everything in this
process); a timestep-forcing pipeline-parallel worker (`parallel/tpp.py`) injects its own, so the
chunk loop, the schedule and the rolling state are the same code in every process. They run in an
executor (`engine/executor.py`) as a batch of one: the live scheduler runs the same stages in the
same executor on a batch of sessions.

The loop (`ChunkLoop`) asks the continuity schedule for the next chunk, makes sure the audio
reaches as far as that chunk needs (pulling from the source: a file, or a live stream that
blocks), the executor runs the stages, then the loop releases everything the chunk does not hand
on. Published frames go through a
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

from avatarstream.engine.clock import MediaClock
from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.engine.executor import LocalExecutor
from avatarstream.engine.loop import ChunkLoop, make_config_schedule
from avatarstream.engine.publisher import Publisher
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import Stage
from avatarstream.engine.stages.anchor import AppearanceAnchorStage
from avatarstream.engine.stages.audio_to_video import AudioToVideoStage
from avatarstream.engine.stages.causal import CausalDenoiseStage
from avatarstream.engine.stages.decode_publish import DecodePublishStage
from avatarstream.engine.stages.reference import ReferenceStage
from avatarstream.engine.stages.super_res import SuperResStage
from avatarstream.publish.base import Sink

log = logging.getLogger(__name__)


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


StageBuilder = Callable[[ModelSet, PipelineConfig], list[Stage]]


def output_stages(m: ModelSet, c: PipelineConfig) -> list[Stage]:
    """SuperRes -> (appearance anchor) -> DecodePublish."""
    out: list[Stage] = [SuperResStage(m.refiner, sigma=c.sr_sigma, window=c.sr_window, seed=c.seed)]
    if c.strategy != "causal":  # the causal strategy's anchor is its attention sink
        anchor = make_config_schedule(c).uses_appearance_anchor
        out.append(AppearanceAnchorStage(m.dit, m.refiner, enabled=anchor, ref_t_position=c.ref_t_position))
    out.append(DecodePublishStage(m.vae, fps=c.fps))
    return out


def default_stages(m: ModelSet, c: PipelineConfig) -> list[Stage]:
    """The model stages of the chunk loop, all in this process (Context runs in `ChunkLoop`);
    a model family that brings its own (`ModelSet.stages`) gets those."""
    if m.stages is not None:
        return m.stages(m, c)
    if c.strategy == "causal":
        denoise: Stage = CausalDenoiseStage(m.dit, steps=c.steps, shift=c.shift,
                                            settings=c.causal_settings(), sampler=c.sampler,
                                            overshoot=c.overshoot, seed=c.seed)
    else:
        denoise = AudioToVideoStage(m.dit, steps=c.steps, sampler=c.sampler, shift=c.shift,
                                    overshoot=c.overshoot, seed=c.seed, guidance=c.guidance,
                                    guidance_input=c.guidance_input)
    return [denoise, *output_stages(m, c)]


def reference_stage(m: ModelSet, c: PipelineConfig):  # type: ignore[no-untyped-def]
    """What encodes a request's reference once: the family's own (`ModelSet.reference`) or ours."""
    if m.reference is not None:
        return m.reference(m, c)
    return ReferenceStage(m.dit, m.refiner, m.vae, m.text, lr_size=c.lr_hw, out_hw=c.out_hw,
                          ref_t_position=c.ref_t_position)


class Pipeline:
    def __init__(self, models: ModelSet, config: PipelineConfig | None = None, *,
                 stages: StageBuilder | None = None) -> None:
        """stages: the model stages to run (default: `default_stages`, everything in this
        process; a pipeline-parallel rank gives its own)."""
        self.models = models
        self.config = config or models.config
        self.clock = MediaClock(fps=self.config.fps, sample_rate=self.config.sample_rate)
        self._build_stages = stages or default_stages

    def executor(self) -> LocalExecutor:
        c = self.config
        from avatarstream.hardware import split_decode

        return LocalExecutor(self._build_stages(self.models, c), decode_overlap=c.decode_overlap,
                             decode_split=split_decode(c.strategy, c.decode_overlap))

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
        One stream through the same chunk loop (`ChunkLoop`) and executor as live sessions: a
        batch of one.
        """
        c, m = self.config, self.models
        for mod in m.modules():
            mod.reset_stats()
        t_start = time.perf_counter()
        state = SessionState(publisher=Publisher(sinks, watermark=c.watermark))
        executor: LocalExecutor | None = None
        try:
            with torch.inference_mode():
                reference_stage(m, c).run(state, reference, prompt, scene)
            t_ref = time.perf_counter()
            for mod in m.modules():
                mod.reset_stats()
            loop = ChunkLoop(m, state, audio, config=c, clock=self.clock,
                             max_samples=None if max_audio_seconds is None
                             else int(max_audio_seconds * c.sample_rate))
            executor = self.executor()
            summary = RunSummary(reference_ms=(t_ref - t_start) * 1000)
            t_first_pub: float | None = None
            while (rec := loop.plan()) is not None:
                executor.run([(rec, state)])
                executor.raise_if_failed()
                loop.finish(rec)
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
            executor.close()
            executor.raise_if_failed()
            state.publisher.drain()
        except BaseException:
            if executor is not None:
                _quietly(executor.close)
            _quietly(state.publisher.drain)
            raise
        t_end = time.perf_counter()
        summary.frames = state.frames_published
        summary.chunks = state.chunks_done
        summary.duration_s = summary.frames / c.fps
        summary.wall_s = t_end - t_start
        if state.publisher.first_frame_time is not None:
            summary.ttff_s = state.publisher.first_frame_time - t_start
        summary.fps = summary.frames / summary.wall_s if summary.wall_s > 0 else 0.0
        summary.rtf = summary.wall_s / summary.duration_s if summary.duration_s else 0.0
        summary.peak_rss_mb = peak_rss_mb()
        stages = [loop.context, *executor.stages]
        summary.stage_ms = {s.name: 1000 * s.seconds / max(1, s.calls) for s in stages}
        if "decode_publish" in summary.stage_ms:  # with its time on the decode thread
            dec = next(s for s in executor.stages if s.name == "decode_publish")
            summary.stage_ms["decode_publish"] = 1000 * (dec.seconds + executor.decode_seconds) / max(1, dec.calls)
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
