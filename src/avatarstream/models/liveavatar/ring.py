"""KVRing: the rolling self-attention history of one denoising step (LiveAvatar's per-step cache).

LiveAvatar keeps one ring per Euler step (timestep forcing: block b at step i attends to the
previous blocks' keys made at the same step i). Per layer the ring holds `frames` latent frames of
RoPE'd K and of V:

    k[l], v[l]: [B, heads, frames * P, hd]     (P tokens per latent frame)

A block starting at absolute latent frame `frame_start` is written at frame slot
`frame_start mod frames`, *before* its attention, and the attention reads every filled slot (the
current block included, at most `frames` frames: 4 blocks of 3 in the released setting) followed
by the sink. Slot order is not time order once the ring has wrapped; attention does not care.

Memory is allocated on the first write and never grows: `nbytes()` is constant after it.
"""

from __future__ import annotations

import torch


class KVRing:
    """Ring of `frames` latent frames of K/V for each of `layers` layers (see module doc)."""

    def __init__(self, layers: int, frames: int) -> None:
        if min(layers, frames) < 1:
            raise ValueError(f"a ring needs a layer and a frame at least, got {layers}, {frames}")
        self.layers = layers
        self.frames = frames
        self._filled = [0] * layers  # frames filled per layer (the high-water mark of writes)
        self.tokens_per_frame = 0  # set by the first write
        self.k: list[torch.Tensor] = []  # per layer [B, heads, frames * P, hd], allocated on first write
        self.v: list[torch.Tensor] = []

    def write(self, layer: int, frame_start: int, frames: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a block of `frames` latent frames, k, v `[B, heads, frames * P, hd]` (k RoPE'd),
        at slot `frame_start mod self.frames`."""
        p, rem = divmod(k.shape[2], frames)
        if rem or p == 0:
            raise ValueError(f"{k.shape[2]} tokens are not {frames} whole frames")
        if not self.k:
            size = (k.shape[0], k.shape[1], self.frames * p, k.shape[3])
            self.k = [torch.zeros(size, dtype=k.dtype, device=k.device) for _ in range(self.layers)]
            self.v = [torch.zeros(size, dtype=v.dtype, device=v.device) for _ in range(self.layers)]
            self.tokens_per_frame = p
        elif p != self.tokens_per_frame:
            raise ValueError(f"frames of {p} tokens written to a ring of {self.tokens_per_frame}")
        slot = frame_start % self.frames
        if slot + frames > self.frames:
            raise ValueError(f"a {frames}-frame block at frame {frame_start} straddles the end of a "
                             f"{self.frames}-frame ring (use a ring of whole blocks)")
        lo, hi = slot * p, (slot + frames) * p
        self.k[layer][:, :, lo:hi] = k
        self.v[layer][:, :, lo:hi] = v
        self._filled[layer] = max(self._filled[layer], slot + frames)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `[B, heads, filled * P, hd]` of the filled slots of `layer` (slot order)."""
        n = self._filled[layer] * self.tokens_per_frame
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def filled(self, layer: int = 0) -> int:
        """Latent frames held by `layer`."""
        return self._filled[layer]

    def reset(self) -> None:
        """Forget every block (keeps the buffers: a new stream of the same shape reuses them)."""
        self._filled = [0] * self.layers

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (*self.k, *self.v))

    def __repr__(self) -> str:
        return (f"KVRing(layers={self.layers}, frames={self.frames}, filled={self._filled[0]}, "
                f"nbytes={self.nbytes()})")
