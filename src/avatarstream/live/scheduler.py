"""ChunkScheduler: one worker thread runs the chunk work of every session on one loaded model.

Each round it asks every live session for what is due (`LiveSession.poll`: idle frames are
rendered there and then; a talk chunk whose audio is in comes back as a planned record), runs the
talk chunks of all sessions together through the executor — the engine's own stages, batched
across sessions where shapes allow (`Stage.batch_key`), a file render's code path with a batch of
many — and, only when no live chunk was due, one chunk of a render job. Then it sleeps until the earliest session says it has work
(`due`) or something is pushed (`notify`).

Decode overlap (`decode_overlap`, the default): a round's VAE decode and publication (`DecodeJob`)
run on the executor's decode thread (one job waiting at most) while the scheduler denoises the
next round, as for a file render: on a 2-core CPU that is what makes one session real time. The
video is the same (test). What a decode job touches (conv caches, `frames_published`, outlets) is
the decode thread's until it is done; the scheduler waits for it
(`flush`) before a segment ends (idle frames follow the last talk frame), before a session is
dropped, and before a round that decodes some chunk outside a job (interp I/N pairs).

Admission (`admit`): a new live session is refused, with a message that says why, when the
measured capacity (`live/capacity.py`, from `calibrate` at start-up or an operator's `max_sessions`) is
reached or the sessions already open are falling behind real time. Refusing the new one keeps the
others real time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol


from avatarstream.engine.executor import Executor, LocalExecutor
from avatarstream.engine.config import ModelSet
from avatarstream.engine.pipeline import default_stages
from avatarstream.engine.session import SessionState
from avatarstream.errors import AvatarStreamError
from avatarstream.live.segment import TalkSegment

if TYPE_CHECKING:
    from avatarstream.engine.stage import ChunkRecord

log = logging.getLogger(__name__)

Item = tuple["ChunkRecord", TalkSegment]


class MeasuredCapacity(Protocol):
    """What admission reads of the measured capacity (`live/capacity.Capacity`, which imports
    this module: the protocol keeps the import one way)."""

    max_sessions: int
    step_base_s: float
    step_per_session_s: float
    chunk_media_s: float

    def as_dict(self) -> dict: ...


class ScheduledSession(Protocol):
    """What the scheduler asks of a live session (`live/session.LiveSession`, which imports this
    module: the protocol keeps the import one way)."""

    queue: Any  # closed when the scheduler stops
    origin: float | None  # wall time of media time 0 (None: not started)
    frame: int
    fps: int
    segment: TalkSegment | None
    due: float | None  # when `poll` has work next

    @property
    def talking(self) -> bool: ...

    @property
    def finished(self) -> bool: ...

    def poll(self, now: float) -> Item | None: ...

    def chunk_done(self, seg: TalkSegment) -> None: ...

    def finalize(self, error: BaseException | None) -> None: ...


class Job(Protocol):
    """Non-live work (a render): runs one chunk per `step()` when no live chunk is due."""

    done: bool

    def step(self) -> None: ...

    def fail(self, error: BaseException) -> None: ...


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


class ChunkScheduler:
    def __init__(self, models: ModelSet, *, batching: bool = True, max_batch: int = 8,
                 capacity: MeasuredCapacity | None = None, max_lag_s: float = 1.0,
                 gather_s: float = 0.2, now: Callable[[], float] = time.monotonic,
                 decode_overlap: bool = True, executor: Executor | None = None,
                 decode_split: bool | None = None) -> None:
        """executor: what runs the chunks' model stages (default: this process, `LocalExecutor`
        over the engine's stages; tests give a scripted fake). decode_split: the decode in two
        parts on two threads (default: `hardware.split_decode`)."""
        from avatarstream.hardware import split_decode

        self.models = models
        if decode_split is None:
            decode_split = split_decode(models.config.strategy, decode_overlap, live=True)
        self.executor = executor or LocalExecutor(
            default_stages(models, models.config), decode_overlap=decode_overlap, batching=batching,
            max_batch=max_batch, decode_split=decode_split)
        self.batching, self.gather_s, self.max_batch = batching, gather_s, max_batch
        self.capacity, self.max_lag_s, self.now = capacity, max_lag_s, now
        self.stats = SchedulerStats()
        self._sessions: list[ScheduledSession] = []
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
        self.flush()
        self.executor.close()

    def add(self, session: ScheduledSession) -> None:
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
    def sessions(self) -> list[ScheduledSession]:
        with self._cond:
            return list(self._sessions)

    # -- admission -------------------------------------------------------------------------------
    def lag_s(self, session: ScheduledSession) -> float:
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
                    # a user-facing error (disk full) is one line; anything else keeps its traceback
                    log.warning("live session failed: %s", e,
                                exc_info=not isinstance(e, AvatarStreamError))
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
        self.executor.wait()

    def flush(self) -> None:
        """Wait for the decode thread to finish what it was given; sessions whose decode failed
        end with the error."""
        self.executor.wait()
        self._fail(self.executor.failures())

    def _fail(self, failed: list[tuple[BaseException, list[SessionState]]]) -> None:
        for error, states in failed:
            ids = {id(st) for st in states}
            for s in self.sessions:
                if s.segment is not None and id(s.segment.state) in ids:
                    self._drop(s, error)

    def _drop(self, session: ScheduledSession, error: BaseException | None) -> None:
        # the decode thread's frames reach the sinks before they close
        self.executor.wait()
        pending = self.executor.failures()
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
        """Run planned chunks of several segments through the executor (batched where shapes
        allow), then finish each segment's chunk."""
        self.executor.run([(rec, seg.state) for rec, seg in items])
        for rec, seg in items:
            seg.finish(rec)
        self._fail(self.executor.failures())
