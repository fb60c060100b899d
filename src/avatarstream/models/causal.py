"""The VideoRef DiT as a block-causal student (Live Avatar sec. 4.1, Eq. 5): same weights, same
blocks, a different attention pattern.

A video is a sequence of *blocks* of `block` latent frames. A block's tokens attend to
- the sink (reference frames, later the Adaptive Attention Sink frame) — `ReferenceCache` K/V,
  computed once, placed in time by Rolling RoPE (`cache/sink.py`);
- the previous `history` blocks (rolling KV cache, `cache/kv.py`);
- themselves (full attention inside the block).
Sink tokens attend only within their own frame, as reference tokens always do.

Two implementations of that one pattern:
- `causal_block_forward` (streaming): one block, history from a `RollingKVCache`; returns the
  block's own per-layer K/V for the caller to append (Algorithm 3's `v_theta^KV`).
- `block_causal_forward` (plain): every block of a sequence in one pass, one dense mask
  (`block_causal_mask`), the sink recomputed from its latents for every distinct placement.
  Used by the equivalence tests (cached == plain) and by diffusion-forcing training, where
  blocks carry independent noise levels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from avatarstream.cache.kv import BlockKV, RollingKVCache
from avatarstream.cache.reference import ReferenceCache
from avatarstream.models.attention import _sdpa, dense_attention, token_mask
from avatarstream.models.dit import DiTCondition, DiTOutput, VideoRefDiT


def causal_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           sink: ReferenceCache | None, sink_mask: torch.Tensor | None,
                           history: tuple[torch.Tensor, torch.Tensor] | None, layer: int
                           ) -> torch.Tensor:
    """One block's queries over [sink K/V ; history K/V ; own K/V] in one SDPA call.

    q, k, v `[B, H, Pb, hd]`; sink K/V `[B, H, Nr, hd]` of `layer` with `sink_mask` `[B, Nr]` bool
    (None: all valid); history `[B, H, Nh, hd]` each or None. Returns `[B, H, Pb, hd]`.
    """
    dt = q.dtype
    ks, vs, masks = [], [], []
    b = q.shape[0]
    if sink is not None and sink.k[layer].shape[2] > 0:
        ks.append(sink.k[layer])
        vs.append(sink.v[layer])
        nr = sink.k[layer].shape[2]
        masks.append(sink_mask if sink_mask is not None
                     else torch.ones(b, nr, dtype=torch.bool, device=q.device))
    if history is not None:
        ks.append(history[0])
        vs.append(history[1])
        masks.append(torch.ones(b, history[0].shape[2], dtype=torch.bool, device=q.device))
    if not ks:
        return _sdpa(q, k, v)
    kk = torch.cat([x.to(dt) for x in (*ks, k)], dim=2)
    vv = torch.cat([x.to(dt) for x in (*vs, v)], dim=2)
    mask = None
    if sink_mask is not None and not bool(sink_mask.all()):
        own = torch.ones(b, k.shape[2], dtype=torch.bool, device=q.device)
        mask = torch.cat([*masks, own], dim=1)[:, None, None, :]  # [B, 1, 1, Nr + Nh + Pb]
    return _sdpa(q, kk, vv, mask)


def causal_block_forward(dit: VideoRefDiT, x: torch.Tensor, sigma: torch.Tensor,
                         cond: DiTCondition, sink: ReferenceCache | None,
                         history: RollingKVCache | None) -> tuple[DiTOutput, BlockKV]:
    """Denoise one block with the rolling cache (the streaming path).

    x `[B, C, Tb, h, w]` the block's noisy latents, sigma `[B, Tb]`, cond with `t_pos` `[Tb]` =
    the block's timeline positions; sink placed where it should be (`SinkCache.at`); history the
    cache of this denoising step (read only). Returns the output and the block's own per-layer K/V
    (RoPE at t_pos) to `append` to that cache afterwards.
    """
    b, _, t = x.shape[:3]
    sigma = dit._sigma(sigma, b, t, x.device)
    e, e6 = dit._time(sigma, cond.guidance)
    patches, hp, wp = dit._gen_patches(x, cond.anchor)
    mt = dit._motion_tokens(cond.motion, e)
    h = torch.cat([patches, mt[:, :, None].to(patches.dtype)], dim=2)  # [B, Tb, P, D]
    text, tmask, audio, t_pos = dit._context(cond, t)
    cos, sin = dit.rope(t_pos, hp, wp, extra_tokens=1)
    smask = None
    if sink is not None:
        sink = sink._expand(b)
        smask = sink.token_valid()
    ks, vs = [], []
    for i, blk in enumerate(dit.blocks):
        m = blk.mods(e6)
        q, k, v = blk.attn_in(h, m, cos, sin)
        ks.append(k)
        vs.append(v)
        hist = history.layer(i) if history is not None else None
        h = blk.attn_out(h, causal_block_attention(q, k, v, sink, smask, hist, i), m)
        h = blk.cross(h, text, tmask, audio)
        h = blk.ffn_out(h, m)
    vel, mv = dit._outputs(h, e, hp, wp)
    vel = dit.velocity_of(vel, x, sigma, cond.anchor)
    return DiTOutput(velocity=vel, motion_velocity=mv), BlockKV(ks, vs)


def block_causal_mask(sink_valid: Sequence[torch.Tensor], sink_of_block: Sequence[int],
                      tokens_per_frame: int, block: int, blocks: int, history: int) -> torch.Tensor:
    """Dense mask for one sequence [sink copy 0 ; sink copy 1 ; ... ; block 0 ; block 1 ; ...].

    sink_valid[c]: `[B, R_c]` bool frames of sink copy c; block a uses copy `sink_of_block[a]`.
    Returns `[B, 1, M, M]` bool (True = may attend):
    - sink token -> tokens of its own frame only;
    - generation token of block a -> valid tokens of sink copy `sink_of_block[a]`, and every
      token of blocks a - history .. a (block-causal, sliding window of `history` blocks).
    """
    p = tokens_per_frame
    b = sink_valid[0].shape[0] if sink_valid else 1
    dev = sink_valid[0].device if sink_valid else torch.device("cpu")
    sizes = [int(s.shape[1]) for s in sink_valid]
    ns = sum(sizes) * p
    ng = blocks * block * p
    # sink frame id of every sink token and the copy it belongs to
    frame_id = torch.arange(sum(sizes), device=dev).repeat_interleave(p)  # [Ns]
    copy_id = torch.cat([torch.full((r * p,), c, device=dev) for c, r in enumerate(sizes)]) \
        if sizes else torch.zeros(0, dtype=torch.long, device=dev)
    blk = torch.arange(blocks, device=dev).repeat_interleave(block * p)  # [Ng] block of each token
    ss = (frame_id[:, None] == frame_id[None, :])[None].expand(b, ns, ns)
    sg = torch.zeros(b, ns, ng, dtype=torch.bool, device=dev)
    uses = torch.as_tensor(list(sink_of_block), device=dev)[blk]  # [Ng] copy each token uses
    valid = torch.cat([token_mask(s.to(torch.bool), p) for s in sink_valid], dim=1) if sizes \
        else torch.zeros(b, 0, dtype=torch.bool, device=dev)
    gs = (uses[:, None] == copy_id[None, :])[None] & valid[:, None, :]  # [B, Ng, Ns]
    d = blk[:, None] - blk[None, :]
    gg = ((d >= 0) & (d <= history))[None].expand(b, ng, ng)
    top = torch.cat([ss, sg], dim=2)
    bottom = torch.cat([gs, gg], dim=2)
    return torch.cat([top, bottom], dim=1)[:, None]  # [B, 1, M, M]


def block_causal_forward(dit: VideoRefDiT, x: torch.Tensor, sigma: torch.Tensor,
                         cond: DiTCondition, sinks: Sequence[tuple[torch.Tensor, torch.Tensor | None, float]],
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
    sigma = dit._sigma(sigma, b, t, x.device)
    e, e6 = dit._time(sigma, cond.guidance)
    _, e06 = dit._time(torch.zeros(1, 1, device=x.device))
    patches, hp, wp = dit._gen_patches(x, cond.anchor)
    mt = dit._motion_tokens(cond.motion, e)
    xg = torch.cat([patches, mt[:, :, None].to(patches.dtype)], dim=2)  # [B, T, P, D]
    text, tmask, audio, t_pos = dit._context(cond, t)
    xs, pos, valids = [], [], []
    for lat, valid, position in sinks:
        tok, _, _, _ = dit._ref_tokens(lat)  # [B|1, R_c, P, D]
        xs.append(tok.expand(b, *tok.shape[1:]))
        r = lat.shape[2]
        pos.append(torch.full((r,), float(position)))
        valids.append(torch.ones(b, r, dtype=torch.bool, device=x.device) if valid is None
                      else valid.to(torch.bool).reshape(b, r))
    rs = sum(s.shape[1] for s in xs)
    h = torch.cat([*xs, xg.to(xs[0].dtype) if xs else xg], dim=1)  # [B, Rs + T, P, D]
    p = h.shape[2]
    e6_all = torch.cat([e06.expand(b, rs, *e06.shape[2:]), e6], dim=1)  # [B, Rs + T, 6, D]
    cos, sin = dit.rope(torch.cat([*pos, t_pos.cpu()]), hp, wp, extra_tokens=1)
    mask = block_causal_mask(valids, sink_of_block, p, block, nb, history)
    for blk in dit.blocks:
        m = blk.mods(e6_all)
        q, k, v = blk.attn_in(h, m, cos, sin)
        h = blk.attn_out(h, dense_attention(q, k, v, mask), m)
        h = torch.cat([h[:, :rs], blk.cross(h[:, rs:], text, tmask, audio)], dim=1)
        h = blk.ffn_out(h, m)
    vel, mv = dit._outputs(h[:, rs:], e, hp, wp)
    return DiTOutput(velocity=dit.velocity_of(vel, x, sigma, cond.anchor), motion_velocity=mv)
