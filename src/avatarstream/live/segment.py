"""TalkSegment: one utterance of a live session through the engine's chunk loop.

A server interleaves many sessions on one model, so the loop cannot block: a segment is the
engine's `ChunkLoop` (the one `Pipeline.run` steps for a file) over the utterance's audio
(`UtteranceAudio`, which raises `NotReady` instead of waiting), with the reference caches
prepared once per avatar (live/prepared.py): nothing is encoded per utterance. The scheduler plans
each talking session's next chunk (`plan`), runs the planned chunks of all sessions as one batch
through the executor, and finishes them (`finish`).

A segment covers one utterance on the session's timeline, starting at video frame `start_frame`
(so at sample `start_frame * 640`); it ends when its audio does (`UtteranceAudio`), and its video
and audio are published through an `Outlet` at their session-timeline positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import torch

from avatarstream.engine.loop import ChunkLoop
from avatarstream.engine.config import ModelSet
from avatarstream.engine.session import SessionState
from avatarstream.live.prepared import PreparedReference
from avatarstream.live.speech import SpeechQueue


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
        # whole frames; an utterance interrupted before its first packet is one silent frame
        # (zero samples would end the whole session: "the audio is empty")
        pad = (-self.samples) % self.spf if self.samples else self.spf
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


class TalkSegment(ChunkLoop):
    """One utterance: the chunk loop over a prepared reference, publishing at `start_frame`."""

    def __init__(self, models: ModelSet, prepared: PreparedReference, text: torch.Tensor,
                 text_mask: torch.Tensor | None, audio: Iterator[torch.Tensor], outlet: Outlet, *,
                 start_frame: int) -> None:
        c = models.config
        st = SessionState(publisher=_Shifted(outlet, start_frame, start_frame * (c.sample_rate // c.fps)))
        prepared.apply(st)
        st.text, st.text_mask = text, text_mask
        super().__init__(models, st, audio)
        self.audio = audio
        self.start_frame = start_frame

    @property
    def frames_published(self) -> int:
        return self.state.frames_published
