"""VideoRef DiT (Avatar V sec. 2.1, 4.3): the reference-conditioned transformer of
`models/transformer.py` (token layout, blocks, the sparse and dense forwards) with a motion head,
a CFG-guidance input, a scene-anchor input, and the causal forwards of the block-causal student
(Live Avatar sec. 4.1, Eq. 5): same weights, same blocks, a different attention pattern.

A causal video is a sequence of *blocks* of a few latent frames. A block's tokens attend to
- the sink (reference frames, later the Adaptive Attention Sink frame) — `ReferenceCache` K/V,
  computed once, placed in time by Rolling RoPE (`models/sink.py`);
- the previous `history` blocks (rolling KV cache, `cache/kv.py`);
- themselves (full attention inside the block).
Sink tokens attend only within their own frame, as reference tokens always do. Two forwards
compute that one pattern:
- `forward_causal_block` (streaming): one block, history from a `RollingKVCache`; returns the
  block's own per-layer K/V for the caller to append (Algorithm 3's `v_theta^KV`). Used by the
  causal stage (`engine/causal.py`, also on the TPP ranks) and the Self-Forcing DMD trainer.
- `forward_block_causal` (plain): every block of a sequence in one pass, one dense mask
  (`block_causal_mask`), the sink recomputed from its latents for every distinct placement.
  Used by the equivalence tests (cached == plain) and by diffusion-forcing training, where
  blocks carry independent noise levels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from avatarstream.cache.kv import BlockKV, RollingKVCache
from avatarstream.cache.reference import ReferenceCache
from avatarstream.models.attention import block_causal_mask, causal_block_attention
from avatarstream.models.transformer import (DiTCondition, DiTOutput, Embedded, RefTransformer,
                                             TransformerConfig, masked_attention)


@dataclass(kw_only=True)
class DiTConfig(TransformerConfig):
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
    # network. Used by `direct` DiTs (train/nets.py dit_config); the Euler step becomes the convex
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


class VideoRefDiT(RefTransformer):
    """The VideoRef DiT. Every forward composes `embed`, `run_blocks` and `readout`:

    - `encode_reference(lat [B,C,R,h,w], valid [B,R] | None, t_pos [R]) -> ReferenceCache`
    - `forward(x [B,C,T,h,w], sigma [B,T], cond, ref) -> DiTOutput` (sparse, cached reference)
    - `forward_uncached(x, sigma, cond, ref_latents, valid, ref_t_pos)` (reference recomputed)
    - `forward_dense(x, sigma, cond, ref_latents, valid, ref_t_pos)` (one sequence, dense mask)
    - `forward_causal_block(x, sigma, cond, sink, history) -> (DiTOutput, BlockKV)` (streaming)
    - `forward_block_causal(x, sigma, cond, sinks, sink_of_block, block=, history=)` (plain)
    - `extract_motion(ref_latents [B,C,R,h,w]) -> [B,R,Dm]`
    """

    config: DiTConfig

    def __init__(self, config: DiTConfig) -> None:
        super().__init__(config, config.in_channels, config.in_channels, window=None,
                         motion_head=True)
        # CFG distillation with the scales as inputs (Avatar V sec. 3.4): the guidance scales'
        # embedding joins the timestep's. Registered last (the other parameters' seeded init is
        # unchanged); a trained model starts it at zero (train.nets.init_net), and it is only
        # applied when a condition carries `guidance`, so a plain A2V model never sees it.
        d = config.dim
        self.guidance_embedding = nn.Sequential(nn.Linear(config.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        if config.anchor:  # registered after everything else, for the same reason
            self.anchor_embedding = nn.Conv3d(config.in_channels, d, kernel_size=self.patch, stride=self.patch)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: DiTCondition,
                ref: ReferenceCache | None) -> DiTOutput:
        return self.forward_sparse(x, sigma, cond, ref)

    def readout(self, h: torch.Tensor, emb: Embedded) -> DiTOutput:
        """The heads, with the velocity in this DiT's parameterisation (`velocity_of`)."""
        out = super().readout(h, emb)
        return DiTOutput(velocity=self.velocity_of(out.velocity, emb.x, emb.sigma, emb.anchor),
                         motion_velocity=out.motion_velocity)

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

    # -- causal ------------------------------------------------------------------------------------
    def forward_causal_block(self, x: torch.Tensor, sigma: torch.Tensor, cond: DiTCondition,
                             sink: ReferenceCache | None, history: RollingKVCache | None
                             ) -> tuple[DiTOutput, BlockKV]:
        """Denoise one block with the rolling cache (the streaming path).

        x `[B, C, Tb, h, w]` the block's noisy latents, sigma `[B, Tb]`, cond with `t_pos` `[Tb]` =
        the block's timeline positions; sink placed where it should be (`SinkCache.at`); history the
        cache of this denoising step (read only). Returns the output and the block's own per-layer K/V
        (RoPE at t_pos) to `append` to that cache afterwards.
        """
        emb = self.embed(x, sigma, cond)
        if sink is not None:
            sink = sink.expand(x.shape[0])
        smask = sink.token_valid() if sink is not None else None
        kv = BlockKV([], [])

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv.k.append(k)
            kv.v.append(v)
            return causal_block_attention(q, k, v, (sink.k[i], sink.v[i]) if sink is not None else None,
                                          smask, history.layer(i) if history is not None else None)

        return self.readout(self.run_blocks(emb, attend), emb), kv

    def forward_block_causal(self, x: torch.Tensor, sigma: torch.Tensor, cond: DiTCondition,
                             sinks: Sequence[tuple[torch.Tensor, torch.Tensor | None, float]],
                             sink_of_block: Sequence[int], *, block: int, history: int) -> DiTOutput:
        """All blocks of a sequence in one pass with the block-causal mask (the plain path).

        x `[B, C, T, h, w]` with T = blocks * block, sigma `[B, T]` (any per-frame levels: diffusion
        forcing draws one per block), cond over the T frames (t_pos = timeline positions);
        sinks: copies (latents `[B|1, C, R_c, h, w]`, valid `[B, R_c]` | None, temporal position);
        block a attends to copy `sink_of_block[a]`. Sink tokens run through every layer with
        sigma = 0 modulation and frame-local attention, as `encode_reference` does.
        """
        b, _, t = x.shape[:3]
        if t % block:
            raise ValueError(f"sequence of {t} frames is not a whole number of {block}-frame blocks")
        nb = t // block
        if len(sink_of_block) != nb:
            raise ValueError(f"sink_of_block names {len(sink_of_block)} blocks, the sequence has {nb}")
        emb = self.embed(x, sigma, cond, [(lat, torch.full((lat.shape[2],), float(position)))
                                          for lat, _, position in sinks])
        valids = [torch.ones(b, lat.shape[2], dtype=torch.bool, device=x.device) if valid is None
                  else valid.to(torch.bool).reshape(b, lat.shape[2]) for lat, valid, _ in sinks]
        mask = block_causal_mask(valids, sink_of_block, emb.tokens_per_frame, block, nb, history)
        return self.readout(self.run_blocks(emb, masked_attention(mask)), emb)
