"""Capacity: how many live sessions this machine keeps in real time with one model.

`calibrate` runs at server start-up: it times whole scheduler rounds with one and with two
sessions talking at once (`measure_steps`, the scheduler's own code path: batched chunks, the
overlapped decode), fits step = base + n * per_session, and adds the VP8 encode every viewer
costs (`encode_load`). `ChunkScheduler.admit` refuses a session beyond `Capacity.max_sessions`.

A machine that measures slower than real time for one session (a slow machine, or a busy one at
start-up: another job running) still admits one session, with a warning that says what it measured
(`slow_warning`): refusing every session for the life of the server, for a measurement that may
only have been unlucky, serves nobody; one slow session is visible to its user and to the operator
(`real_time: false` in the capacity), and `--max-sessions N` sets the number outright.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from avatarstream.engine.config import ModelSet
from avatarstream.live.prepared import PreparedReference
from avatarstream.live.scheduler import ChunkScheduler
from avatarstream.live.segment import TalkSegment
from avatarstream.media.synthetic import speechlike

log = logging.getLogger(__name__)


@dataclass
class Capacity:
    """How many sessions can talk at once in real time on this machine with this model."""

    max_sessions: int
    step_base_s: float = 0.0  # seconds per scheduler step, fixed part
    step_per_session_s: float = 0.0  # ... and per talking session in the batch
    chunk_media_s: float = 0.0  # media seconds a steady-state chunk advances a session
    encode_load: float = 0.0  # CPU seconds per media second to encode one viewer's stream
    target_load: float = 0.8
    measured: bool = False

    def load(self, n: int) -> float:
        """Predicted busy fraction with n sessions talking at once."""
        if self.chunk_media_s <= 0:
            return 0.0
        step = self.step_base_s + n * self.step_per_session_s
        return step / self.chunk_media_s + n * self.encode_load

    def admissible(self, limit: int = 64) -> int:
        """Sessions to admit: the first when its predicted load is at most 1 (real time at all),
        each further one while the load stays within target_load (see `calibrate`)."""
        n = 1 if self.load(1) <= 1.0 else 0
        while n and n < limit and self.load(n + 1) <= self.target_load:
            n += 1
        return n

    @property
    def real_time(self) -> bool:
        """Whether one session was measured to keep real time (True when not measured)."""
        return not self.measured or self.load(1) <= 1.0

    def session_fps(self, fps: int) -> float:
        """Frames per second one session was measured to run at (`fps` when it keeps up)."""
        load = self.load(1)
        return fps / load if load > 0 else float(fps)

    def describe(self, fps: int) -> str:
        """One line for the operator: what was measured (or set) and what it admits."""
        n = f"{self.max_sessions} live session{'s' if self.max_sessions != 1 else ''} at once"
        if not self.measured:
            return f"capacity: {n} (set by --max-sessions)"
        return (f"capacity: {n} (measured: one session runs at {self.session_fps(fps):.1f} fps of the "
                f"{fps} needed, load {self.load(1):.2f}; each chunk of {self.chunk_media_s:.2f} s of video "
                f"takes {self.step_base_s + self.step_per_session_s:.2f} s)")

    def as_dict(self) -> dict:
        return {"max_sessions": self.max_sessions, "measured": self.measured, "real_time": self.real_time,
                "step_base_s": round(self.step_base_s, 4),
                "step_per_session_s": round(self.step_per_session_s, 4),
                "chunk_media_s": round(self.chunk_media_s, 3),
                "encode_load": round(self.encode_load, 4), "target_load": self.target_load}




# -- calibration --------------------------------------------------------------------------------
class _NullOutlet:
    def put_video(self, frames: np.ndarray, start_frame: int, fps: int) -> None:
        pass

    def put_audio(self, samples: np.ndarray, start_sample: int, sample_rate: int) -> None:
        pass


def _speech_iter(seconds: float, sample_rate: int) -> Iterator[torch.Tensor]:

    x = torch.from_numpy(speechlike(seconds, sample_rate))
    return iter(x.split(sample_rate // 25 * 4))


def measure_steps(models: ModelSet, prepared: PreparedReference, sessions: int, *,
                  steps: int = 4, warmup: int = 3, batching: bool = True) -> tuple[float, float]:
    """Seconds per steady-state scheduler step with `sessions` talking at once, and the media
    seconds one step advances each session. The first `warmup` rounds are not counted: the first
    chunk is longer, and the next few run slower while the allocator and oneDNN's primitive
    cache warm up (0.95, 0.69, 0.57, 0.53 s decodes, then steady, for the bundled model here).

    The time is that of `steps` whole rounds, from the end of the first round's decode to the end
    of the last one's: with the decode overlapped (a thread of its own, one job waiting), timing
    the scheduler's calls alone would count the denoising and miss the decode whenever that is the
    slower side, and the server would admit sessions it cannot decode in real time."""
    c = models.config
    text, mask = models.text.call("encode", [""])
    segs = [TalkSegment(models, prepared, text, mask, _speech_iter(30.0, c.sample_rate),  # type: ignore[arg-type]
                        _NullOutlet(), start_frame=0) for _ in range(sessions)]
    sched = ChunkScheduler(models, batching=batching)
    t0, f0 = 0.0, 0
    try:
        for i in range(warmup + steps):
            if i == warmup:  # the steady state starts
                sched.flush()
                t0, f0 = time.perf_counter(), segs[0].state.frames_emitted
            items = [(seg.plan(), seg) for seg in segs]
            sched.run_items([(r, s) for r, s in items if r is not None])
        sched.flush()
        elapsed = time.perf_counter() - t0
        frames = segs[0].state.frames_emitted - f0
    finally:
        sched.stop()
    return elapsed / steps, frames / steps / c.fps


def encode_load(size: int | tuple[int, int], fps: int = 25, frames: int = 20) -> float:
    """CPU seconds per media second that WebRTC's VP8 encoder spends on one stream at `size`
    (the side of a square, or (height, width))."""
    try:
        from aiortc.codecs.vpx import Vp8Encoder
    except ImportError:
        return 0.0
    import av
    from fractions import Fraction

    enc = Vp8Encoder()
    rng = np.random.default_rng(0)
    h, w = (size, size) if isinstance(size, int) else size
    base = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    t0 = time.perf_counter()
    for i in range(frames):
        f = av.VideoFrame.from_ndarray(np.roll(base, i, axis=1), format="rgb24")
        f.pts, f.time_base = i * 3600, Fraction(1, 90000)
        enc.encode(f)
    return (time.perf_counter() - t0) / frames * fps


def calibrate(models: ModelSet, prepared: PreparedReference, *, target_load: float = 0.8,
              limit: int = 64) -> Capacity:
    """Measure one and two sessions talking at once and fit step = base + n * per_session.

    The first session is always admitted: when the machine keeps it in real time (predicted load
    ≤ 1) there is no other session its lag could hurt, and when it does not, a server that refuses
    every session serves nobody (`slow_warning` is logged; module doc). Each further one only while
    the predicted load stays within `target_load`, the margin that keeps the sessions already
    talking real time."""
    # two sessions first: a fresh process runs its first rounds slower for a while, and that errs
    # towards admitting fewer (c2 high), never more. One session twice, the faster kept: a start-up
    # measurement is only ever slowed by something passing (seen: 0.35 and 0.48 s a round for the
    # bundled model minutes apart), and the lag check in `admit` refuses new sessions if the
    # ones talking fall behind anyway.
    c2, _ = measure_steps(models, prepared, 2)
    c1, media = min(measure_steps(models, prepared, 1), measure_steps(models, prepared, 1))
    per = max(c2 - c1, 0.25 * c1)  # batching never makes a session free
    base = max(0.0, c1 - per)
    cap = Capacity(0, base, per, media, encode_load(models.config.out_hw), target_load, True)
    n = cap.admissible(limit)
    if n == 0:  # slower than real time, or busy while measuring: warn, admit one (module doc)
        log.warning(slow_warning(cap, models.config.fps, models.name))
    cap.max_sessions = max(1, n)
    return cap


def slow_warning(cap: Capacity, fps: int, model: str) -> str:
    """The warning of a machine measured slower than real time for one session."""
    return (f"this machine measured {cap.session_fps(fps):.1f} fps for one live session of model {model}, "
            f"{fps} fps are needed (a chunk of {cap.chunk_media_s:.2f} s of video took "
            f"{cap.step_base_s + cap.step_per_session_s:.2f} s, VP8 encoding {cap.encode_load:.2f} s a second): "
            "sessions will lag behind real time. One session is admitted anyway. If the machine was busy "
            "while measuring, restart when it is idle; --max-sessions N sets the number of sessions outright")
