"""VideoRef DiT, SR refiner, attention patterns and the reference cache (tiny configs, fp32)."""

from __future__ import annotations

import argparse

import pytest
import torch

from avatarstream.cache.reference import ReferenceCache
from avatarstream.models.attention import (dense_attention, frame_local_attention,
                                           local_window_attention, local_window_mask,
                                           reference_block_mask, sparse_reference_attention)
from avatarstream.models.dit import DiTConfig, VideoRefDiT
from avatarstream.models.refiner import RefinerConfig, SRRefiner
from avatarstream.models.transformer import DiTCondition

B, T, R = 2, 3, 4
TOL = 1e-5


def _dit() -> VideoRefDiT:
    m = VideoRefDiT(DiTConfig.tiny()).eval()
    m.init_random_(0)
    return m


def _refiner() -> SRRefiner:
    m = SRRefiner(RefinerConfig.tiny()).eval()
    m.init_random_(1)
    return m


def _cond(t: int = T, seed: int = 0) -> DiTCondition:
    g = torch.Generator().manual_seed(seed)
    return DiTCondition(motion=torch.randn(B, t, 4, generator=g),
                        audio=torch.randn(B, t, 6, 16, generator=g),
                        text=torch.randn(B, 5, 16, generator=g),
                        text_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool),
                        t_pos=torch.arange(t, dtype=torch.float32))


def _inputs(seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 4, T, 4, 4, generator=g)
    sigma = torch.rand(B, T, generator=g)
    sigma[:, 0] = 0.0  # a given frame
    ref = torch.randn(B, 4, R, 4, 4, generator=g)
    return x, sigma, ref, torch.full((R,), -8.0)


# frame 1 invalid for the whole batch (dropped), frame 2 invalid for batch element 1 (masked)
INVALID = torch.tensor([[1, 0, 1, 1], [1, 0, 0, 1]], dtype=torch.bool)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max())


# -- attention helpers -------------------------------------------------------------------------


def test_attention_helpers_match_dense_masks() -> None:
    g = torch.Generator().manual_seed(0)
    h, p, d, r, t = 2, 3, 8, 3, 4
    valid = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    q, k, v = (torch.randn(B, h, (r + t) * p, d, generator=g) for _ in range(3))
    dense = dense_attention(q, k, v, reference_block_mask(valid, p, t))
    nr = r * p
    ref_out = frame_local_attention(q[:, :, :nr], k[:, :, :nr], v[:, :, :nr], r)
    gen_out = sparse_reference_attention(q[:, :, nr:], k[:, :, nr:], v[:, :, nr:], k[:, :, :nr],
                                         v[:, :, :nr], valid.repeat_interleave(p, 1))
    assert _diff(torch.cat([ref_out, gen_out], 2), dense) <= TOL
    # windowed generation attention (+ reference keys) vs its dense mask
    dense_w = dense_attention(q, k, v, reference_block_mask(valid, p, t, window=1))
    win = local_window_attention(q[:, :, nr:], k[:, :, nr:], v[:, :, nr:], t, 1, k[:, :, :nr],
                                 v[:, :, :nr], valid.repeat_interleave(p, 1))
    assert _diff(win, dense_w[:, :, nr:]) <= TOL
    qg, kg, vg = q[:, :, nr:], k[:, :, nr:], v[:, :, nr:]
    plain = dense_attention(qg, kg, vg, local_window_mask(t, p, 1))
    assert _diff(local_window_attention(qg, kg, vg, t, 1), plain) <= TOL


# -- DiT ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("valid", [None, INVALID], ids=["all-valid", "some-invalid"])
def test_sparse_equals_dense(valid) -> None:  # type: ignore[no-untyped-def]
    dit = _dit()
    x, sigma, ref, tp = _inputs()
    cond = _cond()
    with torch.no_grad():
        cache = dit.encode_reference(ref, valid, tp)
        out = dit(x, sigma, cond, cache)
        dense = dit.forward_dense(x, sigma, cond, ref, valid, tp)
    assert out.velocity.shape == (B, 4, T, 4, 4) and out.motion_velocity.shape == (B, T, 4)
    assert _diff(out.velocity, dense.velocity) <= TOL
    assert _diff(out.motion_velocity, dense.motion_velocity) <= TOL
    if valid is not None:
        assert cache.num_frames == 3  # the frame invalid everywhere is never computed
        assert cache.key_valid is not None and cache.k[0].shape[2] == 3 * cache.tokens_per_frame


def test_cached_equals_uncached() -> None:
    dit = _dit()
    x, sigma, ref, tp = _inputs()
    cond = _cond()
    with torch.no_grad():
        cache = dit.encode_reference(ref, INVALID, tp)
        a = dit(x, sigma, cond, cache)
        b = dit.forward_uncached(x, sigma, cond, ref, INVALID, tp)
    assert _diff(a.velocity, b.velocity) <= TOL
    assert _diff(a.motion_velocity, b.motion_velocity) <= TOL
    assert cache.nbytes() > 0


