"""The reference-conditioned transformer shared by the VideoRef DiT (`models/dit.py`, Avatar V
sec. 2.1, 4.3) and the SR refiner (`models/refiner.py`, sec. 2.4): a Wan-like flow-matching
transformer conditioned on a reference video, text and per-frame audio, plus a motion stream.

Token layout (frame-major). A latent frame `[C, h, w]` is patchified (patch 1x2x2) into
`S = (h/2)(w/2)` tokens; one *motion token* is appended per frame, so every frame holds
`P = S + 1` tokens. Generation: `T` frames -> `N = T*P` tokens. Reference: `R` frames -> `R*P`
tokens (patch tokens + the reference motion token from `extract_motion`).

AdaLN modulation is per latent frame: `sigma [B, T]` -> timestep embedding of `1000 * sigma`
(given frames have sigma = 0; reference frames always use sigma = 0). RoPE is 3-axis
(time, height, width) with float temporal positions (`models/rope.py`). The blocks are in
`models/dit_blocks.py`.

Every forward is the same three public steps; they differ only in the self-attention handed to
the blocks (an `AttentionFn`) and in whether reference frames join the sequence (`prefix`):

    emb = net.embed(x, sigma, cond[, prefix])   # tokens, AdaLN tables, RoPE, text/audio context
    h = net.run_blocks(emb, attend)             # every block, self-attention injected
    out = net.readout(h, emb)                   # head -> DiTOutput

- `forward_sparse`: Sparse Reference Attention. The reference runs once (`encode_reference`:
  sigma = 0 modulation, frame-local self-attention, never sees generation tokens, text or audio)
  and each layer's K/V (RoPE applied) is kept in a `ReferenceCache`; generation queries attend to
  [reference K/V ; own K/V] in one SDPA call (the refiner: only frames within +-window, plus the
  reference).
- `forward_dense`: the plain one-sequence version, [reference ; generation] with an asymmetric
  block mask (equivalence tests, `bench attention`).
- the causal paths of `VideoRefDiT` (`models/dit.py`): one block against a sink and a rolling KV
  cache, and the block-causal mask over a whole sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from avatarstream.cache.reference import ReferenceCache
from avatarstream.models.attention import (dense_attention, frame_local_attention,
                                           local_window_attention, reference_block_mask,
                                           sparse_reference_attention)
from avatarstream.models.dit_blocks import DiTBlock, Head, guidance_features, sinusoidal_embedding
from avatarstream.models.rope import Rope3D

# ---------------------------------------------------------------------------------------------
# config and I/O records


@dataclass(kw_only=True)
class TransformerConfig:
    """Sizes of a `RefTransformer`. Width, depth, heads and FFN width have no default: the
    `tiny()` and `small()` presets of `DiTConfig` and `RefinerConfig` name them."""

    in_channels: int = 16
    dim: int
    depth: int
    heads: int
    ffn_dim: int
    patch: tuple[int, int, int] = (1, 2, 2)
    audio_dim: int = 128
    audio_tokens: int = 6  # 4 video frames per latent frame + a window of 1 frame each side
    text_dim: int = 128
    motion_dim: int = 16
    freq_dim: int = 256
    eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


@dataclass
class DiTCondition:
    """Conditioning of one chunk.

    motion: `[B, T, Dm]` noisy motion tokens (sigma of their frame); audio: `[B, T, A, Da]`;
    text: `[B, L, Dt]`; text_mask: `[B, L]` bool (True = real token) or None; t_pos: `[T]` float
    temporal RoPE positions of the chunk's latent frames; lr: `[B, C, T, h, w]` or None (unused
    by the DiT, kept for the protocol); guidance: `[B, 2]` (audio scale, reference scale) of a
    CFG-distilled DiT, or None for the plain conditional prediction (see `guidance_embedding`);
    anchor: `[B, C, h, w]` the scene frame's clean latent, or None.
    """

    motion: torch.Tensor
    audio: torch.Tensor
    text: torch.Tensor
    text_mask: torch.Tensor | None = None
    t_pos: torch.Tensor | None = None
    lr: torch.Tensor | None = None
    guidance: torch.Tensor | None = None
    anchor: torch.Tensor | None = None


@dataclass
class DiTOutput:
    velocity: torch.Tensor  # [B, C, T, h, w]
    motion_velocity: torch.Tensor | None  # [B, T, Dm]; None from a net without a motion head


@dataclass
class Embedded:
    """One call's inputs as the blocks see them (`RefTransformer.embed`).

    The sequence is `prefix` clean reference frames (dense paths; 0 otherwise) followed by the
    T generation frames, P tokens each; only generation frames see text and audio.
    """

    tokens: torch.Tensor  # [B, prefix + T, P, D]
    e6: torch.Tensor  # [B, prefix + T, 6, D] per-frame AdaLN tables of the blocks
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [(prefix + T) * P, hd/2]
    text: torch.Tensor  # [B, L, D]
    text_mask: torch.Tensor | None  # [B, L] bool
    audio: torch.Tensor  # [B, T, A, D]
    e: torch.Tensor  # [B, T, D] timestep embedding of the generation frames (the heads')
    sigma: torch.Tensor  # [B, T]
    x: torch.Tensor  # [B, Cin, T, h, w] the input the generation tokens were made from
    anchor: torch.Tensor | None  # [B, C, h, w] the condition's scene anchor
    grid: tuple[int, int]  # (h', w') patches per frame
    prefix: int = 0

    @property
    def frames(self) -> int:
        """T, the generation frames."""
        return int(self.tokens.shape[1]) - self.prefix

    @property
    def tokens_per_frame(self) -> int:
        return int(self.tokens.shape[2])


AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""Self-attention of block `layer`: (layer, q, k, v `[B, H, N, hd]`, RoPE applied) -> `[B, H, N, hd]`."""


