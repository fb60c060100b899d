"""ChunkScheduler: one worker thread runs the chunk work of every session on one loaded model.

Each round it asks every live session for what is due (`LiveSession.poll`: idle frames are
rendered there and then; a talk chunk whose audio is in comes back as a planned record), runs the
talk chunks of all sessions together — denoise, super-resolution and decode batched across
sessions where shapes allow (serve/batch.py), the rest per session — and, only when no live chunk
was due, one chunk of a render job. Then it sleeps until the earliest session says it has work
(`due`) or something is pushed (`notify`).

Decode overlap (`decode_overlap`, the default): a round's VAE decode and publication (`DecodeJob`)
run on a thread of their own (`_Finisher`, one job waiting at most) while the scheduler denoises
the next round, as the engine's DecodeWorker does for one request: on a 2-core CPU that is what
makes one session real time. The video is the same (test). What a decode job touches (conv caches,
`frames_published`, outlets) is the finisher's until it is done; the scheduler waits for it
(`flush`) before a segment ends (idle frames follow the last talk frame), before a session is
dropped, and before a round that decodes some chunk outside a job (interp I/N pairs).

Admission (`admit`): a new live session is refused, with a message that says why, when the
measured capacity (`Capacity`, from `calibrate` at start-up or an operator's `max_sessions`) is
reached or the sessions already open are falling behind real time. Refusing the new one keeps the
others real time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from avatarstream.engine.pipeline import ModelSet
from avatarstream.serve.batch import DecodeJob, denoise_batch, finish_prepare, refine_batch
from avatarstream.serve.segment import TalkSegment

if TYPE_CHECKING:
    from avatarstream.engine.stage import ChunkRecord
    from avatarstream.serve.prepared import PreparedReference
    from avatarstream.serve.session import LiveSession

log = logging.getLogger(__name__)

Item = tuple["ChunkRecord", TalkSegment]


class Job(Protocol):
    """Non-live work (a render): runs one chunk per `step()` when no live chunk is due."""

    done: bool

    def step(self) -> None: ...

    def fail(self, error: BaseException) -> None: ...


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

    def as_dict(self) -> dict:
        return {"max_sessions": self.max_sessions, "measured": self.measured,
                "step_base_s": round(self.step_base_s, 4),
                "step_per_session_s": round(self.step_per_session_s, 4),
                "chunk_media_s": round(self.chunk_media_s, 3),
                "encode_load": round(self.encode_load, 4), "target_load": self.target_load}


@dataclass
class SchedulerStats:
    rounds: int = 0
    talk_steps: int = 0
    chunks: int = 0
    busy_s: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    step_s: dict[int, float] = field(default_factory=dict)  # EWMA seconds per step by batch size

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "talk_steps": self.talk_steps, "chunks": self.chunks,
                "busy_s": round(self.busy_s, 3), "batch_sizes": dict(self.batch_sizes),
                "step_s": {k: round(v, 4) for k, v in self.step_s.items()}}


class _Finisher:
    """A thread that runs decode jobs one after the other; one job waits at most (`submit`
    blocks). A failed job's error and segments come back from the next `submit` or `flush`."""

    def __init__(self) -> None:
        import queue

        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._failed: list[tuple[BaseException, list[TalkSegment]]] = []
        self._lock = threading.Lock()
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="avatarstream-serve-decode", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                t0 = time.perf_counter()
                try:
                    with torch.inference_mode():
                        job.run()
                except Exception as e:  # noqa: BLE001 - handed back to the scheduler
                    log.warning("a decode job failed", exc_info=True)
                    with self._lock:
                        self._failed.append((e, job.segments))
                self.seconds += time.perf_counter() - t0
            finally:
                self._q.task_done()

    def _take_failed(self) -> list[tuple[BaseException, list[TalkSegment]]]:
        with self._lock:
            out, self._failed = self._failed, []
        return out

    def submit(self, job: DecodeJob) -> list[tuple[BaseException, list[TalkSegment]]]:
        self._q.put(job)
        return self._take_failed()

    def wait(self) -> None:
        """Wait until every submitted job is done."""
        self._q.join()

    def flush(self) -> list[tuple[BaseException, list[TalkSegment]]]:
        """Wait until every submitted job is done; the failures since the last call."""
        self._q.join()
        return self._take_failed()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(10.0)


