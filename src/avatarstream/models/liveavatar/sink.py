"""LiveAvatar's attention sink: the [reference ; FramePack] tokens' per-layer K/V, and where
their keys sit in time for a given block (the rolling sink RoPE).

The sink is prefilled once per stream (and again when the Adaptive Attention Sink swaps the
reference) by one t = 0 pass of the DiT over those tokens (`LiveAvatarDiT.prefill_sink`). Its keys
are stored **before** RoPE, so each block rotates them to that block's positions:

- reference tokens (`moves`) sit at time max(ref_time, frame_start + d): the reference stays at
  `ref_time` (30) until the stream reaches it, then keeps d latent frames ahead of the block being
  generated (d, the sink distance, is a seeded setting of the stream: the official code draws it
  from an unseeded `random.randint(4, 30)` on every forward);
- FramePack tokens keep their fixed negative times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from avatarstream.models.rope import rope_tables


def reference_time(ref_time: int, frame_start: int, sink_distance: int) -> int:
    """The reference's RoPE time for a block whose first latent frame is `frame_start`."""
    return ref_time + max(0, frame_start - (ref_time - sink_distance))


@dataclass
class SinkKV:
    """Per-layer K (no RoPE) and V of the sink, `k[l]`, `v[l]` `[B, heads, S, hd]`; positions
    `t`, `h`, `w` `[S]` float64 at placement 0 (the reference at `ref_time`); `moves` `[S]` bool:
    True for reference tokens (they follow the rolling rule), False for FramePack tokens."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    t: torch.Tensor
    h: torch.Tensor
    w: torch.Tensor
    moves: torch.Tensor
    ref_time: int

    @property
    def tokens(self) -> int:
        return int(self.t.numel())

    def times(self, frame_start: int, sink_distance: int) -> torch.Tensor:
        """`[S]` float64 times of the sink tokens for the block starting at `frame_start`."""
        shift = reference_time(self.ref_time, frame_start, sink_distance) - self.ref_time
        return self.t + shift * self.moves.to(self.t.dtype)

    def tables(self, frame_start: int, sink_distance: int, head_dim: int, theta: float,
               fp16: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos, sin `[S, hd/2]` of the sink keys for that block."""
        return rope_tables(self.times(frame_start, sink_distance), self.h, self.w, head_dim, theta,
                           fp16=fp16)

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (*self.k, *self.v))
