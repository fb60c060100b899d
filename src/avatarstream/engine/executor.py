"""Executors: what runs the model stages of planned chunks (vLLM v1's scheduler / executor split).

Whoever plans chunks (`Pipeline.run` for one stream, the live scheduler for many sessions) does
not own devices or threads: it hands a batch of planned chunks, `(ChunkRecord, SessionState)`
items, to an executor. `LocalExecutor` runs the stages in this process, batching the items each
stage can batch (`Stage.batch_key`) and overlapping the VAE decode with the next batch on a thread
of its own. The timestep-pipeline-parallel ranks (`parallel/tpp.py`) are a `LocalExecutor` over
the stages of their rank; tests swap in a scripted fake.

Errors: a stage that raises fails the whole batch (`run` raises). The overlapped decode fails
later and apart from the caller: its errors come back from `failures()` with the session states
of the failed job, so a scheduler ends only those sessions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Protocol

from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import Item, Stage
from avatarstream.engine.stages.decode_publish import DecodePublishStage
from avatarstream.engine.worker import BackgroundWorker, SplitWorker


class Executor(Protocol):
    stages: list[Stage]

    def run(self, items: Sequence[Item]) -> None:
        """Run every stage on the planned chunks (Context already ran)."""

    def wait(self) -> None:
        """Until the background work handed out so far is done."""

    def failures(self) -> list[tuple[BaseException, list[SessionState]]]:
        """Background errors since the last call, with the sessions they hit."""

    def close(self) -> None:
        """Wait for the background work, stop its threads."""


def groups(items: Sequence[Item], key: Callable[[Item], Hashable | None], size: int
           ) -> Iterator[list[Item]]:
    """Items with equal keys in batches of at most `size`, in first-seen order; key None: alone."""
    by: dict[Hashable, list[Item]] = defaultdict(list)
    order: list[Hashable] = []
    for i, it in enumerate(items):
        k = key(it)
        k = ("alone", i) if k is None else k
        if k not in by:
            order.append(k)
        by[k].append(it)
    for k in order:
        group = by[k]
        for i in range(0, len(group), size):
            yield group[i : i + size]


class LocalExecutor:
    def __init__(self, stages: list[Stage], *, decode_overlap: bool = False, batching: bool = True,
                 max_batch: int = 8, decode_split: bool = False) -> None:
        """decode_overlap: the VAE decode + publication on a thread of its own (bit-identical
        video); decode_split: on two threads, a chunk's decode in two parts where the VAE has
        them (`SplitWorker`; the same video); batching False: every item alone (what
        `serve --no-batching` measures)."""
        self.stages = stages
        self.batching, self.max_batch = batching, max_batch
        self.decode_overlap, self.decode_split = decode_overlap, decode_split
        self.worker: BackgroundWorker | SplitWorker | None = None
        self.decode_seconds = 0.0  # seconds the decode thread spent (closed threads included)
        self._failed: list[tuple[BaseException, list[SessionState]]] = []  # of closed threads

    def _attach(self, worker: BackgroundWorker | SplitWorker | None) -> None:
        self.worker = worker
        for s in self.stages:
            if isinstance(s, DecodePublishStage):
                s.worker = worker

    def run(self, items: Sequence[Item]) -> None:
        if self.decode_overlap and self.worker is None:  # started on first use (again after close)
            self._attach(SplitWorker("avatarstream-decode") if self.decode_split
                         else BackgroundWorker("avatarstream-decode", max_queued=1))
        size = self.max_batch if self.batching else 1
        for stage in self.stages:
            key = (lambda it, s=stage: s.batch_key(*it)) if self.batching else (lambda it: None)
            for group in groups(items, key, size):
                stage(group)

    def wait(self) -> None:
        if self.worker is not None:
            self.worker.wait()

    def failures(self) -> list[tuple[BaseException, list[SessionState]]]:
        out, self._failed = self._failed, []
        return out + ([] if self.worker is None else self.worker.failures())

    def raise_if_failed(self) -> None:
        if self._failed:
            raise self._failed[0][0]
        if self.worker is not None:
            self.worker.raise_if_failed()

    def close(self) -> None:
        if self.worker is not None:
            worker = self.worker
            worker.close()
            self._attach(None)
            self.decode_seconds += worker.seconds
            self._failed = worker.failures()
