"""Sequence parallelism for LiveAvatar's streaming DiT (`parallel/ulysses.py`'s all-to-all applied
to `LiveAvatarDiT`): `SequenceParallelLiveAvatar` answers the calls `LiveAvatarDenoiser` makes
(`text_cache`, `prefill_sink`, `forward_block`, `blocks`), so the denoiser and the LiveAvatar
stages run on it unchanged, one rank per shard, all ranks in step.

One step of one block on rank r of W (P tokens per latent frame, m = ceil(P / W)):

    emb = net.embed_block(x, ...)        every rank, the whole block (patch, time, audio: cheap)
    h = emb.tokens[:, :, r m : (r+1) m]  [B, F, m, D]: this rank's m tokens of *every* frame
    h = net.run_layers(h, ...)           the layers on F m tokens; self-attention through
                                         all-to-all: q, k, v [B, H, F m, hd] -> [B, H/W, F P, hd],
                                         the DiT's own `block_attend` (ring write, [ring ; sink])
                                         on this rank's heads, the output back to [B, H, F m, hd]
    out = gather(net.head(h, emb.e))     the head on the shard; its [B, F, m, 64] outputs gathered
    velocity = net.unpatchify(out)       every rank

Why tokens are sharded within every frame, not frames over ranks: a block is 3 latent frames,
which neither 2 nor 4 ranks divide, and everything outside self-attention is per token with
per-*frame* tables (AdaLN e6 and the head's e, the audio injectors' global token and local
tokens, text cross-attention with no mask): a shard of every frame's tokens keeps the layout
`[B, F, m, D]`, so those tables are used as they are (no per-token copies of e6, which at full size
would be six times the activations) and the layers run untouched. Padding (P not a multiple of W)
repeats a frame's last token: computed, never attended to (stripped before attention), dropped at
the gather; at most W - 1 tokens a frame.

Caches are head-sharded, as the all-to-all hands the attention its heads: each step's `KVRing`
is allocated by its first write at `[B, H / W, frames P, hd]`, and the sink keeps this rank's
heads (`prefill_sink`: run whole on every rank, once per stream and once more when the Adaptive
Attention Sink swaps the reference, then cut to this rank's heads and copied, so the whole one is
freed). The sink's rolling RoPE is per head, so it works on the shard. The text K/V cache stays
whole on every rank (text cross-attention is per token over all heads; it is L x D per layer).

Cost per step: embedding, head and unpatchify on every rank; the layers, where the FLOPs are,
on 1 / W of the tokens, attention on 1 / W of the heads; per layer two all-to-alls (q, k, v in
one) of 4 F P D / W elements and, per step, one all-gather of the head's output (64 channels a
token at full size, not the width 5120).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.models.liveavatar import KVRing, LiveAvatarDiT, TextKV
from avatarstream.models.liveavatar.blocks import LayerAttend
from avatarstream.models.liveavatar.dit import AttentionFn
from avatarstream.models.liveavatar.sink import SinkKV
from avatarstream.parallel.ulysses import SPGroup, heads_to_seq, seq_to_heads


@dataclass(frozen=True)
class FrameShard:
    """This rank's m = ceil(P / W) tokens of each of a block's frames of `per_frame` (P) tokens."""

    sp: SPGroup
    per_frame: int

    @property
    def width(self) -> int:
        """m: tokens of a frame on each rank (the frame padded to W m)."""
        return self.sp.shard_len(self.per_frame)

    def take(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens `[B, F, P, D]` -> this rank's `[B, F, m, D]`."""
        return tokens[:, :, self.sp.token_index(self.per_frame, tokens.device)]

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Shards `[S, B, H, F m, hd]` (S stacked tensors) -> this rank's heads of the whole
        block in frame-major token order `[S, B, H / W, F P, hd]`, padding stripped."""
        s, b, h, fm, hd = x.shape
        w, m = self.sp.world, self.width
        y = seq_to_heads(x, self.sp, seq_dim=3, head_dim=2)  # [S, B, H/W, W F m, hd]: (rank, frame, j)
        y = y.view(s, b, h // w, w, fm // m, m, hd).transpose(3, 4)  # [S, B, H/W, F, W, m, hd]
        y = y.reshape(s, b, h // w, fm // m, w * m, hd)[:, :, :, :, : self.per_frame]
        return y.reshape(s, b, h // w, -1, hd)

    def to_tokens(self, o: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_heads` for one tensor: `[B, H / W, F P, hd]` -> `[B, H, F m, hd]`."""
        b, hl, n, hd = o.shape
        w, m, p = self.sp.world, self.width, self.per_frame
        y = F.pad(o.view(b, hl, n // p, p, hd), (0, 0, 0, w * m - p))  # [B, H/W, F, W m, hd]
        y = y.view(b, hl, n // p, w, m, hd).transpose(2, 3).reshape(b, hl, w * (n // p) * m, hd)
        return heads_to_seq(y, self.sp, seq_dim=2, head_dim=1)

    def attend(self, inner: LayerAttend) -> LayerAttend:
        """A layer's whole-block attention (`LiveAvatarDiT.block_attend(...)(i)`) on shards:
        q, k, v `[B, H, F m, hd]` -> output `[B, H, F m, hd]`."""

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qkv = torch.stack([q, k.to(q.dtype), v.to(q.dtype)])  # one all-to-all for the three
            qkv = self.to_heads(qkv)
            return self.to_tokens(inner(qkv[0], qkv[1].to(k.dtype), qkv[2].to(v.dtype)))

        return run

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's `[B, F, m, C]` -> the whole block `[B, F, P, C]` on every rank."""
        parts = [torch.empty_like(y) for _ in range(self.sp.world)]
        dist.all_gather(parts, y.contiguous(), group=self.sp.group)
        return torch.cat(parts, dim=2)[:, :, : self.per_frame]


class SequenceParallelLiveAvatar(nn.Module):
    """LiveAvatar's DiT, each block's tokens sharded over `sp` (see the module docstring)."""

    def __init__(self, net: LiveAvatarDiT, sp: SPGroup) -> None:
        super().__init__()
        sp.check_heads(net.config.num_heads)
        self.net, self.sp = net, sp
        self.config = net.config

    @property
    def blocks(self) -> nn.ModuleList:
        return self.net.blocks

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, H, S, hd]` -> a copy of this rank's heads `[B, H / W, S, hd]` (not a view: the
        whole tensor is freed)."""
        h = x.shape[1] // self.sp.world
        return x[:, self.sp.rank * h : (self.sp.rank + 1) * h].clone()

    def text_cache(self, context: torch.Tensor) -> TextKV:
        return self.net.text_cache(context)

    def prefill_sink(self, ref_latents: torch.Tensor, motion_latents: torch.Tensor,
                     context: torch.Tensor | TextKV, *, attention: AttentionFn | None = None) -> SinkKV:
        """The sink of `LiveAvatarDiT.prefill_sink`, this rank's heads (prefilled whole)."""
        sink = self.net.prefill_sink(ref_latents, motion_latents, context, attention=attention)
        return replace(sink, k=[self.heads(k) for k in sink.k], v=[self.heads(v) for v in sink.v])

    def forward_block(self, x: torch.Tensor, t: torch.Tensor | float, audio: torch.Tensor,
                      context: torch.Tensor | TextKV, sink: SinkKV, ring: KVRing, frame_start: int,
                      sink_distance: int, *, attention: AttentionFn | None = None,
                      pose: torch.Tensor | None = None) -> torch.Tensor:
        """`LiveAvatarDiT.forward_block` with the layers sequence-parallel: same arguments (sink
        and ring hold this rank's heads; the ring gets the block's K/V of those heads), the same
        velocity `[B, C, F, H, W]` on every rank."""
        net = self.net
        emb = net.embed_block(x, t, audio, frame_start, pose)
        shard = FrameShard(self.sp, emb.tokens.shape[2])
        whole = net.block_attend(emb, sink, ring, frame_start, sink_distance, attention)
        text = context if isinstance(context, TextKV) else net.text_cache(context)
        h = net.run_layers(shard.take(emb.tokens), emb.e6, text, lambda i: shard.attend(whole(i)), emb.audio)
        return net.unpatchify(shard.gather(net.head(h, emb.e)), emb.grid)  # head: [B, F, m, pt·ph·pw·C]


class LiveAvatarFollowStage(Stage):
    """Ranks > 0 after the denoise stage: what `PrimedDecodeStage` does to a session's state,
    without decoding (rank 0 decodes and publishes): the block through the rolling store and the
    frame count (12 a block of 3 latents, 3 fewer for block 0; trimmed to the audio), which is
    where the chunk loop sees the stream end."""

    name = "sp_follow"
    reads = ("lr_latents",)
    writes = ()

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        x = rec.lr_latents  # [1, C, F, h, w]
        start = state.frames_emitted
        n = 4 * x.shape[2] - (3 if start == 0 else 0)  # engine/stages/liveavatar.py: DROP_FRAMES
        if state.total_frames is not None:
            n = max(0, min(n, state.total_frames - start))
        state.frames_emitted = state.frames_published = start + n
        state.store.put(rec.plan, x, torch.zeros(1, x.shape[2], 0), x[:, :, :0])
        state.store.take_emitted(rec.plan.id)


def follower_stages(stages: Sequence[Stage]) -> list[Stage]:
    """A LiveAvatar rank > 0's stages: rank 0's (audio, denoise, decode) with the decode replaced
    by `LiveAvatarFollowStage`."""
    return [*(s for s in stages if s.name != "decode_publish"), LiveAvatarFollowStage()]


def sequence_parallel(net: nn.Module, sp: SPGroup) -> nn.Module:
    """The sequence-parallel wrapper of a DiT: LiveAvatar's or our bundled one's."""
    if isinstance(net, LiveAvatarDiT):
        return SequenceParallelLiveAvatar(net, sp)
    from avatarstream.parallel.sequence import SequenceParallelDiT

    return SequenceParallelDiT(net, sp)
