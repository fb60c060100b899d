"""The layer of LiveAvatar's DiT and the per-session text K/V cache.

`LiveAvatarBlock` is our `DiTBlock` (the Wan block: self-attention, text cross-attention over
all `text_len` positions, FFN, six AdaLN vectors per latent frame) without its audio branch: the
S2V model adds audio through separate injectors after some layers (`audio.py`). Keys are the
official `blocks.N.*` ones.

The whole layer runs in `forward`, so hooks on a block (offload, FSDP) see all of its work. The
self-attention pattern is the caller's: `forward` hands the layer's q, k, v (before RoPE) to an
`attend(q, k, v) -> out` closure, which rotates them, reads and writes the caches (sink prefill,
KV ring) and calls the attention function (SDPA, or a sequence-parallel one).

Text: `TextKV` holds one session's embedded prompt and, per layer, its cross-attention K/V, made
by the layer the first time it runs and reused by every later forward (the prompt does not change
within a session). Recomputing gives the same numbers: it is the same function of the same input.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from avatarstream.models.dit_blocks import DiTBlock

# q, k, v `[B, heads, N, hd]` (before RoPE) -> attention output `[B, heads, N, hd]`
LayerAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TextLayerKV:
    """One layer's text cross-attention K, V `[B, heads, L, hd]`, filled on first use."""

    def __init__(self, ctx: torch.Tensor) -> None:
        self.ctx = ctx  # [B, L, D] embedded, zero-padded prompt
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None


class TextKV:
    """The text cross-attention K/V of one session, per layer (see module doc)."""

    def __init__(self, ctx: torch.Tensor, layers: int) -> None:
        self.ctx = ctx
        self.layers = [TextLayerKV(ctx) for _ in range(layers)]

    @property
    def filled(self) -> int:
        """Layers whose K/V are computed."""
        return sum(lay.k is not None for lay in self.layers)

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for lay in self.layers for x in (lay.k, lay.v)
                   if x is not None)


class LiveAvatarBlock(DiTBlock):
    """`DiTBlock` without `audio_attn`/`norm_audio`; one whole layer per `forward` call."""

    def __init__(self, dim: int, heads: int, ffn_dim: int, eps: float) -> None:
        super().__init__(dim, heads, ffn_dim, eps)
        del self.norm_audio, self.audio_attn

    def qkv(self, x: torch.Tensor, m: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (RMS-normalised, float32) and v `[B, heads, F*P, hd]` of x `[B, F, P, D]`, no RoPE."""
        a = self.self_attn
        y = (self.norm1(x) * (1 + m[1]) + m[0]).flatten(1, 2)  # [B, F*P, D]
        return a.split(a.norm_q(a.q(y).float())), a.split(a.norm_k(a.k(y).float())), a.split(a.v(y))

    def text(self, x: torch.Tensor, kv: TextLayerKV) -> torch.Tensor:
        """x + cross-attention of norm3(x) `[B, F, P, D]` to the whole (padded) prompt."""
        c = self.cross_attn
        if kv.k is None:
            kv.k = c.split(c.norm_k(c.k(kv.ctx).float()))
            kv.v = c.split(c.v(kv.ctx))
        assert kv.v is not None
        b, f, p, d = x.shape
        q = c.split(c.norm_q(c.q(self.norm3(x).reshape(b, f * p, d)).float()))
        k, v = kv.k, kv.v
        if k.shape[0] != b:  # one prompt for a batch of streams
            k, v = k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype))
        return x + c.out(o).view(b, f, p, d)

    def forward(self, x: torch.Tensor, e6: torch.Tensor, text: TextLayerKV,  # type: ignore[override]
                attend: LayerAttend) -> torch.Tensor:
        """x `[B, F, P, D]`, e6 `[B, F, 6, D]` AdaLN tables per frame -> x after the layer."""
        m = self.mods(e6)
        o = attend(*self.qkv(x, m))
        x = self.attn_out(x, o, m)
        return self.ffn_out(self.text(x, text), m)
