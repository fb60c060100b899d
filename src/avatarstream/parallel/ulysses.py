"""Sequence parallelism, DeepSpeed-Ulysses style: the token sequence is sharded over W ranks;
each attention call turns [sequence shard, all heads] into [full sequence, head shard] with one
all-to-all, runs the model's own attention on its heads, and turns the result back.

    rank r holds tokens [r n, (r + 1) n)  (n = ceil(N / W), the last shard padded)
    q, k, v [B, H, n, hd]  --all_to_all-->  [B, H / W, N, hd]   (pad stripped)
    o = attention(q, k, v)                  [B, H / W, N, hd]   any pattern: masks, sinks, caches
    o       [B, H / W, N, hd]  --all_to_all-->  [B, H, n, hd]

Everything outside attention (norms, projections, FFN, per-token modulation) is token-local and
runs on the shard; attention sees whole sequences of a subset of heads, so any attention function
works unchanged, and a KV cache written inside it holds this rank's heads only (a rolling cache
is sharded by heads for free). Needs `heads % W == 0`; costs two all-to-alls per layer (q, k, v
travel in one) of 4 N D / W elements per rank instead of W-fold attention and MLP work.

Why our own and not a library:
- **yunchang** (the Ulysses/ring library of xDiT; Apache-2.0, a 55 kB pure-Python wheel that needs
  only torch>=2.3, so it would install offline without pulling another torch; not installed here):
  its `UlyssesAttention` layer owns the attention kernel it calls (flash-attn or plain SDPA,
  [B, S, H, D] layout, no key masks, no KV cache or sink), so we would use only its all-to-all,
  about thirty lines; not worth a dependency.
- **torch's context parallelism** (`torch.distributed.tensor.experimental.context_parallel`):
  ring attention over DTensor that intercepts the CUDA SDPA kernels (flash, efficient, cuDNN) and
  refuses an attention mask ("attn_bias is not supported yet"); our causal blocks attend to a sink
  with a key mask plus a rolling cache of another length than the queries, and CPU/gloo (where
  the equivalence tests run) has none of those kernels.
- `torch.distributed.all_to_all_single` works on gloo (CPU) as on NCCL (checked on torch 2.13),
  so the same code is tested on CPU processes and runs on GPUs.

The functions here are generic (any model whose attention is a function of q, k, v);
`parallel/sequence.py` applies them to our DiT's causal forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from avatarstream.errors import ConfigError


@dataclass(frozen=True)
class SPGroup:
    """The ranks one sequence is sharded over (`group` None: the default process group)."""

    rank: int
    world: int
    group: Any = None

    @classmethod
    def default(cls, group: Any = None) -> "SPGroup":
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def shard_len(self, tokens: int) -> int:
        """n: tokens per rank (the sequence padded to a multiple of the world size)."""
        return math.ceil(tokens / self.world)

    def token_index(self, tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """`[n]` indices of this rank's tokens; padding repeats the last token (computed,
        never attended to, dropped by `gather_sequence`)."""
        n = self.shard_len(tokens)
        return torch.arange(self.rank * n, (self.rank + 1) * n, device=device).clamp_max(tokens - 1)

    def check_heads(self, heads: int) -> None:
        if heads % self.world:
            raise ConfigError(f"sequence parallelism over {self.world} ranks needs a head count "
                              f"divisible by {self.world}; the model has {heads} heads")


def _all_to_all(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """x `[W, ...]`: slice j goes to rank j; returns `[W, ...]`, slice j from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=sp.group)
    return out


def seq_to_heads(x: torch.Tensor, sp: SPGroup, *, seq_dim: int = 2, head_dim: int = 1) -> torch.Tensor:
    """Sequence shard, all heads `[.., H, .., n, ..]` -> this rank's heads over the whole
    (padded) sequence `[.., H / W, .., W n, ..]`."""
    w = sp.world
    y = x.movedim((head_dim, seq_dim), (0, 1))  # [H, n, *rest]
    h, n = y.shape[:2]
    y = _all_to_all(y.reshape(w, h // w, n, *y.shape[2:]), sp)  # [W (sequence shard), H/W, n, *rest]
    y = y.transpose(0, 1).reshape(h // w, w * n, *y.shape[3:])  # [H/W, W n, *rest]
    return y.movedim((0, 1), (head_dim, seq_dim))


def heads_to_seq(x: torch.Tensor, sp: SPGroup, *, seq_dim: int = 2, head_dim: int = 1) -> torch.Tensor:
    """The inverse of `seq_to_heads`: `[.., H / W, .., W n, ..]` -> `[.., H, .., n, ..]`."""
    w = sp.world
    y = x.movedim((head_dim, seq_dim), (0, 1))  # [H/W, W n, *rest]
    hl, wn = y.shape[:2]
    y = y.reshape(hl, w, wn // w, *y.shape[2:]).transpose(0, 1)  # [W (sequence shard), H/W, n, *rest]
    y = _all_to_all(y, sp).reshape(w * hl, wn // w, *y.shape[3:])  # [H, n, *rest] (heads in rank order)
    return y.movedim((0, 1), (head_dim, seq_dim))


def ulysses(attention: Callable[..., torch.Tensor], sp: SPGroup, tokens: int, *,
            seq_dim: int = 2, head_dim: int = 1) -> Callable[..., torch.Tensor]:
    """Sequence-parallel form of `attention(*lead, q, k, v) -> o` (q, k, v the last three
    arguments; `[B, H, N, hd]` by default, other layouts by `seq_dim`/`head_dim`).

    The returned function takes this rank's shards `[B, H, n, hd]` (`SPGroup.token_index`) of a
    sequence of `tokens` real tokens, calls `attention` on this rank's H / W heads of the whole
    sequence (padding stripped: it never sees a pad token), and returns the output's shard
    `[B, H, n, hd]`. One all-to-all for q, k and v together, one for the output.
    """
    w = sp.world

    def attend(*args: Any) -> torch.Tensor:
        *lead, q, k, v = args
        dt = q.dtype
        qkv = torch.stack([q, k.to(dt), v.to(dt)])  # [3, B, H, n, hd]: one all-to-all for the three
        qkv = seq_to_heads(qkv, sp, seq_dim=seq_dim + 1, head_dim=head_dim + 1).narrow(seq_dim + 1, 0, tokens)
        o = attention(*lead, qkv[0], qkv[1].to(k.dtype), qkv[2].to(v.dtype))  # [B, H/W, N, hd]
        pad = sp.shard_len(tokens) * w - tokens
        if pad:
            shape = list(o.shape)
            shape[seq_dim] = pad
            o = torch.cat([o, o.new_zeros(shape)], dim=seq_dim)
        return heads_to_seq(o, sp, seq_dim=seq_dim, head_dim=head_dim)

    return attend


def gather_sequence(x: torch.Tensor, sp: SPGroup, tokens: int, *, dim: int = 1) -> torch.Tensor:
    """Every rank's shard of `dim` (n each) -> the whole sequence of `tokens` on every rank."""
    parts = [torch.empty_like(x) for _ in range(sp.world)]
    dist.all_gather(parts, x.contiguous(), group=sp.group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, tokens)
