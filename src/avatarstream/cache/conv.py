"""ConvCache: the streaming state of a causal video VAE (one direction: encode *or* decode).

A causal 3D convolution with temporal kernel `k` needs, to process the next chunk exactly as it
would inside the whole sequence, the last `k - 1` frames of its *input* stream (before the chunk
starts: `k - 1` zero frames, the zero left padding of the whole-sequence computation). A temporal
downsampler (kernel 3, stride 2, first frame alone) needs the last frame it has seen. Each such
layer keeps one tensor here under its module name (`decoder.up_blocks.0.resnets.0.conv1`, ...):

    frames[name]: [B, C, k - 1, h, w]   (or [B, C, 1, h, w] for a temporal downsampler)

A layer whose entry is missing is at the start of the stream: that is the first-chunk flag the
temporal resamplers read (the first frame of a stream passes through them alone).

The size is bounded: every entry is replaced (never appended to) on each chunk, so after the first
chunk `nbytes()` no longer changes with the number of chunks processed. Entries are stored as
copies, never as views into a chunk's activations, so a chunk's activations are freed when the
chunk is done.

One cache serves one direction of one stream: `direction` is fixed by the first call that uses
it ("encode" or "decode") and using it for the other direction raises, because encoder and
decoder layers have different names and states and mixing them would silently corrupt neither
or both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DIRECTIONS = ("encode", "decode")


class ConvCache:
    """Per-layer temporal state of a streaming causal VAE pass (see the module docstring)."""

    def __init__(self, direction: str | None = None) -> None:
        if direction is not None and direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        self.direction = direction
        self.frames: dict[str, torch.Tensor] = {}
        self.chunks = 0  # decode/encode calls so far (a VAE backend waits for the steady state)

    # -- direction -------------------------------------------------------------------------------
    def bind(self, direction: str) -> None:
        """Fix the direction on first use; raise if the cache already serves the other one."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if self.direction is None:
            self.direction = direction
        elif self.direction != direction:
            raise ValueError(f"this ConvCache holds {self.direction} state; use a separate "
                             f"cache (vae.new_cache()) to {direction}")

    # -- state -----------------------------------------------------------------------------------
    def get(self, key: str) -> torch.Tensor | None:
        """The stored frames of layer `key` ([B, C, n, h, w]) or None at the start of the stream."""
        return self.frames.get(key)

    def has(self, key: str) -> bool:
        return key in self.frames

    def put(self, key: str, frames: torch.Tensor) -> None:
        """Store `frames` [B, C, n, h, w] for layer `key`, as a compact copy (never a view that
        would keep a whole chunk's activation alive)."""
        self.frames[key] = frames.detach().clone(memory_format=torch.contiguous_format)

    def reset(self) -> None:
        """Back to the start of a stream (keeps the direction)."""
        self.frames.clear()
        self.chunks = 0

    def layout(self) -> tuple:
        """What must match for caches to decode as one batch: each layer's frame shape."""
        return tuple(sorted((k, tuple(v.shape[1:])) for k, v in self.frames.items()))

    @staticmethod
    def stack(caches: "list[ConvCache]", keys: Callable[[str], bool] | None = None) -> "ConvCache":
        """B caches of batch 1 with one `layout` -> one cache of batch B (one cache: itself).
        keys: only the layers it accepts (a pipelined decode's front or back part: the two parts
        of a chunk hold disjoint layers, each stacked and split by the thread that runs it)."""
        if len(caches) == 1:
            return caches[0]
        out = ConvCache(caches[0].direction)
        out.chunks = min(c.chunks for c in caches)
        for key in list(caches[0].frames):
            if keys is None or keys(key):
                out.frames[key] = torch.cat([c.frames[key] for c in caches], 0)
        return out

    @staticmethod
    def split(stacked: "ConvCache", caches: "list[ConvCache]", keys: Callable[[str], bool] | None = None,
              *, count: bool = True) -> None:
        """Hand a stacked cache's state back to the B caches it was stacked from, after a chunk
        (one cache: it was its own stack, nothing to do). keys: as `stack`'s; count: also hand
        back the number of calls (the part of a pipelined decode that finishes a chunk)."""
        if len(caches) == 1 and caches[0] is stacked:
            return
        for i, c in enumerate(caches):
            for key, val in list(stacked.frames.items()):
                if keys is None or keys(key):
                    c.frames[key] = val[i : i + 1].clone()
            c.bind(stacked.direction or "decode")
            if count:
                c.chunks = stacked.chunks  # the calls made on the stack (a chunk can be two)

    def nbytes(self) -> int:
        """Bytes held by the cached frames (bounded: constant once every layer has seen a chunk)."""
        # list(): a snapshot, taken under the GIL, so a decode thread may add layers meanwhile
        return sum(t.numel() * t.element_size() for t in list(self.frames.values()))

    def __len__(self) -> int:
        return len(self.frames)

    def __repr__(self) -> str:
        return (f"ConvCache(direction={self.direction!r}, layers={len(self.frames)}, "
                f"chunks={self.chunks}, nbytes={self.nbytes()})")