def test_output_depends_on_every_input() -> None:
    dit = _dit()
    x, sigma, ref, tp = _inputs()
    cond = _cond()
    with torch.no_grad():
        base = dit(x, sigma, cond, dit.encode_reference(ref, None, tp))

        def changed(out) -> bool:  # type: ignore[no-untyped-def]
            return _diff(out.velocity, base.velocity) > 1e-4 and \
                _diff(out.motion_velocity, base.motion_velocity) > 1e-6

        c = _cond()
        c.audio = c.audio + 1.0
        assert changed(dit(x, sigma, c, dit.encode_reference(ref, None, tp)))
        c = _cond()
        c.text = c.text.flip(1)
        assert changed(dit(x, sigma, c, dit.encode_reference(ref, None, tp)))
        assert changed(dit(x, sigma, cond, dit.encode_reference(ref + 1.0, None, tp)))
        assert changed(dit(x, sigma * 0.5, cond, dit.encode_reference(ref, None, tp)))
        c = _cond()
        c.motion = c.motion + 1.0
        assert changed(dit(x, sigma, c, dit.encode_reference(ref, None, tp)))
        # per-frame audio: changing frame 2's audio changes frame 2 most directly
        c = _cond()
        c.audio[:, 2] += 1.0
        out = dit(x, sigma, c, dit.encode_reference(ref, None, tp))
        assert _diff(out.velocity[:, :, 2], base.velocity[:, :, 2]) > 1e-4
        # reference motion tokens exist and depend on the reference
        m1, m2 = dit.extract_motion(ref), dit.extract_motion(ref + 1.0)
        assert m1.shape == (B, R, 4) and _diff(m1, m2) > 1e-4


def test_rope_temporal_shift_invariance() -> None:
    dit = _dit()
    x, sigma, ref, tp = _inputs()
    cond = _cond()
    shifted = _cond()
    shifted.t_pos = cond.t_pos + 37.0
    with torch.no_grad():
        a = dit(x, sigma, cond, dit.encode_reference(ref, None, tp))
        b = dit(x, sigma, shifted, dit.encode_reference(ref, None, tp + 37.0))
        c = dit(x, sigma, shifted, dit.encode_reference(ref, None, tp))  # relative shift changes
    assert _diff(a.velocity, b.velocity) <= 1e-4
    assert _diff(a.velocity, c.velocity) > 1e-4


def test_reference_cache_concat_equals_joint_encoding() -> None:
    dit = _dit()
    x, sigma, ref, tp = _inputs()
    cond = _cond()
    anchor = torch.randn(1, 4, 1, 4, 4)
    with torch.no_grad():
        joined = dit.encode_reference(ref, INVALID, tp).concat(
            dit.encode_reference(anchor, None, torch.full((1,), -8.0)))
        full = dit.encode_reference(torch.cat([ref, anchor.expand(B, -1, -1, -1, -1)], 2),
                                    torch.cat([INVALID, torch.ones(B, 1, dtype=torch.bool)], 1),
                                    torch.full((R + 1,), -8.0))
        assert isinstance(joined, ReferenceCache) and joined.num_frames == full.num_frames == 4
        for a, b in zip(joined.k + joined.v, full.k + full.v):
            assert _diff(a, b) <= TOL
        assert torch.equal(joined.key_valid, full.key_valid)
        assert _diff(dit(x, sigma, cond, joined).velocity, dit(x, sigma, cond, full).velocity) <= TOL


def test_bf16_autocast_runs() -> None:
    dit, ref_net = _dit(), _refiner()
    x, sigma, ref, tp = _inputs()
    cond = _cond()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = dit(x, sigma, cond, dit.encode_reference(ref, INVALID, tp))
        hr_ref = ref_net.encode_reference(torch.randn(B, 4, R, 8, 8), INVALID, tp)
        hr = ref_net.refine(torch.randn(B, 4, T, 4, 4), torch.randn(B, 4, T, 8, 8), cond, hr_ref)
    assert torch.isfinite(out.velocity.float()).all() and torch.isfinite(hr.float()).all()
    assert hr.shape == (B, 4, T, 8, 8)


# -- refiner -----------------------------------------------------------------------------------


@pytest.mark.parametrize("valid", [None, INVALID], ids=["all-valid", "some-invalid"])
def test_refiner_window_equals_dense(valid) -> None:  # type: ignore[no-untyped-def]
    net = _refiner()
    g = torch.Generator().manual_seed(3)
    t = 4  # window 1 over 4 frames: frames 0 and 3 never see each other
    hr_ref = torch.randn(B, 4, R, 8, 8, generator=g)
    xn, up = torch.randn(B, 4, t, 8, 8, generator=g), torch.randn(B, 4, t, 8, 8, generator=g)
    cond = _cond(t)
    tp = torch.full((R,), -8.0)
    with torch.no_grad():
        a = net(xn, up, 0.6, cond, net.encode_reference(hr_ref, valid, tp))
        b = net.forward_dense(xn, up, 0.6, cond, hr_ref, valid, tp)
        # the window is real: frame 3's input does not reach frame 0's output in one layer stack
        # of depth 2 with window 1 (receptive field 2 frames)
        xn2 = xn.clone()
        xn2[:, :, 3] += 1.0
        c = net(xn2, up, 0.6, cond, net.encode_reference(hr_ref, valid, tp))
    assert a.shape == (B, 4, t, 8, 8)
    assert _diff(a, b) <= TOL
    assert _diff(c[:, :, 0], a[:, :, 0]) <= TOL and _diff(c[:, :, 3], a[:, :, 3]) > 1e-4


