"""SinkCache: the attention sink of causal streaming, cached once (Live Avatar sec. 4.4).

The sink is a `ReferenceCache` (per-layer K/V of the sink frames, RoPE applied at `position`):
first the reference, and, with the Adaptive Attention Sink, the model's own first generated frame
once it exists (`replace`). Its keys are computed once; moving the sink in time (Rolling RoPE) is
a rotation of the cached keys (`models.rope.shift_time`), always taken from the keys as encoded
(never from an already moved copy), so rounding does not accumulate over hours of blocks.

`at(position)` returns the sink as a `ReferenceCache` placed at `position`; the last placement is
memoised (every denoising step of a block asks for the same one).

It lives in `models/`, not `cache/`: placing the sink is RoPE arithmetic of the model, and
`cache/` holds plain containers that models fill (models import cache, never the reverse).
"""

from __future__ import annotations

import torch

from avatarstream.cache.reference import ReferenceCache
from avatarstream.models.rope import shift_time


class SinkCache:
    def __init__(self, ref: ReferenceCache, position: float, *, head_dim: int,
                 theta: float = 10000.0) -> None:
        self.head_dim, self.theta = head_dim, theta
        self.replaced = False
        self._set(ref, position)

    def _set(self, ref: ReferenceCache, position: float) -> None:
        self.base = ref
        self.base_position = float(position)
        self._placed: tuple[float, ReferenceCache] | None = None

    def replace(self, ref: ReferenceCache, position: float) -> None:
        """Adaptive Attention Sink: a new sink (encoded at `position`) replaces the old one."""
        self._set(ref, position)
        self.replaced = True

    @property
    def frames(self) -> int:
        return self.base.num_frames

    def at(self, position: float) -> ReferenceCache:
        """The sink with its keys moved from `base_position` to `position` (`[B, H, Nr, hd]` each)."""
        position = float(position)
        if position == self.base_position:
            return self.base
        if self._placed is not None and self._placed[0] == position:
            return self._placed[1]
        delta = position - self.base_position
        b = self.base
        k = [shift_time(x, delta, self.head_dim, self.theta) for x in b.k]
        placed = ReferenceCache(k, b.v, b.motion, torch.full_like(b.t_pos, position),
                                b.tokens_per_frame, b.key_valid)
        self._placed = (position, placed)
        return placed

    def nbytes(self) -> int:
        """Bytes of the encoded sink and of its current placement (both bounded by the sink size)."""
        n = self.base.nbytes()
        if self._placed is not None:
            n += sum(x.numel() * x.element_size() for x in self._placed[1].k)
        return n
