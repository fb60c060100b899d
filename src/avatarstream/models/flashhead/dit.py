"""The FlashHead DiT (SoulX-FlashHead-1.3B, `WanModelAudioProject`): Wan2.1-T2V-1.3B blocks whose
text cross-attention attends to audio instead, one 33-frame chunk denoised at a time.

What differs from our reference-conditioned transformer (`models/transformer.py`):
- no reference tokens, motion tokens or text: the reference enters as latents `y` concatenated
  to the noisy latents on channels (Pro 16 + 16 = 32 in, Lite 128 + 128 = 256 in), and the
  previous chunk enters as clean latents written into the first frames (the sampler's job);
- one σ per chunk: every token, the clean motion latents included, gets the same AdaLN tables
  (the checkpoints were trained that way);
- RoPE positions restart at 0 in every chunk (no cache, no sink);
- each block's cross-attention is per latent frame over that frame's audio tokens
  (`models/flashhead/audio_proj.py`), with full self-attention over the chunk.

The block is our `DiTBlock` without its text cross-attention (`FlashHeadBlock`); our key names
(`audio_attn`, `norm_audio`) are the official `cross_attn`, `norm3` after the adapter's renames
(weights/flashhead.py). The official module also holds a text embedding and an `audio_emb` MLP that
its forward never uses (10.4 M parameters in the real checkpoints); this one does not build them.

Shapes: x `[B, C_out, F, H, W]` noisy latents, y `[B, C_in − C_out, F, H, W]`, audio
`[B, 1 + s·(F−1), window, layers, channels]`, sigma `[B]` or a scalar; tokens `[B, F, P, D]`
with P = (H/ph)·(W/pw) patches per latent frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from avatarstream.models.attention import dense_attention
from avatarstream.models.dit_blocks import DiTBlock, Head, sinusoidal_embedding
from avatarstream.models.flashhead.audio_proj import AudioProjConfig, AudioProjection
from avatarstream.models.rope import Rope3D


@dataclass(frozen=True, kw_only=True)
class FlashHeadConfig:
    """Sizes of a FlashHead DiT. Defaults are the released Pro model (Wan2.1-T2V-1.3B widths);
    `lite()` and `tiny()` are the other presets, `from_official` reads the official kwargs."""

    in_channels: int = 32  # noisy latents ⊕ reference latents
    out_channels: int = 16
    dim: int = 1536
    depth: int = 30
    heads: int = 12
    ffn_dim: int = 8960
    freq_dim: int = 256
    eps: float = 1e-6
    patch: tuple[int, int, int] = (1, 2, 2)
    vae_stride: tuple[int, int, int] = (4, 8, 8)  # video frames / pixels per latent (t, h, w)
    rope_theta: float = 10000.0
    # the audio projection's sizes (hard-coded for wav2vec2-base in the official module)
    audio: AudioProjConfig = field(default_factory=AudioProjConfig)

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} does not split into {self.heads} heads")
        # the official RoPE table builder agrees with its own per-axis split only then
        if (self.head_dim // 3) % 2:
            raise ValueError(f"head_dim {self.head_dim}: FlashHead's RoPE needs head_dim // 3 even")
        if self.patch[0] != 1:
            raise ValueError("temporal patch size must be 1 (audio is attended per latent frame)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def frames_per_latent(self) -> int:
        return self.vae_stride[0]

    @classmethod
    def pro(cls) -> FlashHeadConfig:
        """SoulX-FlashHead-1.3B Pro: Wan2.1 VAE latents (16 channels, 4×8×8), patch 1×2×2."""
        return cls()

    @classmethod
    def lite(cls) -> FlashHeadConfig:
        """SoulX-FlashHead-1.3B Lite: LTX-Video 0.9 latents (128 channels, 8×32×32), patch 1×1×1."""
        return cls(in_channels=256, out_channels=128, patch=(1, 1, 1), vae_stride=(8, 32, 32))

    @classmethod
    def tiny(cls) -> FlashHeadConfig:
        """Test size, as the golden fixtures: width 64, 2 heads, 2 layers, a 4 × 16 audio encoder."""
        return cls(dim=64, depth=2, heads=2, ffn_dim=128,
                   audio=AudioProjConfig(layers=4, channels=16, hidden=32))

    @classmethod
    def from_official(cls, kwargs: dict[str, Any], audio: dict[str, Any] | None = None) -> FlashHeadConfig:
        """The official constructor's kwargs (`config.json` of `Model_Pro/`, `Model_Lite/`) and,
        where a model was built with other audio sizes than the hard-coded wav2vec2-base ones,
        those sizes (`blocks`, `channels`, `intermediate_dim`, `context_tokens`, `output_dim`)."""
        if kwargs.get("has_image_input"):
            raise ValueError("FlashHead with an image input (CLIP branch) is not supported")
        try:
            c = cls(in_channels=int(kwargs["in_dim"]), out_channels=int(kwargs["out_dim"]),
                    dim=int(kwargs["dim"]), depth=int(kwargs["num_layers"]),
                    heads=int(kwargs["num_heads"]), ffn_dim=int(kwargs["ffn_dim"]),
                    freq_dim=int(kwargs["freq_dim"]), eps=float(kwargs["eps"]),
                    patch=tuple(int(p) for p in kwargs["patch_size"]),  # type: ignore[arg-type]
                    vae_stride=tuple(int(p) for p in kwargs["vae_stride"]))  # type: ignore[arg-type]
        except KeyError as e:
            raise ValueError(f"FlashHead config lacks {e.args[0]!r}") from None
        if audio:
            if int(audio.get("output_dim", c.dim)) != c.dim:
                raise ValueError(f"audio tokens of width {audio['output_dim']} cannot feed a "
                                 f"width-{c.dim} cross-attention")
            c = replace(c, audio=AudioProjConfig(
                layers=int(audio["blocks"]), channels=int(audio["channels"]),
                hidden=int(audio["intermediate_dim"]), tokens=int(audio["context_tokens"])))
        return c


class FlashHeadBlock(DiTBlock):
    """`DiTBlock` with audio cross-attention per latent frame and no text cross-attention.

    Wan2.1's block is ours key for key; FlashHead turned the text cross-attention into the audio
    one, so the text branch (`norm3`, `cross_attn`) is removed here and the audio branch
    (`norm_audio`, `audio_attn`) takes its place in the same position of the residual stream.
    """

    def __init__(self, dim: int, heads: int, ffn_dim: int, eps: float) -> None:
        super().__init__(dim, heads, ffn_dim, eps)
        del self.norm3, self.cross_attn

    def cross(self, x: torch.Tensor, text: torch.Tensor | None, text_mask: torch.Tensor | None,
              audio: torch.Tensor) -> torch.Tensor:
        """Audio cross-attention of every latent frame to its own tokens: x `[B, F, P, D]`,
        audio `[B, F, A, D]`. There is no text: `text` must be None."""
        if text is not None:
            raise ValueError("FlashHead blocks have no text cross-attention")
        b, f, p, d = x.shape
        y = self.audio_attn(self.norm_audio(x).reshape(b * f, p, d), audio.reshape(b * f, -1, d))
        return x + y.view(b, f, p, d)


class FlashHeadDiT(nn.Module):
    """`forward(x, sigma, audio, y) -> velocity`, see the module docstring.

    Keys (after the adapter): `patch_embedding`, `time_embedding.{0,2}`, `time_projection.1`,
    `blocks.N.*` (`DiTBlock` names), `head.{head,modulation}`, `audio_proj.*`.
    """

    def __init__(self, config: FlashHeadConfig) -> None:
        super().__init__()
        c = self.config = config
        d = c.dim
        self.patch_embedding = nn.Conv3d(c.in_channels, d, kernel_size=c.patch, stride=c.patch)
        self.time_embedding = nn.Sequential(nn.Linear(c.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(FlashHeadBlock(d, c.heads, c.ffn_dim, c.eps) for _ in range(c.depth))
        self.head = Head(d, c.out_channels * math.prod(c.patch), c.eps)
        self.audio_proj = AudioProjection(c.audio, d, c.frames_per_latent)
        self.rope = Rope3D(c.head_dim, c.rope_theta)

    def embed_time(self, sigma: torch.Tensor | float, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One σ per row (a scalar: the same for all) -> e `[B, 1, D]` (the head's), e6
        `[B, 1, 6, D]` (the blocks'), shared by every token of the chunk. The timestep is
        t = 1000·σ in float32, which is the official timestep table for the shifted schedules
        (1000, 937.5, 833.333, 625 at 4 steps, shift 5)."""
        s = torch.as_tensor(sigma, dtype=torch.float32, device=self.head.modulation.device)
        s = s.reshape(-1).expand(batch) if s.numel() == 1 else s.reshape(batch)
        e = self.time_embedding(sinusoidal_embedding(1000.0 * s, self.config.freq_dim))  # [B, D]
        e6 = self.time_projection(e).unflatten(-1, (6, self.config.dim))  # [B, 6, D]
        return e[:, None], e6[:, None]

    def unpatchify(self, out: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Head output `[B, F', P, pt·ph·pw·C]` (channels last in a patch) -> `[B, C, F, H, W]`."""
        b = out.shape[0]
        f, hp, wp = grid
        pt, ph, pw = self.config.patch
        c = self.config.out_channels
        out = out.reshape(b, f, hp, wp, pt, ph, pw, c)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, c, f * pt, hp * ph, wp * pw)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor | float, audio: torch.Tensor,
                y: torch.Tensor) -> torch.Tensor:
        """x `[B, C_out, F, H, W]` at σ, audio `[B, 1 + s·(F−1), W, L, C]`, y the reference
        latents `[B | 1, C_in − C_out, F, H, W]` -> velocity `[B, C_out, F, H, W]`."""
        b = x.shape[0]
        xy = torch.cat([x, y.expand(b, *y.shape[1:]).to(x.dtype)], dim=1)  # [B, C_in, F, H, W]
        p = self.patch_embedding(xy)  # [B, D, F', H', W']
        grid = (int(p.shape[2]), int(p.shape[3]), int(p.shape[4]))
        h = p.flatten(3).permute(0, 2, 3, 1)  # [B, F', P, D]
        e, e6 = self.embed_time(sigma, b)
        ctx = self.audio_proj(audio.to(x.dtype)).to(h.dtype)  # [B, F', tokens, D]
        if ctx.shape[1] != grid[0]:
            raise ValueError(f"audio for {ctx.shape[1]} latent frames, latents have {grid[0]}")
        cos, sin = self.rope(torch.arange(grid[0], dtype=torch.float32), grid[1], grid[2])  # [F'·P, hd/2]
        cos, sin = cos.to(x.device), sin.to(x.device)  # once, not in each of the 2·depth rotations
        for blk in self.blocks:
            m = blk.mods(e6)
            q, k, v = blk.attn_in(h, m, cos, sin)
            h = blk.attn_out(h, dense_attention(q, k, v, None), m)
            h = blk.ffn_out(blk.cross(h, None, None, ctx), m)
        return self.unpatchify(self.head(h, e), grid)
