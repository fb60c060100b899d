"""TalkSegment: the engine's chunk loop for one utterance, stepped from outside.

`Pipeline.run` is one blocking loop per request. A server interleaves many sessions on one model,
so here the same loop is cut into steps a scheduler calls: `plan()` pulls the audio the next chunk
needs (never blocking: `NotReady` says when to come back) and runs the Context stage; the scheduler
then runs the denoising and super-resolution stages (alone, or batched with other sessions'
chunks: serve/batch.py); `finish()` runs the rest (appearance anchor, decode + publish) and
releases what the chunk does not hand on. The stages, the schedule, the rolling state and the
audio context are the engine's own (`default_stages`, `Pipeline._schedule`), and the reference
caches come prepared (serve/prepared.py): nothing is encoded per utterance.

A segment covers one utterance on the session's timeline, starting at video frame `start_frame`
(so at sample `start_frame * 640`); it ends when its audio does (`UtteranceAudio`), and its video
and audio are published through an `Outlet` at their session-timeline positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import torch

from avatarstream.engine.audio_context import AudioContext
from avatarstream.engine.pipeline import ModelSet, Pipeline, default_stages
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.stages.audio_to_video import AudioToVideoStage
from avatarstream.engine.stages.super_res import SuperResStage
from avatarstream.serve.live_audio import SpeechQueue
from avatarstream.serve.prepared import PreparedReference


class NotReady(Exception):
    """The audio the next chunk needs has not arrived and is not due as silence before `due`."""

    def __init__(self, due: float | None) -> None:
        super().__init__("not ready")
        self.due = due  # wall time (monotonic) worth trying again at; None: when speech arrives


class Outlet(Protocol):
    """Where a segment publishes (session-timeline positions; video [N, H, W, 3] uint8)."""

    def put_video(self, frames: np.ndarray, start_frame: int, fps: int) -> None: ...

    def put_audio(self, samples: np.ndarray, start_sample: int, sample_rate: int) -> None: ...


class _Shifted:
    """An Outlet seen from a segment: positions relative to the segment's first frame."""

    def __init__(self, outlet: Outlet, start_frame: int, start_sample: int) -> None:
        self.outlet, self.start_frame, self.start_sample = outlet, start_frame, start_sample

    def put_video(self, frames: np.ndarray, start_frame: int, fps: int) -> None:
        self.outlet.put_video(frames, self.start_frame + start_frame, fps)

    def put_audio(self, samples: np.ndarray, start_sample: int, sample_rate: int) -> None:
        self.outlet.put_audio(samples, self.start_sample + start_sample, sample_rate)


class UtteranceAudio:
    """The audio iterator of one segment, over a session's SpeechQueue. Never blocks.

    Queued speech is handed out at once. A pause in live speech (the queue runs dry before the
    utterance is marked complete) is bridged with silence, paced so the timeline never runs more
    than `lead_s` ahead of the wall clock (`NotReady` until the next packet is due). A pause of
    `hangover_s` — bridged, or silence the client sent (packets under `silence_rms`) — ends the
    utterance, as does its completion (`end_of_speech`, a scripted utterance spoken, an
    interrupt, the session closing). The segment's length is padded with silence to whole video
    frames, so the next segment starts on a frame boundary.
    """

    def __init__(self, queue: SpeechQueue, *, start_sample: int, origin: float, lead_s: float,
                 packet_s: float = 0.04, hangover_s: float = 0.6, samples_per_frame: int = 640,
                 silence_rms: float = 0.003, now: Callable[[], float]) -> None:
        self.q = queue
        self.sr = queue.sample_rate
        self.start_sample = start_sample
        self.origin, self.lead_s, self.now = origin, lead_s, now
        self.packet = max(1, round(packet_s * self.sr))
        self.hangover = round(hangover_s * self.sr)
        self.spf = samples_per_frame
        self.silence_rms = silence_rms
        self.epoch = queue.epoch
        self.samples = 0  # handed out so far (speech + silence)
        self.speech = 0
        self.pause = 0  # silence handed out since the last speech
        self.finished = False
        self.interrupted = False

    def __iter__(self) -> UtteranceAudio:
        return self

    def _end(self) -> torch.Tensor:
        self.finished = True
        pad = (-self.samples) % self.spf
        if not pad:
            raise StopIteration
        self.samples += pad
        return torch.zeros(pad)

    def __next__(self) -> torch.Tensor:
        if self.finished:
            raise StopIteration
        if self.q.epoch != self.epoch:  # interrupted: what was taken is spoken, nothing more
            self.interrupted = True
            return self._end()
        if self.pause >= self.hangover:  # a long enough pause: the utterance is over
            return self._end()
        x = self.q.take(self.packet)
        if x.size:
            self.samples += x.size
            if float(np.sqrt(np.mean(x.astype(np.float64) ** 2))) < self.silence_rms:
                self.pause += x.size  # the client's own silence counts as a pause
            else:
                self.speech += x.size
                self.pause = 0
            return torch.from_numpy(x)
        if self.q.ended or self.q.closed or self.pause >= self.hangover:
            return self._end()
        due = self.origin + (self.start_sample + self.samples) / self.sr - self.lead_s
        if self.now() < due:
            raise NotReady(due)
        self.samples += self.packet
        self.pause += self.packet
        return torch.zeros(self.packet)


