"""ReferenceCache: the attention-level KV cache of the reference (Avatar V sec. 4.3).

Built once per request by `VideoRefDiT.encode_reference` / `SRRefiner.encode_reference` and reused
by every denoising step of every chunk. Holds, per transformer layer, the K/V of the kept
reference tokens (RoPE applied at the reference temporal positions), plus the reference motion
tokens and the reference layout.

Shapes (R = kept reference frames, P = tokens per frame, Nr = R * P):
- k[l], v[l]: `[B, heads, Nr, hd]` per layer l
- motion: `[B, R, Dm]` reference motion tokens (`extract_motion`)
- t_pos: `[R]` float temporal RoPE positions
- key_valid: `[B, R]` bool, or None when every kept frame is valid for every batch element
  (frames invalid for the whole batch are dropped before anything is computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReferenceCache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    motion: torch.Tensor
    t_pos: torch.Tensor
    tokens_per_frame: int
    key_valid: torch.Tensor | None = None

    @property
    def num_frames(self) -> int:
        return int(self.t_pos.shape[0])

    @property
    def batch(self) -> int:
        return int(self.motion.shape[0])

    def token_valid(self) -> torch.Tensor | None:
        """[B, Nr] bool key mask, or None (all valid)."""
        if self.key_valid is None:
            return None
        return self.key_valid.repeat_interleave(self.tokens_per_frame, dim=1)

    def expand(self, b: int) -> "ReferenceCache":
        """This cache for a batch of b (a batch of 1 broadcasts, as views; no copy)."""
        if self.batch == b:
            return self
        if self.batch != 1:
            raise ValueError(f"cannot broadcast a reference of batch {self.batch} to {b}")
        ex = lambda x: x.expand(b, *x.shape[1:])  # noqa: E731
        return ReferenceCache([ex(x) for x in self.k], [ex(x) for x in self.v], ex(self.motion),
                              self.t_pos, self.tokens_per_frame,
                              None if self.key_valid is None else ex(self.key_valid))

    def concat(self, other: "ReferenceCache") -> "ReferenceCache":
        """Append other's frames after this cache's frames (e.g. the appearance anchor).

        Because reference tokens only attend within their own frame, this equals encoding the
        concatenated reference with the concatenated t_pos. A batch of 1 broadcasts.
        """
        if len(self.k) != len(other.k) or self.tokens_per_frame != other.tokens_per_frame:
            raise ValueError("reference caches come from different models")
        b = max(self.batch, other.batch)
        a, o = self.expand(b), other.expand(b)
        if a.key_valid is None and o.key_valid is None:
            kv = None
        else:
            av = a.key_valid if a.key_valid is not None else torch.ones(
                b, a.num_frames, dtype=torch.bool, device=a.motion.device)
            ov = o.key_valid if o.key_valid is not None else torch.ones(
                b, o.num_frames, dtype=torch.bool, device=o.motion.device)
            kv = torch.cat([av, ov], dim=1)
        dt = a.k[0].dtype if a.k else torch.float32
        return ReferenceCache(
            k=[torch.cat([x, y.to(dt)], dim=2) for x, y in zip(a.k, o.k)],
            v=[torch.cat([x, y.to(dt)], dim=2) for x, y in zip(a.v, o.v)],
            motion=torch.cat([a.motion, o.motion.to(a.motion.dtype)], dim=1),
            t_pos=torch.cat([a.t_pos, o.t_pos.to(a.t_pos.dtype)]),
            tokens_per_frame=a.tokens_per_frame,
            key_valid=kv,
        )

    @staticmethod
    def stack(caches: "list[ReferenceCache]") -> "ReferenceCache":
        """B caches of batch 1 (one model) -> one cache of batch B, for a batch of sessions.

        Shorter caches (an image vs a video reference, before/after the appearance anchor) are
        padded to the longest with frames marked invalid in `key_valid`, which attention ignores
        exactly. One cache comes back as it is."""
        if len(caches) == 1:
            return caches[0]
        r = max(c.num_frames for c in caches)
        p = caches[0].tokens_per_frame
        if any(c.batch != 1 or c.tokens_per_frame != p for c in caches):
            raise ValueError("ReferenceCache.stack takes caches of batch 1 from one model")
        pad = torch.nn.functional.pad

        def cat(xs: list[torch.Tensor], frames: list[int]) -> torch.Tensor:  # [1, H, n*P, hd] each
            return torch.cat([pad(x, (0, 0, 0, (r - n) * p)) for x, n in zip(xs, frames)], 0)

        n = [c.num_frames for c in caches]
        valid = torch.cat([pad(torch.ones(1, c.num_frames, dtype=torch.bool) if c.key_valid is None
                               else c.key_valid.to(torch.bool).cpu(), (0, r - c.num_frames), value=False)
                           for c in caches], 0)  # [B, r]
        longest = max(caches, key=lambda c: c.num_frames)
        return ReferenceCache(
            k=[cat([c.k[i] for c in caches], n) for i in range(len(caches[0].k))],
            v=[cat([c.v[i] for c in caches], n) for i in range(len(caches[0].v))],
            motion=torch.cat([pad(c.motion, (0, 0, 0, r - c.num_frames)) for c in caches], 0),
            t_pos=longest.t_pos, tokens_per_frame=p,
            key_valid=None if bool(valid.all()) else valid.to(caches[0].k[0].device))

    def nbytes(self) -> int:
        n = sum(x.numel() * x.element_size() for x in (*self.k, *self.v))
        n += self.motion.numel() * self.motion.element_size()
        n += self.t_pos.numel() * self.t_pos.element_size()
        if self.key_valid is not None:
            n += self.key_valid.numel() * self.key_valid.element_size()
        return int(n)

    def to(self, device: torch.device | str) -> "ReferenceCache":
        return ReferenceCache([x.to(device) for x in self.k], [x.to(device) for x in self.v],
                              self.motion.to(device), self.t_pos.to(device), self.tokens_per_frame,
                              None if self.key_valid is None else self.key_valid.to(device))
