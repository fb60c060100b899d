"""The layers of the reference-conditioned transformer (`models/transformer.py`): the timestep and
guidance sinusoids, self- and cross-attention, the DiT block and the AdaLN head.

Names follow Wan (`blocks.N.self_attn.{q,k,v,o,norm_q,norm_k}`, `blocks.N.cross_attn`,
`blocks.N.audio_attn`, `blocks.N.ffn`, `blocks.N.modulation`, `head`), so state-dict keys read
like Wan's. A block is

    x = x + gate_msa * self_attn(norm1(x) * (1 + scale_msa) + shift_msa)   # attention injected
    x = x + cross_attn(norm3(x), text)                                     # generation tokens only
    x = x + audio_attn(norm_audio(x), audio of the same latent frame)     # T folded into batch
    x = x + gate_ffn * ffn(norm2(x) * (1 + scale_ffn) + shift_ffn)

split into the pieces the forwards compose (`mods`, `attn_in`, `attn_out`, `cross`, `ffn_out`):
the self-attention pattern is not the block's to choose (sparse reference, dense masked, causal
block with a rolling cache), so the block hands out q, k, v and takes the attention's output back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.models.rope import apply_rope


def sinusoidal_embedding(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Wan's 1-D sinusoid: pos `[...]` float -> `[..., dim]` (cos half, sin half), float32."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=pos.device) / half)
    ang = pos.double()[..., None] * freqs
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float()


def guidance_features(guidance: torch.Tensor, dim: int) -> torch.Tensor:
    """CFG scales `[B, 2]` (audio, reference) -> `[B, dim]`: a sinusoid of 100 x each scale."""
    return torch.cat([sinusoidal_embedding(100.0 * guidance[:, i].float(), dim // 2) for i in range(2)], -1)


class Float32RMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32, its weight too: q and k are normalised in float32 (as Wan
    does) while a bf16 model stores this weight in bf16. Handing torch a float32 input with a bf16
    weight gives the same numbers through its slow path and a "Mismatch dtype" warning; casting
    the weight (`dim` values) here keeps the fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), self.normalized_shape, w, self.eps)


class AttentionLayer(nn.Module):
    """q, k, v, o projections with RMSNorm on queries and keys (computed in float32)."""

    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = Float32RMSNorm(dim, eps=eps)
        self.norm_k = Float32RMSNorm(dim, eps=eps)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, N, D]` -> `[B, H, N, hd]`."""
        b, n, d = x.shape
        return x.reshape(b, n, self.heads, d // self.heads).transpose(1, 2)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o `[B, H, N, hd]` -> `[B, N, D]`."""
        b, h, n, hd = o.shape
        return self.o(o.transpose(1, 2).reshape(b, n, h * hd))


class SelfAttention(AttentionLayer):
    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[B, N, D]` -> q, k, v `[B, H, N, hd]` with RoPE (tables `[N, hd/2]`) on q and k."""
        q = self.split(self.norm_q(self.q(x).float()))
        k = self.split(self.norm_k(self.k(x).float()))
        v = self.split(self.v(x))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin).to(v.dtype), v


class CrossAttention(AttentionLayer):
    """Queries from x `[B, N, D]`, keys/values from a context `[B, L, D]` (mask `[B, L]` bool)."""

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        q = self.split(self.norm_q(self.q(x).float()))
        k = self.split(self.norm_k(self.k(ctx).float()))
        v = self.split(self.v(ctx))
        attn_mask, keep = None, None
        if mask is not None and not bool(mask.all()):
            mask = mask.bool()
            any_ = mask.any(dim=1)  # [B] rows with no context token attend to nothing
            if not bool(any_.all()):
                mask = mask | ~any_[:, None]
                keep = any_
            attn_mask = mask[:, None, None, :]
        dt = q.dtype
        o = self.out(F.scaled_dot_product_attention(q, k.to(dt), v.to(dt), attn_mask=attn_mask))
        if keep is not None:
            o = o * keep[:, None, None].to(o.dtype)
        return o


    def one_key(self, ctx: torch.Tensor) -> torch.Tensor:
        """The output for any query when the context is one token ctx `[B, 1, D]` that may be
        attended: a softmax over one key is exactly 1, so every query reads that token's value,
        `[B, 1, D]` (the queries, their norm and the scores are never needed)."""
        return self.o(self.v(ctx))


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn_dim: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.self_attn = SelfAttention(dim, heads, eps)
        self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(dim, heads, eps)
        self.norm_audio = nn.LayerNorm(dim, eps=eps, elementwise_affine=True)
        self.audio_attn = CrossAttention(dim, heads, eps)
        self.norm2 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    # x is `[B, F, P, D]`, e6 `[B|1, F|1, 6, D]` per-frame AdaLN parameters.
    def mods(self, e6: torch.Tensor) -> list[torch.Tensor]:
        """6 tensors `[B, F, 1, D]`: shift/scale/gate (attention), shift/scale/gate (FFN)."""
        return [m.unsqueeze(2) for m in (self.modulation[None] + e6).unbind(2)]

    def attn_in(self, x: torch.Tensor, m: list[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[B, H, F*P, hd]` of the modulated tokens (RoPE tables `[F*P, hd/2]`)."""
        y = self.norm1(x) * (1 + m[1]) + m[0]
        return self.self_attn.qkv(y.flatten(1, 2), cos, sin)

    def attn_out(self, x: torch.Tensor, o: torch.Tensor, m: list[torch.Tensor]) -> torch.Tensor:
        """The gated residual of the attention output o `[B, H, F*P, hd]`."""
        return x + self.self_attn.out(o).view(x.shape) * m[2]

    def cross(self, x: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor | None,
              audio: torch.Tensor) -> torch.Tensor:
        """Text cross-attention over all tokens, audio cross-attention per latent frame.

        x `[B, T, P, D]`, text `[B, L, D]`, audio `[B, T, A, D]`.
        """
        b, t, p, d = x.shape
        if text.shape[1] == 1 and (text_mask is None or bool(text_mask.all())):
            x = x + self.cross_attn.one_key(text)[:, None]  # one text token (our models' prompt)
        else:
            x = x + self.cross_attn(self.norm3(x).reshape(b, t * p, d), text, text_mask).view(b, t, p, d)
        a = audio.shape[2]
        y = self.audio_attn(self.norm_audio(x).reshape(b * t, p, d), audio.reshape(b * t, a, d))
        return x + y.view(b, t, p, d)

    def ffn_out(self, x: torch.Tensor, m: list[torch.Tensor]) -> torch.Tensor:
        return x + self.ffn(self.norm2(x) * (1 + m[4]) + m[3]) * m[5]


class Head(nn.Module):
    """AdaLN-modulated linear projection of patch tokens back to latent patches."""

    def __init__(self, dim: int, out: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.head = nn.Linear(dim, out)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x `[B, T, S, D]` (or `[B, T, D]`), e `[B, T, D]` -> `[..., out]`."""
        mod = self.modulation[None] + e[:, :, None]  # [B, T, 2, D]
        shift, scale = mod[:, :, 0], mod[:, :, 1]
        if x.dim() == 4:
            shift, scale = shift[:, :, None], scale[:, :, None]
        return self.head(self.norm(x) * (1 + scale) + shift)