class TalkSegment:
    """One utterance through the engine's stages, one chunk per `plan()` + `finish()`."""

    def __init__(self, models: ModelSet, prepared: PreparedReference, text: torch.Tensor,
                 text_mask: torch.Tensor | None, audio: Iterator[torch.Tensor], outlet: Outlet, *,
                 start_frame: int) -> None:
        c = models.config
        pipe = Pipeline(models)
        self.config = c
        self.audio = audio
        self.start_frame = start_frame
        self.schedule = pipe._schedule()
        spf = c.sample_rate // c.fps
        out = _Shifted(outlet, start_frame, start_frame * spf)
        st = SessionState()
        st.dit_reference, st.refiner_reference = prepared.dit, prepared.refiner
        st.store.set_scene(prepared.scene_lr, prepared.scene_motion)
        st.text, st.text_mask = text, text_mask
        span = max(c.chunk, c.interp_gap + c.interp_anchor + 2, c.block + 1)
        st.audio = AudioContext(
            audio, models.audio, models.make_audio_stream(), pipe.clock, window=c.audio_window,
            keep_frames=4 * (3 * span + 4) + 8 * c.audio_window + 16,
            on_audio=lambda x, start: out.put_audio(x.numpy(), start, c.sample_rate))
        st.vae_cache = models.vae.call("new_cache")
        self.state = st
        self.stages: list[Stage] = default_stages(pipe, self.schedule, out)  # type: ignore[arg-type]
        self.context, self.rest = self.stages[0], self.stages[1:]
        self.done = False

    @property
    def frames_published(self) -> int:
        return self.state.frames_published

    @property
    def batchable(self) -> bool:
        """Whether the denoise and SR stages are the ones serve/batch.py can run for many."""
        return (len(self.rest) >= 2 and type(self.rest[0]) is AudioToVideoStage
                and type(self.rest[1]) is SuperResStage and self.config.sampler == "euler")

    def plan(self) -> ChunkRecord | None:
        """Pull the next chunk's audio and run its Context stage; None once the segment is done.

        Raises NotReady (nothing consumed that matters: call again later)."""
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
        self.context(rec, st)
        return rec

    def run_alone(self, rec: ChunkRecord) -> None:
        """Every remaining stage of the chunk, unbatched."""
        for stage in self.rest:
            stage(rec, self.state)
        self._release(rec)

    def finish(self, rec: ChunkRecord) -> None:
        """The stages after denoise + SR (which a batch ran): anchor, decode and publish."""
        for stage in self.rest[2:]:
            stage(rec, self.state)
        self._release(rec)

    def _release(self, rec: ChunkRecord) -> None:
        self.state.store.release(rec.plan.release)
        self.state.chunks_done += 1
        # frames handed to the decode (published, or about to be by a decode thread)
        if self.state.total_frames is not None and self.state.frames_emitted >= self.state.total_frames:
            self.done = True