class ChunkScheduler:
    def __init__(self, models: ModelSet, *, batching: bool = True, max_batch: int = 8,
                 capacity: Capacity | None = None, max_lag_s: float = 1.0,
                 gather_s: float = 0.2, now: Callable[[], float] = time.monotonic,
                 decode_overlap: bool = True) -> None:
        self.models = models
        self.decode_overlap = decode_overlap
        self._finisher: _Finisher | None = None
        self.batching = batching
        self.gather_s = gather_s
        self.max_batch = max_batch
        self.capacity = capacity
        self.max_lag_s = max_lag_s
        self.now = now
        self.stats = SchedulerStats()
        self._sessions: list[LiveSession] = []
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._wake = False
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="avatarstream-scheduler",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish every session (sinks closed) and stop the thread."""
        with self._cond:
            for s in self._sessions:
                s.queue.close()
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._finisher is not None:
            self.flush()
            self._finisher.close()
            self._finisher = None

    def add(self, session: LiveSession) -> None:
        with self._cond:
            self._sessions.append(session)
            self._cond.notify_all()

    def add_job(self, job: Job) -> None:
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()

    def notify(self) -> None:
        with self._cond:
            self._wake = True
            self._cond.notify_all()

    @property
    def sessions(self) -> list[LiveSession]:
        with self._cond:
            return list(self._sessions)

    # -- admission -------------------------------------------------------------------------------
    def lag_s(self, session: LiveSession) -> float:
        """How far the session's timeline is behind the wall clock (> 0: late)."""
        if session.origin is None:
            return 0.0
        return (self.now() - session.origin) - session.frame / session.fps

    def admit(self) -> str | None:
        """None if one more live session can be served in real time, else why not."""
        live = [s for s in self.sessions if not s.finished]
        cap = self.capacity
        name = self.models.name
        if cap is not None and len(live) >= cap.max_sessions:
            if cap.max_sessions == 0:
                return (f"this machine cannot run model {name} in real time (one chunk of "
                        f"{cap.chunk_media_s:.2f} s of video takes {cap.step_base_s + cap.step_per_session_s:.2f} s); "
                        f"use a faster model, or start the server with --max-sessions to accept "
                        f"slower than real time")
            return (f"the server is at capacity: {len(live)} live session(s), the most it can keep "
                    f"in real time with model {name} on this machine; try again later")
        behind = [s for s in live if s.talking and self.lag_s(s) > self.max_lag_s]
        if behind:
            return (f"the server is falling behind real time ({len(behind)} session(s) late by more "
                    f"than {self.max_lag_s:g} s); try again later")
        return None

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stop and not self._sessions:
                    return
                sessions = list(self._sessions)
            now = self.now()
            items: list[Item] = []
            for s in sessions:
                if s.finished:
                    self._drop(s, None)
                    continue
                try:
                    item = s.poll(now)
                except Exception as e:  # noqa: BLE001 - one failing session must not stop the rest
                    log.warning("live session failed", exc_info=True)
                    self._drop(s, e)
                    continue
                if item is not None:
                    items.append(item)
            if items and self.batching and self.gather_s > 0:
                # Sessions whose next chunk is due within gather_s join this batch now (they run
                # that much further ahead of the wall clock) instead of a batch of their own.
                taken = {id(seg) for _, seg in items}
                for s in sessions:
                    if (s.segment is not None and id(s.segment) not in taken and not s.finished
                            and s.due is not None and s.due <= now + self.gather_s):
                        try:
                            item = s.poll(now + self.gather_s)
                        except Exception as e:  # noqa: BLE001
                            self._drop(s, e)
                            continue
                        if item is not None:
                            items.append(item)
            self.stats.rounds += 1
            if items:
                self._talk(items)
                continue
            job = self._next_job()
            if job is not None:
                t0 = time.perf_counter()
                try:
                    job.step()
                except Exception as e:  # noqa: BLE001 - reported by the job
                    log.warning("render job failed", exc_info=True)
                    job.fail(e)
                self.stats.busy_s += time.perf_counter() - t0
                continue
            dues = [s.due for s in sessions if s.due is not None]
            timeout = 0.05 if not dues else min(0.05, max(0.0, min(dues) - self.now()))
            with self._cond:
                if not self._wake and not self._stop and timeout > 0:
                    self._cond.wait(timeout)
                self._wake = False

    def _next_job(self) -> Job | None:
        with self._cond:
            while self._jobs and self._jobs[0].done:
                self._jobs.popleft()
            if not self._jobs:
                return None
            self._jobs.rotate(-1)  # round robin between jobs
            return self._jobs[-1]

    def wait_decoded(self) -> None:
        """Wait for the decode thread to finish what it was given (its failures stay pending
        for the next `flush`): what a session calls before publishing anything after a segment."""
        if self._finisher is not None:
            self._finisher.wait()

    def flush(self) -> None:
        """Wait for the decode thread to finish what it was given; sessions whose decode failed
        end with the error."""
        if self._finisher is not None:
            self._fail(self._finisher.flush())

    def _fail(self, failed: list[tuple[BaseException, list[TalkSegment]]]) -> None:
        for error, segs in failed:
            ids = {id(seg) for seg in segs}
            for s in self.sessions:
                if s.segment is not None and id(s.segment) in ids:
                    self._drop(s, error)

    def _drop(self, session: LiveSession, error: BaseException | None) -> None:
        # the decode thread's frames reach the sinks before they close
        pending = self._finisher.flush() if self._finisher is not None else []
        with self._cond:
            if session in self._sessions:
                self._sessions.remove(session)
        session.finalize(error)
        self._fail(pending)

    def _talk(self, items: list[Item]) -> None:
        t0 = time.perf_counter()
        try:
            self.run_items(items)
        except Exception as e:  # noqa: BLE001 - the sessions of a failed batch end with the error
            log.warning("a batch of %d chunks failed", len(items), exc_info=True)
            for _, seg in items:
                for s in self.sessions:
                    if s.segment is seg:
                        self._drop(s, e)
            return
        dt = time.perf_counter() - t0
        n = len(items)
        st = self.stats
        st.busy_s += dt
        st.talk_steps += 1
        st.chunks += n
        st.batch_sizes[n] += 1
        st.step_s[n] = dt if n not in st.step_s else 0.8 * st.step_s[n] + 0.2 * dt
        if any(seg.done for _, seg in items):
            self.flush()  # a segment ends: its last frames are out before the idle ones
        by_seg = {id(s.segment): s for s in self.sessions if s.segment is not None}
        for _, seg in items:
            owner = by_seg.get(id(seg))
            if owner is not None:
                owner.chunk_done(seg)

    def run_items(self, items: list[Item]) -> None:
        """Run planned chunks of several segments: batched where shapes allow, else one by one."""
        batchable = [it for it in items if self.batching and it[1].batchable]
        for rec, seg in items:
            if not (self.batching and seg.batchable):
                seg.run_alone(rec)
        if not batchable:
            return
        for group in _groups(batchable, lambda it: it[0].plan.length, self.max_batch):
            denoise_batch(group)
        for group in _groups(batchable, _sr_shape, self.max_batch):
            refine_batch(group)
        # a segment's first frames are decoded here, with every core (time to first frame), as
        # the engine does; so is a round with chunks that publish others (interp)
        overlap = (self.decode_overlap
                   and all(rec.plan.publish == (rec.plan.id,) for rec, _ in batchable)
                   and all(seg.state.frames_emitted > 0 for _, seg in batchable))
        if not overlap:
            self.flush()  # chunks decoded here come after the ones the thread still has
        for group in _groups(batchable, lambda it: 0, self.max_batch):
            job = finish_prepare(group)
            if not overlap:
                job.run()
                continue
            if self._finisher is None:
                self._finisher = _Finisher()
            self._fail(self._finisher.submit(job))


