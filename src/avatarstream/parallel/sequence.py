"""Sequence parallelism for our DiT's causal streaming (`parallel/ulysses.py` applied to
`VideoRefDiT`): `SequenceParallelDiT` wraps the DiT and answers the calls the causal denoiser
makes (`encode_reference`, `forward_causal_block`, `extract_motion`), so `CausalDenoiser` and the
causal stage run on it unchanged, one rank per shard, all ranks in step.

One block forward on rank r of W:

    emb = net.embed(x, sigma, cond)        every rank, the whole block (patch/time/audio embeddings: cheap)
    local = shard_embedded(emb)            this rank's n of the N = T P tokens, one token per "frame"
    h = net.run_blocks(local, attend)      the blocks on n tokens; attend = ulysses(causal attention)
    h = gather_sequence(h)                 [B, N, D] on every rank
    out = net.readout(h, emb)              every rank (the head: cheap)

`shard_embedded` lays the shard out as n frames of one token: the blocks' per-frame pieces
(AdaLN tables, audio cross-attention, RoPE tables) are gathered per token, so the DiT's own
`run_blocks` runs on it untouched (every op outside self-attention is token-local).

Caches are head-sharded, which is what the all-to-all hands the attention anyway: the block's K/V
that `forward_causal_block` returns (and the rolling caches keep) are `[B, H / W, N, hd]`, and the
sink (`encode_reference`: run whole on every rank, once per sink, then cut to this rank's heads)
too. RoPE rotations of the sink (`SinkCache.at`) are per head, so they work on the shard.

Cost: the embedding and head run on every rank; the blocks, where the FLOPs are, on 1 / W of the
tokens (attention on 1 / W of the heads). The sink encode is not sharded (once per stream, and
with the Adaptive Attention Sink once more).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from avatarstream.cache.kv import BlockKV, RollingKVCache
from avatarstream.cache.reference import ReferenceCache
from avatarstream.models.attention import causal_block_attention
from avatarstream.models.transformer import DiTCondition, DiTOutput, Embedded
from avatarstream.parallel.ulysses import SPGroup, gather_sequence, ulysses


def shard_embedded(emb: Embedded, sp: SPGroup) -> Embedded:
    """This rank's tokens of `emb` (no prefix frames), as n frames of one token each: tokens
    `[B, n, 1, D]`, AdaLN tables `[B, n, 6, D]`, audio `[B, n, A, D]`, RoPE `[n, hd/2]`."""
    if emb.prefix:
        raise ValueError("sequence parallelism shards generation tokens only (no prefix frames)")
    b, t, p, d = emb.tokens.shape
    idx = sp.token_index(t * p, emb.tokens.device)  # [n] token of the block
    frame = idx // p  # [n] its latent frame
    cos, sin = emb.rope
    return replace(emb, tokens=emb.tokens.reshape(b, t * p, d)[:, idx, None],
                   e6=emb.e6.expand(b, *emb.e6.shape[1:])[:, frame], audio=emb.audio[:, frame],
                   rope=(cos[idx.to(cos.device)], sin[idx.to(sin.device)]))


class SequenceParallelDiT(nn.Module):
    """Our DiT, its blocks sharded over the token sequence of `sp` (see the module docstring)."""

    def __init__(self, net: nn.Module, sp: SPGroup) -> None:
        super().__init__()
        sp.check_heads(net.config.heads)
        self.net, self.sp = net, sp
        self.config = net.config

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, H, N, hd]` -> this rank's heads `[B, H / W, N, hd]`, a copy (a view would keep the
        whole tensor alive: every rank would hold the full sink)."""
        h = x.shape[1] // self.sp.world
        return x[:, self.sp.rank * h : (self.sp.rank + 1) * h].clone()

    def encode_reference(self, lat: torch.Tensor, valid: torch.Tensor | None,
                         t_pos: torch.Tensor) -> ReferenceCache:
        """The sink's K/V, this rank's heads (encoded whole: once per sink)."""
        ref = self.net.encode_reference(lat, valid, t_pos)
        return replace(ref, k=[self._heads(k) for k in ref.k], v=[self._heads(v) for v in ref.v])

    def extract_motion(self, ref_latents: torch.Tensor) -> torch.Tensor:
        return self.net.extract_motion(ref_latents)

    def forward_causal_block(self, x: torch.Tensor, sigma: torch.Tensor, cond: DiTCondition,
                             sink: ReferenceCache | None, history: RollingKVCache | None
                             ) -> tuple[DiTOutput, BlockKV]:
        """`VideoRefDiT.forward_causal_block` with the blocks sequence-parallel: same arguments
        (sink and history hold this rank's heads), same output on every rank; the returned K/V
        are this rank's heads `[B, H / W, N, hd]` of the whole block."""
        net = self.net
        emb = net.embed(x, sigma, cond)
        b, t, p, d = emb.tokens.shape
        placed = None if sink is None else sink.expand(b)
        sink_kv = list(zip(placed.k, placed.v)) if placed is not None else [None] * len(net.blocks)
        key_mask = None if placed is None else placed.token_valid()  # [B, Nr] or None
        kv = BlockKV([], [])

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            """Layer i over [sink ; history ; own] K/V, this rank's heads of the whole block."""
            kv.k.append(k)
            kv.v.append(v)
            past = None if history is None else history.layer(i)
            return causal_block_attention(q, k, v, sink_kv[i], key_mask, past)

        h = net.run_blocks(shard_embedded(emb, self.sp), ulysses(attend, self.sp, t * p))  # [B, n, 1, D]
        h = gather_sequence(h[:, :, 0], self.sp, t * p).reshape(b, t, p, d)  # [B, T, P, D]
        return net.readout(h, emb), kv
