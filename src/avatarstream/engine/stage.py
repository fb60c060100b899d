"""Stage: a typed unit of work over a batch of chunks.

A stage holds no weights (modules do) and no session's state (that is the `SessionState` each
item brings). It declares which fields of the `ChunkRecord` it reads and which it writes; the
executor checks both on every call, so a mis-wired pipeline fails at once with the stage's name
instead of deep inside a model.

Batch-first (nanochat's engine): `run` takes a list of (record, session state) items. A file
render is a batch of one; a round of live sessions is a batch of many, made of the items whose
`batch_key` is equal (same shapes). A stage that works one session at a time implements
`run_one` and has no batch key.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

import torch

from avatarstream.engine.schedule import ChunkPlan

if TYPE_CHECKING:
    from avatarstream.engine.session import SessionState


@dataclass
class ChunkRecord:
    """Everything one chunk needs on its way through the stages; dropped once it is published."""

    plan: ChunkPlan
    given: torch.Tensor | None = None  # [B, T] bool frame-conditioning mask
    audio: torch.Tensor | None = None  # [B, T, A, Da] audio tokens per latent frame
    sigma_noise: torch.Tensor | None = None  # [B, C, T, h, w] initial noise of the chunk
    motion_noise: torch.Tensor | None = None  # [B, T, Dm]
    lr_latents: torch.Tensor | None = None  # [B, C, T, h, w] denoised low-resolution latents
    motion: torch.Tensor | None = None  # [B, T, Dm] denoised motion tokens
    hr_latents: torch.Tensor | None = None  # [B, C, E, 2h, 2w] refined latents of the emitted frames


Item = tuple[ChunkRecord, "SessionState"]


class Stage:
    """Base class. Subclasses set `name`, `reads`, `writes` and implement `run` (a batch) or
    `run_one` (one item; `run` then loops)."""

    name: ClassVar[str] = "stage"
    reads: ClassVar[tuple[str, ...]] = ()
    writes: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def batch_key(self, rec: ChunkRecord, state: "SessionState") -> Hashable | None:
        """Items with equal keys may run as one batch; None: this item runs alone."""
        return None

    def run(self, items: Sequence[Item]) -> None:
        for rec, state in items:
            self.run_one(rec, state)

    def run_one(self, rec: ChunkRecord, state: "SessionState") -> None:
        raise NotImplementedError

    def __call__(self, items: Sequence[Item]) -> None:
        for rec, _ in items:
            for f in self.reads:
                if getattr(rec, f) is None:
                    raise RuntimeError(f"stage {self.name!r} reads {f!r}, which no earlier stage wrote")
        t0 = time.perf_counter()
        with torch.inference_mode():  # the engine never needs autograd; in-place edits are safe
            self.run(items)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        for rec, _ in items:
            for f in self.writes:
                if getattr(rec, f) is None:
                    raise RuntimeError(f"stage {self.name!r} declares it writes {f!r} but did not")


_RECORD_FIELDS = {f.name for f in fields(ChunkRecord)}


def check_stage_fields(stage: type[Stage]) -> None:
    unknown = (set(stage.reads) | set(stage.writes)) - _RECORD_FIELDS
    if unknown:
        raise TypeError(f"stage {stage.name!r} names unknown record fields {sorted(unknown)}")
