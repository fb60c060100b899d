"""VideoRef DiT (Avatar V sec. 2.1, 4.3): a Wan-like flow-matching transformer conditioned on a
reference video through Sparse Reference Attention, plus a motion representation stream.

Token layout (frame-major). A latent frame `[C, h, w]` is patchified (patch 1x2x2) into
`S = (h/2)(w/2)` tokens; one *motion token* is appended per frame, so every frame holds
`P = S + 1` tokens. Generation: `T` frames -> `N = T*P` tokens. Reference: `R` frames -> `R*P`
tokens (patch tokens + the reference motion token from `extract_motion`).

Block (names follow Wan: `patch_embedding`, `blocks.N.self_attn.{q,k,v,o,norm_q,norm_k}`,
`blocks.N.cross_attn`, `blocks.N.audio_attn`, `blocks.N.ffn`, `blocks.N.modulation`, `head`):

    x = x + gate_msa * self_attn(norm1(x) * (1 + scale_msa) + shift_msa)   # sparse reference attn
    x = x + cross_attn(norm3(x), text)                                     # generation tokens only
    x = x + audio_attn(norm_audio(x), audio of the same latent frame)     # T folded into batch
    x = x + gate_ffn * ffn(norm2(x) * (1 + scale_ffn) + shift_ffn)

AdaLN modulation is per latent frame: `sigma [B, T]` -> timestep embedding of `1000 * sigma`
(given frames have sigma = 0; reference frames always use sigma = 0). RoPE is 3-axis
(time, height, width) with float temporal positions (`models/rope.py`).

Reference path (`encode_reference`): reference tokens run through every layer with sigma = 0
modulation and frame-local self-attention only (they never see generation tokens, text or audio);
each layer's reference K/V (RoPE applied) is stored in a `ReferenceCache`. The generation path
(`forward`) concatenates those K/V with its own in one SDPA call. `forward_dense` is the plain
one-sequence implementation with an asymmetric block mask (equivalence tests, `bench attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.cache.reference import ReferenceCache
from avatarstream.models.attention import (dense_attention, frame_local_attention,
                                           local_window_attention, reference_block_mask,
                                           sparse_reference_attention)
from avatarstream.models.rope import Rope3D, apply_rope


# ---------------------------------------------------------------------------------------------
# configs and I/O records


@dataclass
class DiTConfig:
    in_channels: int = 16
    dim: int = 384
    depth: int = 8
    heads: int = 6
    ffn_dim: int = 1024
    patch: tuple[int, int, int] = (1, 2, 2)
    audio_dim: int = 128
    audio_tokens: int = 6  # 4 video frames per latent frame + a window of 1 frame each side
    text_dim: int = 128
    motion_dim: int = 16
    freq_dim: int = 256
    eps: float = 1e-6
    rope_theta: float = 10000.0
    # Scene-anchor input: the scene frame's clean latent is patch-embedded (its own zero-started
    # embedding) and added to every generated frame's patch tokens, as image-to-video models feed
    # their conditioning frame to every frame (Wan I2V, SVD concatenate it as channels). The
    # network then learns what changes relative to the picture it animates (mouth, eyes, pose)
    # instead of re-deriving the whole appearance through attention. Off for models trained
    # without it (their config.json has no key).
    anchor: bool = False
    # x0 output with a parameter-free noise path: the head predicts x̂0 − anchor (the scene
    # frame's latent, 0 without one) and the velocity is (x − x̂0) / σ. A patch of p·p·C values
    # wider than the model (4x4x16 = 256 > 192) cannot carry the per-pixel noise of x through the
    # tokens, so a velocity head leaves that noise in the sample; here the noise goes around the
    # network. Used by `direct` DiTs (train/tasks.py dit_config); the Euler step becomes the convex
    # mix (1 − Δ/σ)·x + (Δ/σ)·x̂0.
    x0_skip: bool = False

    @classmethod
    def tiny(cls) -> "DiTConfig":
        """Test size: latent 4x4 (32 px input), 2 layers of width 32."""
        return cls(in_channels=4, dim=32, depth=2, heads=2, ffn_dim=64, audio_dim=16,
                   audio_tokens=6, text_dim=16, motion_dim=4, anchor=True)

    @classmethod
    def small(cls) -> "DiTConfig":
        """Bundled size: latent 16x16 from 128 px, chunk 8 latent frames, reference <= 16 frames.

        6 layers x width 192 (3 heads of 64), FFN 768: 5.1M parameters. 65 tokens per latent
        frame (8x8 patches + 1 motion token). One forward (`dit(x, sigma, cond, ref)`) at chunk 8
        with a 16-frame cached reference (520 generation tokens attending to 1040 + 520 keys,
        8 text tokens, 6 audio tokens per frame) costs 3.76 GFLOP
        (torch.utils.flop_counter.FlopCounterMode: matmuls, convolutions and attention);
        `encode_reference` of 16 frames costs 4.86 GFLOP, once per request. The whole bundled
        model (five networks) is 11.4M parameters, 23 MB in bf16.

        Sized for CPUs without fast bf16 (AVX2 only: ~60 GFLOP/s fp32 per core): the earlier
        8 x 320 preset (16.6M, 12.5 GFLOP a forward) ran the 256 px chunk loop at 0.23-0.34x
        real time on such a 2-core CPU and trained at 7 s a step (batch 4, one core); this one
        trains at ~2.2 s a step.
        """
        return cls(in_channels=16, dim=192, depth=6, heads=3, ffn_dim=768, audio_dim=128,
                   audio_tokens=6, text_dim=128, motion_dim=16, anchor=True)

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
    CFG-distilled DiT, or None for the plain conditional prediction (see `guidance_embedding`).
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
    motion_velocity: torch.Tensor  # [B, T, Dm]


# ---------------------------------------------------------------------------------------------
# layers


PATCH_KEYS = ("patch_embedding.weight", "anchor_embedding.weight")  # conv [D, C, 1, ph, pw]
HEAD_KEYS = ("head.head.weight", "head.head.bias")  # rows ordered (ph, pw, C) (see _unpatchify)


def lift_patch_state(state: dict[str, torch.Tensor], shapes: dict[str, torch.Size]
                     ) -> dict[str, torch.Tensor]:
    """Weights of a DiT with spatial patch p moved to a DiT with patch k·p (same width and
    depth; `shapes`: the new net's parameter shapes), so that on latents k× the size

        new(nearest_upsample_k(x)) == nearest_upsample_k(old(x))

    exactly: the patch and anchor embeddings spread each old tap over its k×k block at 1/k²
    (a k×k block of equal values embeds as the old single value did), the head repeats each
    old output over its block. With k·p patches the token count per frame is the old one's at
    k× the resolution, so a DiT trained on the LR latents starts on the HR latents as itself
    applied to the pooled picture (test_models.py proves the identity). Other keys pass
    through; a shape no rule explains is left for the loader to report."""
    out = dict(state)
    for key in PATCH_KEYS:
        if key in state and key in shapes and state[key].shape != shapes[key]:
            w = state[key]  # [D, C, 1, p, p]
            k = shapes[key][-1] // w.shape[-1]
            if k * w.shape[-1] == shapes[key][-1] and w.shape[:3] == shapes[key][:3]:
                out[key] = w.repeat_interleave(k, -2).repeat_interleave(k, -1) / (k * k)
    for key in HEAD_KEYS:
        if key in state and key in shapes and state[key].shape != shapes[key]:
            w = state[key]  # [p*p*C, ...]
            p2, n2 = w.shape[0], shapes[key][0]
            pk = PATCH_KEYS[0]
            if pk not in state or pk not in shapes:
                continue
            c = state[pk].shape[1]
            p, q = state[pk].shape[-1], shapes[pk][-1]
            if q % p or p * p * c != p2 or q * q * c != n2:
                continue
            k = q // p
            w = w.reshape(p, p, c, *w.shape[1:])
            out[key] = w.repeat_interleave(k, 0).repeat_interleave(k, 1).reshape(n2, *w.shape[3:])
    return out


def sinusoidal_embedding(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Wan's 1-D sinusoid: pos `[...]` float -> `[..., dim]` (cos half, sin half), float32."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=pos.device) / half)
    ang = pos.double()[..., None] * freqs
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float()


def guidance_features(guidance: torch.Tensor, dim: int) -> torch.Tensor:
    """CFG scales `[B, 2]` (audio, reference) -> `[B, dim]`: a sinusoid of 100 x each scale."""
    return torch.cat([sinusoidal_embedding(100.0 * guidance[:, i].float(), dim // 2) for i in range(2)], -1)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[B, N, D]` -> q, k, v `[B, H, N, hd]` with RoPE (tables `[N, hd/2]`) on q and k."""
        b, n, d = x.shape
        split = lambda t: t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q = split(self.norm_q(self.q(x).float()))
        k = split(self.norm_k(self.k(x).float()))
        v = split(self.v(x))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin).to(v.dtype), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o `[B, H, N, hd]` -> `[B, N, D]`."""
        b, h, n, hd = o.shape
        return self.o(o.transpose(1, 2).reshape(b, n, h * hd))


class CrossAttention(nn.Module):
    """Queries from x `[B, N, D]`, keys/values from a context `[B, L, D]` (mask `[B, L]` bool)."""

    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        b, n, d = x.shape
        L = ctx.shape[1]
        hd = d // self.heads
        q = self.norm_q(self.q(x).float()).reshape(b, n, self.heads, hd).transpose(1, 2)
        k = self.norm_k(self.k(ctx).float()).reshape(b, L, self.heads, hd).transpose(1, 2)
        v = self.v(ctx).reshape(b, L, self.heads, hd).transpose(1, 2)
        attn_mask, keep = None, None
        if mask is not None and not bool(mask.all()):
            mask = mask.bool()
            any_ = mask.any(dim=1)  # [B] rows with no context token attend to nothing
            if not bool(any_.all()):
                mask = mask | ~any_[:, None]
                keep = any_
            attn_mask = mask[:, None, None, :]
        dt = q.dtype
        o = F.scaled_dot_product_attention(q, k.to(dt), v.to(dt), attn_mask=attn_mask)
        o = self.o(o.transpose(1, 2).reshape(b, n, d))
        if keep is not None:
            o = o * keep[:, None, None].to(o.dtype)
        return o


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

    # pieces shared by the sparse, reference and dense paths; x is `[B, F, P, D]`,
    # e6 `[B|1, F|1, 6, D]` per-frame AdaLN parameters.
    def mods(self, e6: torch.Tensor) -> list[torch.Tensor]:
        """6 tensors `[B, F, 1, D]`: shift/scale/gate (attention), shift/scale/gate (FFN)."""
        return [m.unsqueeze(2) for m in (self.modulation[None] + e6).unbind(2)]

    def attn_in(self, x: torch.Tensor, m: list[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.norm1(x) * (1 + m[1]) + m[0]
        return self.self_attn.qkv(y.flatten(1, 2), cos, sin)

    def attn_out(self, x: torch.Tensor, o: torch.Tensor, m: list[torch.Tensor]) -> torch.Tensor:
        return x + self.self_attn.out(o).view(x.shape) * m[2]

    def cross(self, x: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor | None,
              audio: torch.Tensor) -> torch.Tensor:
        """Text cross-attention over all tokens, audio cross-attention per latent frame.

        x `[B, T, P, D]`, text `[B, L, D]`, audio `[B, T, A, D]`.
        """
        b, t, p, d = x.shape
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


# ---------------------------------------------------------------------------------------------
# shared backbone (DiT and SR refiner)


class RefTransformer(nn.Module):
    """Backbone shared by `VideoRefDiT` and `SRRefiner`.

    patch input channels `in_ch`, output channels `out_ch`; `window=None`: generation tokens
    attend to all generation tokens (+ reference); `window=w`: only to frames within +-w.
    """

    def __init__(self, config, in_ch: int, out_ch: int, *, window: int | None = None,  # type: ignore[no-untyped-def]
                 motion_head: bool = True) -> None:
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

    def _gen_patches(self, xin: torch.Tensor, anchor: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
        """Generation patch tokens `[B, T, S, D]`, plus the scene anchor's embedding on every
        frame where the model has an anchor input and one is given."""
        patches, hp, wp = self._patches(xin)
        embed = getattr(self, "anchor_embedding", None)
        if embed is not None and anchor is not None:
            a = embed(anchor.to(xin.dtype).unsqueeze(2))  # [B, D, 1, h', w']
            patches = patches + a.flatten(3).permute(0, 2, 3, 1).to(patches.dtype)
        return patches, hp, wp

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

    def _context(self, cond: DiTCondition, t: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                             torch.Tensor, torch.Tensor]:
        text = self.text_embedding(cond.text)  # [B, L, D]
        audio = self.audio_embedding(cond.audio)  # [B, T, A, D]
        t_pos = cond.t_pos if cond.t_pos is not None else torch.arange(t, dtype=torch.float32)
        return text, cond.text_mask, audio, t_pos.float()

    @staticmethod
    def _sigma(sigma, b: int, t: int, device) -> torch.Tensor:  # type: ignore[no-untyped-def]
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

    # -- reference -------------------------------------------------------------------------------
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

    # -- generation ------------------------------------------------------------------------------
    def _run(self, xin: torch.Tensor, sigma, cond: DiTCondition,  # type: ignore[no-untyped-def]
             ref: ReferenceCache | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse path. xin `[B, Cin, T, h, w]` -> (velocity `[B, out, T, h, w]`, motion `[B, T, Dm]`)."""
        b, _, t = xin.shape[:3]
        sigma = self._sigma(sigma, b, t, xin.device)
        e, e6 = self._time(sigma, cond.guidance)
        patches, hp, wp = self._gen_patches(xin, cond.anchor)
        mt = self._motion_tokens(cond.motion, e)
        x = torch.cat([patches, mt[:, :, None].to(patches.dtype)], dim=2)  # [B, T, P, D]
        text, tmask, audio, t_pos = self._context(cond, t)
        cos, sin = self.rope(t_pos, hp, wp, extra_tokens=1)
        if ref is not None:
            ref = ref._expand(b)
            rmask = ref.token_valid()
        for i, blk in enumerate(self.blocks):
            m = blk.mods(e6)
            q, k, v = blk.attn_in(x, m, cos, sin)
            rk = ref.k[i] if ref is not None else None
            rv = ref.v[i] if ref is not None else None
            rm = rmask if ref is not None else None
            if self.window is None:
                o = sparse_reference_attention(q, k, v, rk, rv, rm)
            else:
                o = local_window_attention(q, k, v, t, self.window, rk, rv, rm)
            x = blk.attn_out(x, o, m)
            x = blk.cross(x, text, tmask, audio)
            x = blk.ffn_out(x, m)
        return self._outputs(x, e, hp, wp)

    def _outputs(self, x: torch.Tensor, e: torch.Tensor, hp: int, wp: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = hp * wp
        vel = self._unpatchify(self.head(x[:, :, :s], e), hp, wp)
        mv = self.motion_head(x[:, :, s], e) if self.motion_head is not None else None
        return vel, mv

    def _run_dense(self, xin: torch.Tensor, sigma, cond: DiTCondition,  # type: ignore[no-untyped-def]
                   ref_latents: torch.Tensor, valid: torch.Tensor | None,
                   ref_t_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dense path: one sequence [ref ; gen] per layer, asymmetric block mask, sigma = 0 for
        reference frames. Invalid reference frames are computed but masked as keys."""
        b, _, t = xin.shape[:3]
        r = ref_latents.shape[2]
        sigma = self._sigma(sigma, b, t, xin.device)
        if valid is None:
            valid = torch.ones(b, r, dtype=torch.bool, device=xin.device)
        valid = valid.to(torch.bool).reshape(b, r)
        e, e6 = self._time(sigma, cond.guidance)
        _, e06 = self._time(torch.zeros(1, 1, device=xin.device))
        e6_all = torch.cat([e06.expand(b, r, *e06.shape[2:]), e6], dim=1)  # [B, R+T, 6, D]
        patches, hp, wp = self._gen_patches(xin, cond.anchor)
        mt = self._motion_tokens(cond.motion, e)
        xg = torch.cat([patches, mt[:, :, None].to(patches.dtype)], dim=2)  # [B, T, P, D]
        xr, _, _, _ = self._ref_tokens(ref_latents)  # [B, R, P, D]
        xr = xr.expand(b, *xr.shape[1:])
        x = torch.cat([xr, xg.to(xr.dtype)], dim=1)  # [B, R+T, P, D]
        p = x.shape[2]
        text, tmask, audio, t_pos = self._context(cond, t)
        pos = torch.cat([torch.as_tensor(ref_t_pos, dtype=torch.float32).reshape(-1), t_pos])
        cos, sin = self.rope(pos, hp, wp, extra_tokens=1)
        mask = reference_block_mask(valid, p, t, self.window)
        for blk in self.blocks:
            m = blk.mods(e6_all)
            q, k, v = blk.attn_in(x, m, cos, sin)
            x = blk.attn_out(x, dense_attention(q, k, v, mask), m)
            x = torch.cat([x[:, :r], blk.cross(x[:, r:], text, tmask, audio)], dim=1)
            x = blk.ffn_out(x, m)
        return self._outputs(x[:, r:], e, hp, wp)


class VideoRefDiT(RefTransformer):
    """The VideoRef DiT. See the module docstring for the token layout and block structure.

    - `encode_reference(lat [B,C,R,h,w], valid [B,R] | None, t_pos [R]) -> ReferenceCache`
    - `forward(x [B,C,T,h,w], sigma [B,T], cond, ref) -> DiTOutput` (sparse, cached reference)
    - `forward_uncached(x, sigma, cond, ref_latents, valid, ref_t_pos)` (reference recomputed)
    - `forward_dense(x, sigma, cond, ref_latents, valid, ref_t_pos)` (one sequence, dense mask)
    - `extract_motion(ref_latents [B,C,R,h,w]) -> [B,R,Dm]`
    """

    def __init__(self, config: DiTConfig) -> None:
        super().__init__(config, config.in_channels, config.in_channels, window=None,
                         motion_head=True)
        # CFG distillation with the scales as inputs (Avatar V sec. 3.4): the guidance scales'
        # embedding joins the timestep's. Registered last (the other parameters' seeded init is
        # unchanged); a trained model starts it at zero (train.tasks.init_net), and it is only
        # applied when a condition carries `guidance`, so a plain A2V model never sees it.
        d = config.dim
        self.guidance_embedding = nn.Sequential(nn.Linear(config.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        if config.anchor:  # registered after everything else, for the same reason
            self.anchor_embedding = nn.Conv3d(config.in_channels, d, kernel_size=self.patch, stride=self.patch)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: DiTCondition,
                ref: ReferenceCache | None) -> DiTOutput:
        vel, mv = self._run(x, sigma, cond, ref)
        return DiTOutput(velocity=self.velocity_of(vel, x, sigma, cond.anchor), motion_velocity=mv)

    def velocity_of(self, head: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor,
                    anchor: torch.Tensor | None) -> torch.Tensor:
        """The velocity from the head's output `[B, C, T, h, w]`: itself, or with `x0_skip`
        (x − x̂0) / σ where x̂0 = head + anchor `[B, C, h, w]` (σ floored at 1e-3: frames given
        clean have σ = 0 and their velocity is never used)."""
        if not self.config.x0_skip:
            return head
        b, _, t = x.shape[:3]
        x0 = head.float()
        if anchor is not None:
            x0 = x0 + anchor.float()[:, :, None]
        s = self._sigma(sigma, b, t, x.device).float().clamp_min(1e-3)[:, None, :, None, None]
        return ((x.float() - x0) / s).to(head.dtype)

    def forward_uncached(self, x: torch.Tensor, sigma: torch.Tensor, cond: DiTCondition,
                         ref_latents: torch.Tensor, valid: torch.Tensor | None,
                         ref_t_pos: torch.Tensor) -> DiTOutput:
        """Same result as `forward`, re-encoding the reference inside the call (no KV cache)."""
        return self.forward(x, sigma, cond, self.encode_reference(ref_latents, valid, ref_t_pos))

    def forward_dense(self, x: torch.Tensor, sigma: torch.Tensor, cond: DiTCondition,
                      ref_latents: torch.Tensor, valid: torch.Tensor | None,
                      ref_t_pos: torch.Tensor) -> DiTOutput:
        vel, mv = self._run_dense(x, sigma, cond, ref_latents, valid, ref_t_pos)
        return DiTOutput(velocity=self.velocity_of(vel, x, sigma, cond.anchor), motion_velocity=mv)