def masked_attention(mask: torch.Tensor) -> AttentionFn:
    """Dense attention under one mask `[B|1, 1, N, N]` bool in every block."""
    return lambda layer, q, k, v: dense_attention(q, k, v, mask)


# ---------------------------------------------------------------------------------------------
# the backbone


class RefTransformer(nn.Module):
    """Backbone shared by `VideoRefDiT` and `SRRefiner` (see the module docstring).

    patch input channels `in_ch`, output channels `out_ch`; `window=None`: generation tokens
    attend to all generation tokens (+ reference); `window=w`: only to frames within +-w.
    """

    def __init__(self, config: TransformerConfig, in_ch: int, out_ch: int, *,
                 window: int | None = None, motion_head: bool = True) -> None:
        super().__init__()
        self.config = config
        c = config
        d = c.dim
        if d % c.heads or (d // c.heads) % 2:
            raise ValueError("dim must split into heads of even size")
        self.out_ch = out_ch
        self.window = window
        self.patch = tuple(c.patch)
        if self.patch[0] != 1:
            raise ValueError("temporal patch size must be 1 (one token group per latent frame)")
        self.patch_embedding = nn.Conv3d(in_ch, d, kernel_size=self.patch, stride=self.patch)
        self.text_embedding = nn.Sequential(nn.Linear(c.text_dim, d), nn.GELU(approximate="tanh"),
                                            nn.Linear(d, d))
        self.audio_embedding = nn.Sequential(nn.Linear(c.audio_dim, d), nn.GELU(approximate="tanh"),
                                             nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(c.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.motion_embedding = nn.Sequential(nn.Linear(c.motion_dim, d), nn.GELU(approximate="tanh"),
                                              nn.Linear(d, d))
        self.motion_time = nn.Linear(d, d)
        self.motion_extractor = nn.Sequential(nn.LayerNorm(d, eps=c.eps), nn.Linear(d, d), nn.SiLU(),
                                              nn.Linear(d, c.motion_dim))
        self.blocks = nn.ModuleList(DiTBlock(d, c.heads, c.ffn_dim, c.eps) for _ in range(c.depth))
        self.head = Head(d, out_ch * math.prod(self.patch), c.eps)
        self.motion_head = Head(d, c.motion_dim, c.eps) if motion_head else None
        self.rope = Rope3D(c.dim // c.heads, c.rope_theta)

    # -- init ------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> None:
        """Deterministic random weights where every output depends on every input.

        Matrices ~ N(0, 1/fan_in); modulation tables ~ N(0, 0.3^2) (AdaLN gates are never zero);
        norm weights 1 + N(0, 0.1^2); biases N(0, 0.02^2).
        """
        g = torch.Generator().manual_seed(int(seed))
        for name, p in self.named_parameters():
            if name.endswith("modulation"):
                val = 0.3 * torch.randn(p.shape, generator=g)
            elif p.dim() >= 2:
                val = torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel())
            elif "norm" in name and name.endswith("weight"):
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif "motion_extractor.0.weight" in name:
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                val = 0.02 * torch.randn(p.shape, generator=g)
            if name.startswith("anchor_embedding."):
                val = 0.1 * val  # an input trained models start at zero: present, not dominant
            p.copy_(val.to(p.dtype))

    # -- embeddings ------------------------------------------------------------------------------
    def _time(self, sigma: torch.Tensor, guidance: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """sigma `[B, F]` -> e `[B, F, D]`, e6 `[B, F, 6, D]` (timestep of 1000 * sigma), plus the
        guidance scales' embedding `[B, 1, D]` where given (a model that has one)."""
        e = self.time_embedding(sinusoidal_embedding(1000.0 * sigma.float(), self.config.freq_dim))
        embed = getattr(self, "guidance_embedding", None)
        if guidance is not None and embed is not None:
            e = e + embed(guidance_features(guidance, self.config.freq_dim))[:, None]
        e6 = self.time_projection(e).unflatten(-1, (6, self.config.dim))
        return e, e6

    def _patches(self, lat: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """lat `[B, Cin, F, h, w]` -> patch tokens `[B, F, S, D]`, (h', w')."""
        p = self.patch_embedding(lat)  # [B, D, F, h', w']
        hp, wp = p.shape[-2:]
        return p.flatten(3).permute(0, 2, 3, 1), int(hp), int(wp)

    def _motion_tokens(self, motion: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """motion `[B, F, Dm]` + frame timestep embedding e `[B|1, F|1, D]` -> `[B, F, D]`."""
        return self.motion_embedding(motion) + self.motion_time(e)

    def _ref_input(self, lat: torch.Tensor) -> torch.Tensor:
        """Reference latents `[B, C, R, h, w]` -> patch-embedding input (identity for the DiT)."""
        return lat

    def _ref_tokens(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Reference latents -> tokens `[B, R, P, D]`, motion `[B, R, Dm]`, (h', w')."""
        patches, hp, wp = self._patches(self._ref_input(lat))
        motion = self.motion_extractor(patches.mean(dim=2))  # [B, R, Dm]
        e0, _ = self._time(torch.zeros(1, 1, device=lat.device))
        mt = self._motion_tokens(motion, e0)  # [B, R, D]
        return torch.cat([patches, mt[:, :, None].to(patches.dtype)], dim=2), motion, hp, wp

    def extract_motion(self, ref_latents: torch.Tensor) -> torch.Tensor:
        """Reference motion tokens `[B, R, Dm]` from reference latents `[B, C, R, h, w]`
        (mean of each frame's patch tokens through a small MLP)."""
        patches, _, _ = self._patches(self._ref_input(ref_latents))
        return self.motion_extractor(patches.mean(dim=2))

    @staticmethod
    def _sigma(sigma: torch.Tensor | float, b: int, t: int, device: torch.device) -> torch.Tensor:
        s = torch.as_tensor(sigma, dtype=torch.float32, device=device)
        if s.dim() == 1 and s.shape[0] == b and b != t:
            s = s[:, None]
        return s.expand(b, t) if s.dim() < 2 else s

    def _unpatchify(self, y: torch.Tensor, hp: int, wp: int) -> torch.Tensor:
        """y `[B, T, S, ph*pw*C]` -> `[B, C, T, hp*ph, wp*pw]`."""
        b, t = y.shape[:2]
        _, ph, pw = self.patch
        y = y.reshape(b, t, hp, wp, ph, pw, self.out_ch)
        return y.permute(0, 6, 1, 2, 4, 3, 5).reshape(b, self.out_ch, t, hp * ph, wp * pw)

    # -- the three steps -------------------------------------------------------------------------
    def embed(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: DiTCondition,
              prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> Embedded:
        """x `[B, Cin, T, h, w]`, sigma `[B, T]`, `[B]` or a float -> the blocks' inputs.

        Generation tokens: patches (+ the scene anchor's embedding on every frame, where the
        model has an anchor input and `cond` one) and a motion token per frame. `prefix`:
        (latents `[B|1, C, R, h, w]`, t_pos `[R]`) of clean reference frames that run ahead of
        the generation frames in the same sequence (the dense paths), with sigma = 0 modulation.
        """
        b, _, t = x.shape[:3]
        sigma = self._sigma(sigma, b, t, x.device)
        e, e6 = self._time(sigma, cond.guidance)
        patches, hp, wp = self._patches(x)
        embed = getattr(self, "anchor_embedding", None)
        if embed is not None and cond.anchor is not None:
            a = embed(cond.anchor.to(x.dtype).unsqueeze(2))  # [B, D, 1, h', w']
            patches = patches + a.flatten(3).permute(0, 2, 3, 1).to(patches.dtype)
        mt = self._motion_tokens(cond.motion, e)
        tokens = torch.cat([patches, mt[:, :, None].to(patches.dtype)], dim=2)  # [B, T, P, D]
        t_pos = (cond.t_pos if cond.t_pos is not None else torch.arange(t, dtype=torch.float32)).float()
        r = 0
        if prefix:
            refs = [self._ref_tokens(lat)[0] for lat, _ in prefix]  # [B|1, R_c, P, D] each
            refs = [tok.expand(b, *tok.shape[1:]) for tok in refs]
            r = sum(int(tok.shape[1]) for tok in refs)
            tokens = torch.cat([*refs, tokens.to(refs[0].dtype)], dim=1)  # [B, R + T, P, D]
            _, e06 = self._time(torch.zeros(1, 1, device=x.device))
            e6 = torch.cat([e06.expand(b, r, *e06.shape[2:]), e6], dim=1)  # [B, R + T, 6, D]
            t_pos = torch.cat([*(torch.as_tensor(p, dtype=torch.float32).reshape(-1).cpu() for _, p in prefix),
                               t_pos.cpu()])
        return Embedded(tokens=tokens, e6=e6, rope=self.rope(t_pos, hp, wp, extra_tokens=1),
                        text=self.text_embedding(cond.text), text_mask=cond.text_mask,
                        audio=self.audio_embedding(cond.audio), e=e, sigma=sigma, x=x,
                        anchor=cond.anchor, grid=(hp, wp), prefix=r)

    def run_blocks(self, emb: Embedded, attend: AttentionFn) -> torch.Tensor:
        """Every block over `emb.tokens`, block i's self-attention `attend(i, q, k, v)`; prefix
        frames skip the text and audio cross-attention. Returns `[B, prefix + T, P, D]`."""
        h, r = emb.tokens, emb.prefix
        cos, sin = emb.rope
        for i, blk in enumerate(self.blocks):
            m = blk.mods(emb.e6)
            q, k, v = blk.attn_in(h, m, cos, sin)
            h = blk.attn_out(h, attend(i, q, k, v), m)
            if r:
                h = torch.cat([h[:, :r], blk.cross(h[:, r:], emb.text, emb.text_mask, emb.audio)], dim=1)
            else:
                h = blk.cross(h, emb.text, emb.text_mask, emb.audio)
            h = blk.ffn_out(h, m)
        return h

    def readout(self, h: torch.Tensor, emb: Embedded) -> DiTOutput:
        """The generation frames of h `[B, prefix + T, P, D]` through the heads: velocity
        `[B, out, T, h, w]` and motion velocity `[B, T, Dm]` (None without a motion head)."""
        h = h[:, emb.prefix:]
        hp, wp = emb.grid
        s = hp * wp
        vel = self._unpatchify(self.head(h[:, :, :s], emb.e), hp, wp)
        mv = self.motion_head(h[:, :, s], emb.e) if self.motion_head is not None else None
        return DiTOutput(velocity=vel, motion_velocity=mv)

    # -- the reference ---------------------------------------------------------------------------
    def encode_reference(self, lat: torch.Tensor, valid: torch.Tensor | None,
                         t_pos: torch.Tensor) -> ReferenceCache:
        """lat `[B, C, R, h, w]` clean reference latents, valid `[B, R]` bool or None, t_pos `[R]`.

        Frames invalid for every batch element are dropped before any compute; frames invalid
        for only some elements are kept and masked as keys. Runs the reference tokens through
        every layer with sigma = 0 modulation and frame-local self-attention; stores each layer's
        K/V `[B, H, R*P, hd]` (RoPE applied at t_pos). The last layer only needs its K/V.
        """
        b = lat.shape[0]
        t_pos = torch.as_tensor(t_pos, dtype=torch.float32).reshape(-1)
        key_valid = None
        if valid is not None:
            valid = valid.to(torch.bool).reshape(b, -1)
            keep = valid.any(dim=0)
            if not bool(keep.all()):
                idx = keep.nonzero().flatten()
                lat = lat.index_select(2, idx.to(lat.device))
                valid, t_pos = valid[:, keep], t_pos[keep.to(t_pos.device)]
            key_valid = None if bool(valid.all()) else valid
        c = self.config
        hd = c.dim // c.heads
        r = lat.shape[2]
        if r == 0:
            z = torch.zeros(b, c.heads, 0, hd, device=lat.device)
            p = (lat.shape[-2] // self.patch[1]) * (lat.shape[-1] // self.patch[2]) + 1
            return ReferenceCache([z] * c.depth, [z] * c.depth,
                                  torch.zeros(b, 0, c.motion_dim, device=lat.device), t_pos, p, None)
        x, motion, hp, wp = self._ref_tokens(lat)  # [B, R, P, D]
        p = x.shape[2]
        _, e6 = self._time(torch.zeros(1, 1, device=lat.device))  # [1, 1, 6, D]
        cos, sin = self.rope(t_pos, hp, wp, extra_tokens=1)
        ks, vs = [], []
        for i, blk in enumerate(self.blocks):
            m = blk.mods(e6)
            q, k, v = blk.attn_in(x, m, cos, sin)
            ks.append(k)
            vs.append(v)
            if i == len(self.blocks) - 1:
                break  # the last layer's reference outputs are never read
            o = frame_local_attention(q, k, v, r)
            x = blk.ffn_out(blk.attn_out(x, o, m), m)
        return ReferenceCache(ks, vs, motion, t_pos.to(lat.device), p, key_valid)

    def reference_attention(self, ref: ReferenceCache | None, batch: int, frames: int) -> AttentionFn:
        """Generation self-attention over [`ref`'s cached K/V of the block ; own K/V]: all `frames`
        generation frames (sparse reference attention), or with `window` only those within
        +-window (the refiner's local window)."""
        if ref is not None:
            ref = ref.expand(batch)
        rmask = ref.token_valid() if ref is not None else None

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            rk = ref.k[i] if ref is not None else None
            rv = ref.v[i] if ref is not None else None
            if self.window is None:
                return sparse_reference_attention(q, k, v, rk, rv, rmask)
            return local_window_attention(q, k, v, frames, self.window, rk, rv, rmask)

        return attend

    # -- forwards --------------------------------------------------------------------------------
    def forward_sparse(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: DiTCondition,
                       ref: ReferenceCache | None) -> DiTOutput:
        """x `[B, Cin, T, h, w]` against a cached reference (or none)."""
        emb = self.embed(x, sigma, cond)
        return self.readout(self.run_blocks(emb, self.reference_attention(ref, x.shape[0], emb.frames)), emb)

    def forward_dense(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: DiTCondition,
                      ref_latents: torch.Tensor, valid: torch.Tensor | None,
                      ref_t_pos: torch.Tensor) -> DiTOutput:
        """One sequence [ref ; gen] per layer with the asymmetric block mask, sigma = 0 for the
        reference frames, which are computed even where invalid and masked as keys."""
        b, r = x.shape[0], ref_latents.shape[2]
        if valid is None:
            valid = torch.ones(b, r, dtype=torch.bool, device=x.device)
        valid = valid.to(torch.bool).reshape(b, r)
        emb = self.embed(x, sigma, cond, [(ref_latents, ref_t_pos)])
        mask = reference_block_mask(valid, emb.tokens_per_frame, emb.frames, self.window)
        return self.readout(self.run_blocks(emb, masked_attention(mask)), emb)
