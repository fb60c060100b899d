"""Prompt text -> text tokens for the DiT's cross-attention.

Byte-level tokenizer: token ids are the UTF-8 bytes (0..255) of the prompt preceded by BOS (256),
truncated to `max_len` tokens (BOS + max_len − 1 bytes), padded with PAD (257) to the batch's
longest prompt. An empty prompt is the single BOS token, so the mask is never all False.
Encoder: byte embedding + learned positions + 2 pre-LN transformer layers (padding keys masked)
+ final LayerNorm; padded positions are zeroed in the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BOS = 256
PAD = 257
VOCAB = 258


@dataclass(frozen=True)
class TextConfig:
    dim: int = 128
    max_len: int = 32
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4

    @classmethod
    def tiny(cls) -> "TextConfig":
        """Test size: 2 layers of width 16, 2 heads, prompts cut at 15 bytes."""
        return cls(dim=16, max_len=16, layers=2, heads=2)

    @classmethod
    def small(cls) -> "TextConfig":
        """Bundled size: 2 layers of width 128 (the DiT's `text_dim`), 4 heads, 31 bytes."""
        return cls(dim=128, max_len=32, heads=4)


def tokenize(prompts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts -> (ids [B, L] long, mask [B, L] bool), L = longest (<= max_len), at least 1."""
    seqs = [[BOS, *p.encode("utf-8")][:max_len] for p in prompts]
    length = max([len(s) for s in seqs], default=1)
    ids = torch.full((len(seqs), length), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = True
    return ids, mask


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, dim], mask [B, L] bool (valid keys) -> [B, L, dim]."""
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)  # each [B, H, L, dh]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TextEncoder(nn.Module):
    """Byte-level text encoder: `encode(prompts) -> (tokens [B, L, dim], mask [B, L] bool)`."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.pos = nn.Parameter(torch.zeros(config.max_len, config.dim))
        self.blocks = nn.ModuleList(_Block(config.dim, config.heads, config.mlp_ratio)
                                    for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        nn.init.normal_(self.pos, std=0.02)

    @property
    def dim(self) -> int:
        return self.config.dim

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, L] long, mask [B, L] bool -> tokens [B, L, dim] (zeros where mask is False)."""
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x, mask)
        return self.norm(x) * mask[..., None].to(x.dtype)

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """prompts (B strings) -> (tokens [B, L, dim], mask [B, L] bool); L <= max_len."""
        if isinstance(prompts, str):
            prompts = [prompts]
        ids, mask = tokenize(list(prompts), self.config.max_len)
        dev = self.embed.weight.device
        ids, mask = ids.to(dev), mask.to(dev)
        return self.forward(ids, mask), mask

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Deterministic random weights (fan-in scaled; random biases and gains, no zero heads)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name == "embed.weight":
                val = torch.randn(p.shape, generator=g)
            elif name == "pos":
                val = 0.1 * torch.randn(p.shape, generator=g)
            elif p.dim() >= 2:
                val = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            elif name.endswith("weight"):  # LayerNorm gains
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                val = 0.02 * torch.randn(p.shape, generator=g)
            p.copy_(val.to(p.dtype))
