"""Continuity schedules: which chunk to generate next, what it is conditioned on, what it publishes.

A schedule never touches tensors. It plans chunks on the output's latent *timeline* (see
`engine.clock`): each `ChunkPlan` says which timeline position every frame of the chunk sits at,
which of its frames are *given* (clean latents copied from an earlier chunk at the same timeline
position: the frame-conditioning mask), which of its frames end up on the timeline (`emit`), which
chunks are published once it is done, and which stored chunks the rolling state may drop.

Strategies:
- `PrefixSchedule` (Avatar V, ref2v then prefix2v): chunk 0 is conditioned on the reference and,
  with `scene`, given the *scene frame* at its frame 0 (the driving first frame of Avatar V's
  I2V setup: by default the reference's first usable frame, `SCENE_CHUNK` in the store); every
  later chunk is given the previous chunk's last `overlap` latents and generates the rest. The
  engine adds a global appearance anchor taken from chunk 0.
- `InterpSchedule` (the N/I scheme of the streaming framework): N chunks are generated from the
  reference alone (with `scene`: each given the scene frame at its frame 0, which only the first
  N chunk emits); an I chunk is generated only after both neighbours exist, given the last frame
  of the previous N chunk and an early frame (index `anchor`) of the next one; it fills the gap
  between them and replaces the next N chunk's frames before the anchor. Order:
  N0 N1 I0 N2 I1 N3 I2 ... The anchors' own predictions in the I chunk are dropped.
- `CausalSchedule` (Live Avatar: block-wise causal generation with a rolling KV cache): the
  timeline is cut into blocks of `block` latents generated in order, each once; the DiT's
  continuity lives in its KV caches (`engine/causal.py`), not in given frames. A block's chunk
  also carries the previous block's last `context` latents as given frames: the SR refiner's
  temporal window reads them as left context; the DiT does not.

The schedule learns the timeline length only when the audio has ended (`total` argument): until
then it plans full-size chunks; the pipeline trims what lies past the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from avatarstream.errors import ConfigError


SCENE_CHUNK = -1  # source_chunk of the scene frame (ChunkStore.set_scene), never released


@dataclass(frozen=True)
class GivenFrame:
    """Frame `index` of this chunk is the clean latent `source_index` of chunk `source_chunk`."""

    index: int
    source_chunk: int
    source_index: int


@dataclass(frozen=True)
class ChunkPlan:
    id: int
    kind: str  # "ref2v" | "prefix2v" | "N" | "I" | "tail"
    positions: tuple[int, ...]  # timeline latent position of each frame of the chunk
    given: tuple[GivenFrame, ...] = ()
    emit: tuple[int, int] = (0, 0)  # frames [start, stop) of this chunk that land on the timeline
    publish: tuple[int, ...] = ()  # chunk ids whose emitted frames are published after this chunk
    keep: tuple[int, ...] = ()  # frames of this chunk later chunks are given (kept in rolling state)
    release: tuple[int, ...] = ()  # chunk ids the rolling state drops after this chunk is published

    @property
    def length(self) -> int:
        return len(self.positions)

    def given_mask(self) -> list[bool]:
        mask = [False] * self.length
        for g in self.given:
            mask[g.index] = True
        return mask

    def emitted_positions(self) -> tuple[int, ...]:
        return self.positions[self.emit[0] : self.emit[1]]


def _require(ok: bool, needs: str, **got: int) -> None:
    """A schedule's check of its sizes: ConfigError saying what it `needs` and the values it got
    (the sizes come from a recipe or the command line, so the message names them)."""
    if not ok:
        values = ", ".join(f"{k}={v}" for k, v in got.items())
        raise ConfigError(f"{needs} (got {values})")


class ContinuitySchedule(Protocol):
    name: str
    uses_appearance_anchor: bool

    def horizon(self) -> int:
        """Timeline positions [0, horizon) the next chunk may cover (audio must reach that far)."""
        ...

    def next_chunk(self, total: int | None) -> ChunkPlan | None:
        """The next chunk, or None when the timeline of `total` latents is complete."""
        ...


@dataclass
class PrefixSchedule:
    """ref2v first chunk, then prefix2v chunks given the previous chunk's last `overlap` latents."""

    chunk: int
    overlap: int = 2
    scene: bool = False
    name: str = "prefix"
    uses_appearance_anchor: bool = True
    _next_id: int = field(default=0, init=False)
    _published: int = field(default=0, init=False)  # timeline positions emitted so far
    _prev: ChunkPlan | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        _require(self.chunk >= 2 and 1 <= self.overlap < self.chunk,
                 "prefix schedule needs chunk >= 2 and 1 <= overlap < chunk",
                 chunk=self.chunk, overlap=self.overlap)

    def horizon(self) -> int:
        if self._prev is None:
            return self.chunk
        return self._published + self.chunk - self.overlap

    def next_chunk(self, total: int | None) -> ChunkPlan | None:
        if total is not None and self._published >= total:
            return None
        cid = self._next_id
        self._next_id += 1
        if self._prev is None:
            length = self.chunk if total is None else min(self.chunk, total)
            plan = ChunkPlan(
                id=cid,
                kind="ref2v",
                positions=tuple(range(length)),
                given=(GivenFrame(0, SCENE_CHUNK, 0),) if self.scene else (),
                emit=(0, length),
                publish=(cid,),
                keep=tuple(range(max(0, length - self.overlap), length)),
            )
        else:
            new = self.chunk - self.overlap
            if total is not None:
                new = min(new, total - self._published)
            o, prev = self.overlap, self._prev
            start = self._published - o
            plan = ChunkPlan(
                id=cid,
                kind="prefix2v",
                positions=tuple(range(start, start + o + new)),
                given=tuple(GivenFrame(i, prev.id, prev.length - o + i) for i in range(o)),
                emit=(o, o + new),
                publish=(cid,),
                keep=tuple(range(new, o + new)),
                release=(prev.id,),
            )
        self._published += plan.emit[1] - plan.emit[0]
        self._prev = plan
        return plan


