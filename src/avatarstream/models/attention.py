"""Attention patterns of the VideoRef DiT and the SR refiner (all via F.scaled_dot_product_attention).

Token layout: frame-major. A sequence of `F` frames with `P` tokens per frame has `N = F * P`
tokens, token `i` belongs to frame `i // P`. q / k / v are `[B, heads, N, hd]`. Boolean masks
follow SDPA's convention: True = may attend.

1. Sparse Reference Attention (Avatar V, sec. 2.1 / 4.3)
   - generation queries attend to [valid reference K/V ; generation K/V] in one SDPA call
     (`sparse_reference_attention`), cost O(N_gen * (N_ref + N_gen));
   - reference queries attend only inside their own frame (`frame_local_attention`, batched as
     `[B*R, heads, P, hd]`), cost O(R * P^2): linear in the number of reference frames R.
   `reference_block_mask` + `dense_attention` is the plain version: one concatenated
   sequence [ref ; gen] with the asymmetric block mask.
2. Local temporal window attention (SR refiner, sec. 2.4): each generation frame's queries see
   generation frames within +-w (and optionally all valid reference tokens).
   `local_window_attention` gathers each frame's (2w+1)-frame neighbourhood and runs one batched
   SDPA `[B*T, heads, P, (2w+1)P + N_ref]`, O(T * P * (2w+1) P), never an N x N mask;
   `reference_block_mask(..., window=w)` is the dense masked version for tests.
3. Block-causal attention (Live Avatar sec. 4.1, Eq. 5): a video is a sequence of blocks of a
   few latent frames; a block's queries see the sink (reference frames, later the Adaptive
   Attention Sink frame, as cached K/V), the previous `history` blocks and themselves.
   `causal_block_attention` is one block against a rolling KV cache, in one SDPA call;
   `block_causal_mask` + `dense_attention` is the plain version over a whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    dt = q.dtype
    return F.scaled_dot_product_attention(q, k.to(dt), v.to(dt), attn_mask=mask)


def token_mask(frame_valid: torch.Tensor, tokens_per_frame: int) -> torch.Tensor:
    """[B, F] bool per-frame validity -> [B, F * P] bool per-token validity."""
    return frame_valid.repeat_interleave(tokens_per_frame, dim=1)


def sparse_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               ref_k: torch.Tensor | None, ref_v: torch.Tensor | None,
                               ref_key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Generation queries over [reference K/V ; generation K/V] in one SDPA call.

    q, k, v: `[B, H, N, hd]` generation tokens; ref_k, ref_v: `[B, H, Nr, hd]` cached reference
    K/V (RoPE applied) or None; ref_key_mask: `[B, Nr]` bool (False = invalid reference token,
    not attended) or None (all valid). Returns `[B, H, N, hd]`.
    """
    if ref_k is None or ref_k.shape[2] == 0:
        return _sdpa(q, k, v)
    kk = torch.cat([ref_k.to(q.dtype), k.to(q.dtype)], dim=2)
    vv = torch.cat([ref_v.to(q.dtype), v.to(q.dtype)], dim=2)
    mask = None
    if ref_key_mask is not None and not bool(ref_key_mask.all()):
        b, n = q.shape[0], k.shape[2]
        gen = torch.ones(b, n, dtype=torch.bool, device=q.device)
        mask = torch.cat([ref_key_mask.to(q.device), gen], dim=1)[:, None, None, :]  # [B,1,1,Nr+N]
    return _sdpa(q, kk, vv, mask)


def frame_local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          frames: int) -> torch.Tensor:
    """Self-attention restricted to each frame: q, k, v `[B, H, F*P, hd]` -> `[B, H, F*P, hd]`.

    Runs as one batched SDPA over `[B*F, H, P, hd]`; cost linear in the number of frames.
    """
    b, h, n, d = q.shape
    p = n // frames

    def fold(x: torch.Tensor) -> torch.Tensor:  # [B,H,F*P,hd] -> [B*F,H,P,hd]
        return x.reshape(b, h, frames, p, d).transpose(1, 2).reshape(b * frames, h, p, d)

    o = _sdpa(fold(q), fold(k), fold(v))  # [B*F, H, P, hd]
    return o.reshape(b, frames, h, p, d).transpose(1, 2).reshape(b, h, n, d)


