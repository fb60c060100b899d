"""Batched chunk work: the chunks of several sessions through one model call per step.

Each function does for B sessions, in one batch, what the engine's stage does for one
(`AudioToVideoStage`, `SuperResStage`, `DecodePublishStage`), and writes the same fields back into
each session's record and rolling state; `tests/test_serve_batch.py` checks the results equal the
per-session stages (fp32: 1e-4).

Shapes allow a batch when the chunks have the same length (denoise) or the same emitted span (SR)
and, for decode, the same conv-cache layout (first chunk of a stream or not). Reference caches of
different lengths (an image vs a video reference, before/after the appearance anchor) are padded
to the longest with *masked* keys (`stack_references`), which attention ignores exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from avatarstream.cache.conv import ConvCache
from avatarstream.cache.reference import ReferenceCache
from avatarstream.engine.stage import ChunkRecord
from avatarstream.engine.stages.audio_to_video import guided_velocity, pack, scene_anchor, unpack
from avatarstream.engine.stages.decode_publish import to_uint8_frames
from avatarstream.models.dit import DiTCondition
from avatarstream.samplers import sample_euler
from avatarstream.serve.segment import TalkSegment

Item = tuple[ChunkRecord, TalkSegment]


def stack_references(caches: Sequence[ReferenceCache]) -> ReferenceCache:
    """B caches of batch 1 -> one cache of batch B; shorter ones padded with invalid frames."""
    if len(caches) == 1:
        return caches[0]
    r = max(c.num_frames for c in caches)
    p = caches[0].tokens_per_frame
    ks: list[list[torch.Tensor]] = [[] for _ in caches[0].k]
    vs: list[list[torch.Tensor]] = [[] for _ in caches[0].v]
    motion, valid = [], []
    for c in caches:
        if c.batch != 1 or c.tokens_per_frame != p:
            raise ValueError("stack_references takes caches of batch 1 from one model")
        pad = (r - c.num_frames) * p

        def padded(x: torch.Tensor) -> torch.Tensor:  # [1, H, Nr, hd] -> [1, H, r*P, hd]
            return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x

        for i in range(len(c.k)):
            ks[i].append(padded(c.k[i]))
            vs[i].append(padded(c.v[i]))
        motion.append(torch.nn.functional.pad(c.motion, (0, 0, 0, r - c.num_frames)))
        kv = (torch.ones(1, c.num_frames, dtype=torch.bool) if c.key_valid is None
              else c.key_valid.to(torch.bool).cpu())
        valid.append(torch.nn.functional.pad(kv, (0, r - c.num_frames), value=False))
    key_valid = torch.cat(valid, 0)  # [B, r]
    longest = max(caches, key=lambda c: c.num_frames)
    return ReferenceCache(
        k=[torch.cat(x, 0) for x in ks], v=[torch.cat(x, 0) for x in vs],
        motion=torch.cat(motion, 0), t_pos=longest.t_pos, tokens_per_frame=p,
        key_valid=None if bool(key_valid.all()) else key_valid.to(caches[0].k[0].device))


def _text(items: Sequence[Item]) -> tuple[torch.Tensor, torch.Tensor | None]:
    text = torch.cat([s.state.text for _, s in items], 0)  # [B, L, Dt]
    masks = [s.state.text_mask for _, s in items]
    return text, None if any(m is None for m in masks) else torch.cat(masks, 0)


def denoise_batch(items: Sequence[Item]) -> None:
    """AudioToVideoStage (Euler) for B chunks of equal length: writes lr_latents, motion."""
    a2v = items[0][1].rest[0]
    xs, ms, givens = [], [], []
    for rec, seg in items:
        x, m = rec.sigma_noise.clone(), rec.motion_noise.clone()  # [1, C, T, h, w], [1, T, Dm]
        for idx, lat, mot in seg.state.store.given(rec.plan):
            x[:, :, idx] = lat
            m[:, idx] = mot
        xs.append(x)
        ms.append(m)
        givens.append(rec.given)
    x, m = torch.cat(xs, 0), torch.cat(ms, 0)  # [B, C, T, h, w], [B, T, Dm]
    given = torch.cat(givens, 0)  # [B, T] bool
    gx = given[:, None, :, None, None].expand_as(x)
    gm = given[:, :, None].expand_as(m)
    x_clean, m_clean = x.clone(), m.clone()
    t = x.shape[2]
    t_pos = torch.arange(t, dtype=torch.float32)
    audio = torch.cat([rec.audio for rec, _ in items], 0)  # [B, T, A, Da]
    text, text_mask = _text(items)
    ref = stack_references([s.state.dit_reference for _, s in items])
    anchors = [scene_anchor(s.state) for _, s in items]
    anchor = None if any(a is None for a in anchors) else torch.cat(anchors, 0)  # [B, C, h, w]
    dit = a2v.dit
    guidance = None if a2v.guidance is None else a2v.guidance.expand(len(items), 2)  # [B, 2]

    def denoise(flat: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        xs_, ms_ = unpack(flat, x.shape, m.shape)
        xs_ = torch.where(gx, x_clean, xs_)  # given frames stay clean
        ms_ = torch.where(gm, m_clean, ms_)
        sig = torch.full(given.shape, float(sigma)).masked_fill(given, 0.0)  # [B, T]

        def velocity(tokens: torch.Tensor, reference):  # type: ignore[no-untyped-def]
            cond = DiTCondition(motion=ms_, audio=tokens, text=text, text_mask=text_mask, t_pos=t_pos,
                                guidance=guidance, anchor=anchor)
            out = dit.call("forward", xs_, sig, cond, reference)
            return out.velocity.float(), out.motion_velocity.float()

        v, mv = guided_velocity(velocity, audio, ref, a2v.cfg)
        return pack(v.masked_fill(gx, 0.0), mv.masked_fill(gm, 0.0))

    out = sample_euler(denoise, pack(x, m), a2v.sigmas)
    xo, mo = unpack(out, x.shape, m.shape)
    xo, mo = torch.where(gx, x_clean, xo), torch.where(gm, m_clean, mo)
    for i, (rec, _) in enumerate(items):
        rec.lr_latents, rec.motion = xo[i : i + 1], mo[i : i + 1]
    a2v.calls += 1


def refine_batch(items: Sequence[Item]) -> None:
    """SuperResStage for B chunks with the same emitted span: writes hr_latents, stores them."""
    sr = items[0][1].rest[1]
    if sr.refiner is None:  # a direct model: nothing to refine
        for rec, seg in items:
            sr.run(rec, seg.state)
        return
    lrs, noises, motions, audios = [], [], [], []
    spans = []
    for rec, _ in items:
        e0, e1 = rec.plan.emit
        c0 = max(0, e0 - sr.window)
        lr = rec.lr_latents[:, :, c0:e1]  # [1, C, E', h, w]
        b, c, t, h, w = lr.shape
        g = torch.Generator().manual_seed(sr.seed * 104_729 + rec.plan.id)
        noises.append(torch.randn(b, c, t, 2 * h, 2 * w, generator=g))  # [1, C, E', 2h, 2w]
        lrs.append(lr)
        motions.append(rec.motion[:, c0:e1])
        audios.append(rec.audio[:, c0:e1])
        spans.append((c0, e0))
    t = lrs[0].shape[2]
    text, text_mask = _text(items)
    cond = DiTCondition(motion=torch.cat(motions, 0), audio=torch.cat(audios, 0), text=text,
                        text_mask=text_mask, t_pos=torch.arange(t, dtype=torch.float32))
    ref = stack_references([s.state.refiner_reference for _, s in items])
    hr = sr.refiner.call("refine", torch.cat(lrs, 0), torch.cat(noises, 0), cond, ref,
                         sigma=sr.sigma)
    for i, (rec, seg) in enumerate(items):
        c0, e0 = spans[i]
        rec.hr_latents = hr[i : i + 1, :, e0 - c0 :].float()  # [1, C, E, 2h, 2w]
        seg.state.store.put(rec.plan, rec.lr_latents, rec.motion, rec.hr_latents)
    sr.calls += 1


def _cache_key(cache: ConvCache) -> tuple:
    return tuple(sorted((k, tuple(v.shape[1:])) for k, v in cache.frames.items()))


@dataclass
class DecodeJob:
    """The VAE decode and publication of one round's chunks (`finish_prepare` made it): groups of
    (segment, refined latents `[1, C, E, H/8, W/8]`, first frame, frame count) that share a
    conv-cache layout, decoded one call per group. Touches only the segments' VAE conv caches,
    `frames_published` and outlets, so it may run on a thread of its own while the next round is
    denoised (`ChunkScheduler(decode_overlap=True)`), one job after the other."""

    groups: list[list[tuple[TalkSegment, torch.Tensor, int, int]]] = field(default_factory=list)

    @property
    def segments(self) -> list[TalkSegment]:
        return [seg for g in self.groups for seg, _, _, _ in g]

    def run(self) -> None:
        for group in self.groups:
            seg0 = group[0][0]
            vae = seg0.rest[-1].vae
            cache = ConvCache("decode")
            for key in seg0.state.vae_cache.frames:
                cache.frames[key] = torch.cat([s.state.vae_cache.frames[key] for s, _, _, _ in group], 0)
            frames = vae.call("decode_step", torch.cat([hr for _, hr, _, _ in group], 0), cache)
            for i, (seg, _, start, n) in enumerate(group):
                st = seg.state
                for key, val in cache.frames.items():
                    st.vae_cache.frames[key] = val[i : i + 1].clone()
                st.vae_cache.bind("decode")
                st.vae_cache.chunks += 1
                n = max(0, min(n, frames.shape[2]))
                if n:
                    stage = seg.rest[-1]
                    stage.publisher.put_video(to_uint8_frames(frames[i, :, :n]), start, stage.fps)
                    st.frames_published = start + n


def finish_prepare(items: Sequence[Item]) -> DecodeJob:
    """The stages after SR, up to the decode: appearance anchor (per session), then what the
    round's decode needs, taken from each session's rolling state here, in the caller's thread
    (the store is the denoising thread's). Chunks that publish exactly themselves go into the
    returned job, grouped by conv-cache layout; any other chunk (the interp schedule's I/N
    pairs) is decoded and published here, on its own."""
    groups: dict[tuple, list[tuple[TalkSegment, torch.Tensor, int, int]]] = defaultdict(list)
    for rec, seg in items:
        for stage in seg.rest[2:-1]:  # the appearance anchor
            stage(rec, seg.state)
        if rec.plan.publish != (rec.plan.id,):
            seg.rest[-1](rec, seg.state)
            seg._release(rec)
            continue
        st = seg.state
        hr = st.store.take_emitted(rec.plan.id)  # [1, C, E, H/8, W/8]
        key = (tuple(hr.shape), _cache_key(st.vae_cache), st.frames_emitted == 0)
        # causal VAE: the stream's first latent decodes to one frame, every later one to four
        start = st.frames_emitted
        n = 4 * hr.shape[2] - (3 if start == 0 else 0)
        if st.total_frames is not None:
            n = max(0, min(n, st.total_frames - start))
        st.frames_emitted = start + n
        groups[key].append((seg, hr, start, n))
        seg._release(rec)
    return DecodeJob(list(groups.values()))


def finish_batch(items: Sequence[Item]) -> None:
    """The stages after SR: appearance anchor (per session), then DecodePublishStage batched
    (`finish_prepare`, then its decode job run here)."""
    finish_prepare(items).run()