def test_refine_one_euler_step() -> None:
    net = _refiner()
    g = torch.Generator().manual_seed(4)
    lr, noise = torch.randn(B, 4, T, 4, 4, generator=g), torch.randn(B, 4, T, 8, 8, generator=g)
    cond = _cond()
    with torch.no_grad():
        ref = net.encode_reference(torch.randn(B, 4, R, 8, 8, generator=g), None,
                                   torch.full((R,), -8.0))
        out = net.refine(lr, noise, cond, ref, sigma=0.6)
        from avatarstream.models.refiner import upsample2x
        up = upsample2x(lr)
        x = 0.4 * up + 0.6 * noise
        v = net(x, up, torch.full((B, T), 0.6), cond, ref)
    assert _diff(out, x - 0.6 * v) <= TOL
    assert _diff(out, net.refine(lr, noise, cond, ref, sigma=0.3)) > 1e-4


# -- benchmarks --------------------------------------------------------------------------------


def test_bench_attention_quick() -> None:
    from avatarstream.bench import attention

    out = attention.run(argparse.Namespace(quick=True))
    for key in ("sparse_exponent", "dense_exponent", "ref_frames", "sparse_ms", "dense_ms"):
        assert key in out
    assert len(out["sparse_ms"]) == len(out["ref_frames"]) == len(out["dense_ms"])


def test_bench_cache_quick() -> None:
    from avatarstream.bench import cache

    out = cache.run(argparse.Namespace(quick=True))
    assert {"speedup", "cached_ms", "uncached_ms"} <= set(out)
    assert out["cached_ms"] > 0 and out["uncached_ms"] > 0


# -- scene anchor --------------------------------------------------------------------------------


def test_anchor_input_sparse_equals_dense_and_matters() -> None:
    dit = _dit()
    x, sigma, ref, tp = _inputs()
    cond = _cond()
    cond.anchor = torch.randn(B, 4, 4, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = dit.encode_reference(ref, INVALID, tp)
        out = dit(x, sigma, cond, cache)
        dense = dit.forward_dense(x, sigma, cond, ref, INVALID, tp)
        assert _diff(out.velocity, dense.velocity) <= TOL
        assert _diff(out.motion_velocity, dense.motion_velocity) <= TOL
        # every generated frame sees the anchor; no anchor is an all-zero anchor
        none = dit(x, sigma, _cond(), cache)
        zero = _cond()
        zero.anchor = torch.zeros(B, 4, 4, 4)
        zero_out = dit(x, sigma, zero, cache)
    for f in range(T):
        assert _diff(out.velocity[:, :, f], none.velocity[:, :, f]) > 1e-4
    # a zero anchor adds only the embedding's bias; without the bias it is no anchor at all
    with torch.no_grad():
        dit.anchor_embedding.bias.zero_()
        assert _diff(dit(x, sigma, zero, cache).velocity, dit(x, sigma, _cond(), cache).velocity) <= TOL
    assert _diff(zero_out.velocity, none.velocity) > 0  # the bias did act


def test_x0_skip_velocity_puts_the_noise_around_the_network() -> None:
    """`x0_skip`: x − σ·v equals the head's x̂0 − anchor plus the anchor for every σ > 0 (the
    noise in x never passes through the tokens; tolerance 1e-5); with a zero head one Euler step
    from any σ to 0 lands on the anchor; sparse = dense still holds."""
    import dataclasses

    cfg = dataclasses.replace(DiTConfig.tiny(), x0_skip=True)
    m = VideoRefDiT(cfg).eval()
    m.init_random_(0)
    x, sigma, ref, t_ref = _inputs()
    sigma = sigma.clamp_min(0.1)  # no frame given clean here
    anchor = torch.randn(B, 4, 4, 4, generator=torch.Generator().manual_seed(3))
    cond = dataclasses.replace(_cond(), anchor=anchor)
    plain = VideoRefDiT(DiTConfig.tiny()).eval()  # same weights, the head's output as velocity
    plain.load_state_dict(m.state_dict())
    with torch.no_grad():
        out = m(x, sigma, cond, m.encode_reference(ref, None, t_ref))
        head = plain(x, sigma, cond, plain.encode_reference(ref, None, t_ref)).velocity
        x0 = x - sigma[:, None, :, None, None] * out.velocity
        assert _diff(x0, head + anchor[:, :, None]) <= TOL
        dense = m.forward_dense(x, sigma, cond, ref, None, t_ref)
        assert _diff(dense.velocity, out.velocity) <= 1e-4
        for p in (m.head.head.weight, m.head.head.bias):
            p.zero_()
        v = m(x, sigma, cond, m.encode_reference(ref, None, t_ref)).velocity
        assert _diff(x - sigma[:, None, :, None, None] * v, anchor[:, :, None].expand_as(x)) <= TOL