def _sr_shape(item: Item) -> tuple[int, int]:
    rec, seg = item
    e0, e1 = rec.plan.emit
    c0 = max(0, e0 - seg.rest[1].window)
    return e1 - c0, e0 - c0


def _groups(items: list[Item], key: Callable[[Item], object], size: int) -> Iterator[list[Item]]:
    by: dict[object, list[Item]] = defaultdict(list)
    for it in items:
        by[key(it)].append(it)
    for group in by.values():
        for i in range(0, len(group), size):
            yield group[i : i + size]


# -- calibration --------------------------------------------------------------------------------
class _NullOutlet:
    def put_video(self, frames: np.ndarray, start_frame: int, fps: int) -> None:
        pass

    def put_audio(self, samples: np.ndarray, start_sample: int, sample_rate: int) -> None:
        pass


def _speech_iter(seconds: float, sample_rate: int) -> Iterator[torch.Tensor]:
    from avatarstream.bench.inputs import speechlike

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


def encode_load(size: int, fps: int = 25, frames: int = 20) -> float:
    """CPU seconds per media second that WebRTC's VP8 encoder spends on one stream at `size`."""
    try:
        from aiortc.codecs.vpx import Vp8Encoder
    except ImportError:
        return 0.0
    import av
    from fractions import Fraction

    enc = Vp8Encoder()
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    t0 = time.perf_counter()
    for i in range(frames):
        f = av.VideoFrame.from_ndarray(np.roll(base, i, axis=1), format="rgb24")
        f.pts, f.time_base = i * 3600, Fraction(1, 90000)
        enc.encode(f)
    return (time.perf_counter() - t0) / frames * fps


def calibrate(models: ModelSet, prepared: PreparedReference, *, target_load: float = 0.8,
              limit: int = 64) -> Capacity:
    """Measure one and two sessions talking at once and fit step = base + n * per_session.

    The first session is admitted when the machine keeps it in real time at all (predicted load
    ≤ 1): there is no other session its lag could hurt, and a server that refuses every session
    serves nobody. Each further one only while the predicted load stays within `target_load`,
    the margin that keeps the sessions already talking real time."""
    # two sessions first: a fresh process runs its first rounds slower for a while, and that errs
    # towards admitting fewer (c2 high), never more. One session twice, the faster kept: a start-up
    # measurement is only ever slowed by something passing (seen: 0.35 and 0.48 s a round for the
    # bundled model minutes apart), and the lag check in `admit` refuses new sessions if the
    # ones talking fall behind anyway.
    c2, _ = measure_steps(models, prepared, 2)
    c1, media = min(measure_steps(models, prepared, 1), measure_steps(models, prepared, 1))
    per = max(c2 - c1, 0.25 * c1)  # batching never makes a session free
    base = max(0.0, c1 - per)
    cap = Capacity(0, base, per, media, encode_load(models.config.hr_size), target_load, True)
    cap.max_sessions = cap.admissible(limit)
    return cap