@dataclass
class InterpSchedule:
    """N chunks from the reference alone, joined by I (interpolation) chunks: N0 N1 I0 N2 I1 ...

    An I chunk spans `gap + anchor + 2` latents: frame 0 is given the last frame of the previous
    N chunk, its last frame is given frame `anchor` of the next N chunk; its interior replaces the
    `gap` positions between the N chunks and the next N chunk's first `anchor` frames.
    """

    chunk: int
    gap: int = 1
    anchor: int = 1
    scene: bool = False
    name: str = "interp"
    uses_appearance_anchor: bool = False
    _next_id: int = field(default=0, init=False)
    _published: int = field(default=0, init=False)
    _last_n: ChunkPlan | None = field(default=None, init=False)  # left neighbour (fully published)
    _pending_n: ChunkPlan | None = field(default=None, init=False)  # right neighbour (not yet)
    _done: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        _require(self.gap >= 0 and self.anchor >= 0 and self.chunk >= self.anchor + 2,
                 "interp schedule needs gap >= 0, anchor >= 0 and chunk >= anchor + 2",
                 chunk=self.chunk, gap=self.gap, anchor=self.anchor)

    def horizon(self) -> int:
        if self._last_n is None:
            return self.chunk
        if self._pending_n is not None:
            return self._pending_n.positions[-1] + 1
        return self._published + self.gap + self.chunk

    def _scene(self) -> tuple[GivenFrame, ...]:
        return (GivenFrame(0, SCENE_CHUNK, 0),) if self.scene else ()

    def _new_id(self) -> int:
        cid = self._next_id
        self._next_id += 1
        return cid

    def next_chunk(self, total: int | None) -> ChunkPlan | None:
        if self._done or (total is not None and self._published >= total):
            return None
        if self._last_n is None:
            length = self.chunk if total is None else min(self.chunk, total)
            cid = self._new_id()
            plan = ChunkPlan(cid, "N", tuple(range(length)), given=self._scene(), emit=(0, length),
                             publish=(cid,), keep=(length - 1,))
            self._last_n = plan
            self._published = length
            return plan
        left = self._last_n
        if self._pending_n is None:
            p = self._published
            remaining = None if total is None else total - p
            if remaining is not None and remaining < self.gap + self.anchor + 1:
                # Tail: too little left for another N chunk: continue from the last N frame.
                cid = self._new_id()
                plan = ChunkPlan(
                    cid, "tail", tuple(range(p - 1, p + remaining)),
                    given=(GivenFrame(0, left.id, left.length - 1),),
                    emit=(1, 1 + remaining), publish=(cid,), release=(left.id, cid),
                )
                self._published += remaining
                self._done = True
                return plan
            length = self.chunk if remaining is None else min(self.chunk, remaining - self.gap)
            start = p + self.gap
            cid = self._new_id()
            plan = ChunkPlan(cid, "N", tuple(range(start, start + length)), given=self._scene(),
                             emit=(self.anchor, length),
                             keep=tuple(range(self.anchor, length)))
            self._pending_n = plan
            return plan
        right = self._pending_n
        p, inner = self._published, self.gap + self.anchor
        cid = self._new_id()
        plan = ChunkPlan(
            cid, "I", tuple(range(p - 1, p + inner + 1)),
            given=(GivenFrame(0, left.id, left.length - 1),
                   GivenFrame(inner + 1, right.id, self.anchor)),
            emit=(1, 1 + inner),
            publish=(cid, right.id),
            release=(left.id, cid),
        )
        self._published = right.positions[-1] + 1
        self._last_n, self._pending_n = right, None
        return plan


@dataclass
class CausalSchedule:
    """Blocks of `block` latents in timeline order, each generated once (see the module doc)."""

    block: int = 3
    context: int = 1
    name: str = "causal"
    uses_appearance_anchor: bool = False
    _next_id: int = field(default=0, init=False)
    _published: int = field(default=0, init=False)
    _prev: ChunkPlan | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        _require(self.block >= 1 and 0 <= self.context <= self.block,
                 "causal schedule needs block >= 1 and 0 <= context <= block",
                 block=self.block, context=self.context)

    def horizon(self) -> int:
        return self._published + self.block

    def next_chunk(self, total: int | None) -> ChunkPlan | None:
        """Always a whole block (the KV caches hold whole blocks); the pipeline trims the frames
        past the end of the audio."""
        if total is not None and self._published >= total:
            return None
        cid = self._next_id
        self._next_id += 1
        p, b = self._published, self.block
        prev = self._prev
        c = 0 if prev is None else self.context
        plan = ChunkPlan(
            id=cid,
            kind="block",
            positions=tuple(range(p - c, p + b)),
            given=tuple(GivenFrame(i, prev.id, prev.length - c + i) for i in range(c)) if prev else (),
            emit=(c, c + b),
            publish=(cid,),
            keep=tuple(range(c + b - self.context, c + b)),
            release=(prev.id,) if prev else (),
        )
        self._published += b
        self._prev = plan
        return plan


STRATEGIES = ("prefix", "interp", "causal")