def local_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frames: int,
                           window: int, ref_k: torch.Tensor | None = None,
                           ref_v: torch.Tensor | None = None,
                           ref_key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each frame's queries attend to the frames within +-window (plus all valid reference keys).

    q, k, v: `[B, H, T*P, hd]`; ref_k / ref_v: `[B, H, Nr, hd]` or None; ref_key_mask `[B, Nr]`
    bool or None. Blocked implementation: for every query frame the keys of its (2w+1)-frame
    neighbourhood are gathered (zero-padded at the edges and masked), then one SDPA call over
    `[B*T, H, P, Nr + (2w+1)P]`. Returns `[B, H, T*P, hd]`.
    """
    b, h, n, d = q.shape
    t = frames
    p = n // t
    span = 2 * window + 1
    dt = q.dtype
    qf = q.reshape(b, h, t, p, d).transpose(1, 2).reshape(b * t, h, p, d)

    def windows(x: torch.Tensor) -> torch.Tensor:  # [B,H,T*P,hd] -> [B*T,H,span*P,hd]
        x = x.to(dt).reshape(b, h, t, p, d)
        xp = F.pad(x, (0, 0, 0, 0, window, window))  # [B,H,T+2w,P,hd]
        st = torch.stack([xp[:, :, i:i + t] for i in range(span)], dim=3)  # [B,H,T,span,P,hd]
        return st.permute(0, 2, 1, 3, 4, 5).reshape(b * t, h, span * p, d)

    kw, vw = windows(k), windows(v)
    src = torch.arange(t)[:, None] + torch.arange(span)[None, :] - window  # [T, span]
    win_ok = ((src >= 0) & (src < t)).repeat_interleave(p, dim=1).to(q.device)  # [T, span*P]
    mask = win_ok[None].expand(b, t, span * p)  # [B, T, span*P]
    if ref_k is not None and ref_k.shape[2] > 0:
        nr = ref_k.shape[2]
        rk = ref_k.to(dt)[:, None].expand(b, t, h, nr, d).reshape(b * t, h, nr, d)
        rv = ref_v.to(dt)[:, None].expand(b, t, h, nr, d).reshape(b * t, h, nr, d)
        kw, vw = torch.cat([rk, kw], dim=2), torch.cat([rv, vw], dim=2)
        rm = (torch.ones(b, nr, dtype=torch.bool, device=q.device) if ref_key_mask is None
              else ref_key_mask.to(q.device))
        mask = torch.cat([rm[:, None].expand(b, t, nr), mask], dim=2)
    full = bool(mask.all())
    o = _sdpa(qf, kw, vw, None if full else mask.reshape(b * t, 1, 1, -1))  # [B*T,H,P,hd]
    return o.reshape(b, t, h, p, d).transpose(1, 2).reshape(b, h, n, d)


def reference_block_mask(ref_valid: torch.Tensor, tokens_per_frame: int, gen_frames: int,
                         window: int | None = None) -> torch.Tensor:
    """Dense asymmetric mask for one concatenated sequence [ref (R*P) ; gen (T*P)].

    ref_valid: `[B, R]` bool. Returns `[B, 1, M, M]` bool with M = (R + T) * P:
    - ref token i -> ref token j iff same frame (reference never sees generation tokens);
    - gen token -> every token of a valid reference frame;
    - gen token -> gen token: all, or only frames within +-window when window is given.
    """
    b, r = ref_valid.shape
    p, t = tokens_per_frame, gen_frames
    dev = ref_valid.device
    rf = torch.arange(r * p, device=dev) // p  # [R*P] frame of each ref token
    gf = torch.arange(t * p, device=dev) // p  # [T*P]
    rr = (rf[:, None] == rf[None, :])[None].expand(b, -1, -1)  # [B, Nr, Nr]
    rg = torch.zeros(b, r * p, t * p, dtype=torch.bool, device=dev)
    gr = token_mask(ref_valid, p)[:, None, :].expand(b, t * p, r * p)  # [B, N, Nr]
    if window is None:
        gg = torch.ones(t * p, t * p, dtype=torch.bool, device=dev)
    else:
        gg = (gf[:, None] - gf[None, :]).abs() <= window
    gg = gg[None].expand(b, -1, -1)
    top = torch.cat([rr, rg], dim=2)
    bottom = torch.cat([gr, gg], dim=2)
    return torch.cat([top, bottom], dim=1)[:, None]  # [B, 1, M, M]


def local_window_mask(frames: int, tokens_per_frame: int, window: int) -> torch.Tensor:
    """Dense `[T*P, T*P]` bool mask: token i may attend token j iff |frame(i) - frame(j)| <= window."""
    f = torch.arange(frames * tokens_per_frame) // tokens_per_frame
    return (f[:, None] - f[None, :]).abs() <= window


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """Plain masked attention: q, k, v `[B, H, M, hd]`, mask `[B|1, 1, M, M]` bool or None."""
    return _sdpa(q, k, v, mask)


def causal_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           sink: tuple[torch.Tensor, torch.Tensor] | None, sink_mask: torch.Tensor | None,
                           history: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """One block's queries over [sink K/V ; history K/V ; own K/V] in one SDPA call.

    q, k, v `[B, H, Pb, hd]`; sink K/V `[B, H, Nr, hd]` each with `sink_mask` `[B, Nr]` bool
    (None: all valid), or None; history `[B, H, Nh, hd]` each or None. Returns `[B, H, Pb, hd]`.
    """
    dt = q.dtype
    ks, vs, masks = [], [], []
    b = q.shape[0]
    if sink is not None and sink[0].shape[2] > 0:
        ks.append(sink[0])
        vs.append(sink[1])
        nr = sink[0].shape[2]
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
