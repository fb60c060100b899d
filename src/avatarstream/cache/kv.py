"""RollingKVCache: the rolling attention history of a block-causal DiT (Live Avatar sec. 4.1, 4.3).

Generation runs in *blocks* of a few latent frames. While block i is denoised at step j it attends
to the K/V of the previous `capacity` blocks computed *at the same step j* (timestep forcing: the
history has the noise level of the block being denoised), so there is one cache per denoising
step. Keys carry RoPE at their own timeline positions; attention scores depend only on position
differences, so nothing in the cache is ever re-rotated.

Storage is a ring of `capacity` slots per layer, allocated in full on the first `append`:

    k[l], v[l]: [B, heads, capacity * Pb, hd]   (Pb = tokens of one block)

Block b lives in slot `b % capacity`; `append` overwrites the oldest block once the ring is full.
Attention over keys does not depend on their order, so `layer(l)` returns the filled slots as
they lie (no copy, no roll). `nbytes()` is constant from the first append on: memory does not
grow with the number of blocks generated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockKV:
    """Per-layer self-attention K/V of one block: k[l], v[l] `[B, heads, Pb, hd]` (RoPE on k)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return int(self.k[0].shape[2])

    def detach(self) -> "BlockKV":
        return BlockKV([x.detach() for x in self.k], [x.detach() for x in self.v])


class RollingKVCache:
    """K/V of the last `capacity` blocks, per layer, for one denoising step (see module doc)."""

    def __init__(self, layers: int, capacity: int) -> None:
        if layers < 1 or capacity < 0:
            raise ValueError(f"need layers >= 1 and capacity >= 0, got {layers}, {capacity}")
        self.layers, self.capacity = layers, capacity
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._positions: list[int] = []  # timeline position of each slot's first frame
        self._block_tokens = 0
        self.appended = 0  # blocks appended since the last reset

    # -- reading -----------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Blocks currently in the cache (<= capacity)."""
        return min(self.appended, self.capacity)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K, V `[B, heads, held * Pb, hd]` of layer i (slot order), or None when empty."""
        if self.held == 0:
            return None
        n = self.held * self._block_tokens
        return self.k[i][:, :, :n], self.v[i][:, :, :n]

    def window_start(self) -> int | None:
        """Timeline position of the oldest block held (where the attention window starts)."""
        return min(self._positions[: self.held]) if self.held else None

    # -- writing -----------------------------------------------------------------------------------
    def append(self, kv: BlockKV, position: int) -> None:
        """Store block `kv` (first frame at timeline `position`), evicting the oldest when full."""
        if len(kv.k) != self.layers:
            raise ValueError(f"block has {len(kv.k)} layers, cache {self.layers}")
        if self.capacity == 0:
            self.appended += 1
            return
        pb = kv.tokens
        if not self.k:
            b, h, _, d = kv.k[0].shape
            size = (b, h, self.capacity * pb, d)
            dev = kv.k[0].device
            self.k = [torch.empty(size, dtype=x.dtype, device=dev) for x in kv.k]
            self.v = [torch.empty(size, dtype=x.dtype, device=dev) for x in kv.v]
            self._positions = [0] * self.capacity
            self._block_tokens = pb
        elif pb != self._block_tokens:
            raise ValueError(f"blocks must all have {self._block_tokens} tokens, got {pb}")
        slot = self.appended % self.capacity
        lo, hi = slot * pb, (slot + 1) * pb
        with torch.no_grad():
            for i in range(self.layers):
                self.k[i][:, :, lo:hi].copy_(kv.k[i])
                self.v[i][:, :, lo:hi].copy_(kv.v[i])
        self._positions[slot] = int(position)
        self.appended += 1

    def reset(self) -> None:
        """Empty (keeps the allocated buffers: a new stream of the same shape reuses them)."""
        self.appended = 0

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (*self.k, *self.v))

    def __repr__(self) -> str:
        return (f"RollingKVCache(layers={self.layers}, capacity={self.capacity}, held={self.held}, "
                f"nbytes={self.nbytes()})")
