"""Causal streaming (Live Avatar): the rolling KV cache computes what the plain block-causal pass
computes, its memory is bounded, and the Rolling Sink Frame switches change what they claim to.
The DiT's causal forwards themselves: tests/models/test_causal_dit.py.

Tolerance of cached vs plain: 1e-5 absolute on velocities of order 1 in float32 (the two paths
sum the same attention terms in different orders; measured ~2e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from avatarstream.cache.kv import BlockKV, RollingKVCache
from avatarstream.engine.causal import CausalDenoiser, CausalSettings
from avatarstream.engine.module import Module
from avatarstream.engine.schedule import CausalSchedule, GivenFrame
from avatarstream.models.dit import VideoRefDiT
from avatarstream.models.transformer import DiTCondition
from avatarstream.samplers import flow_sigmas

from models.test_causal_dit import R, dit, reference  # noqa: F401 - dit: the shared fixture

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
STEPS = 3


def rollout(dit: VideoRefDiT, settings: CausalSettings, blocks: int, *, seed: int = 1,
            record: bool = False, parallel: bool | None = None, sampler: str = "euler"):  # type: ignore[no-untyped-def]
    """Run `blocks` blocks of Algorithm 3 on random inputs (the same for the same seed).
    Returns (denoiser, per-block outputs, per-block records, per-block audio, sinks seen, text)."""
    den = CausalDenoiser(Module("dit", dit), flow_sigmas(STEPS), settings, parallel_history=parallel,
                         sampler=sampler)
    ref, valid = reference()
    den.start(dit.encode_reference(ref, valid, torch.full((R,), settings.ref_t_position)))
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(1, 5, 16, generator=g)
    outs, recs, audios, sinks = [], [], [], []
    for i in range(blocks):
        pos = list(range(3 * i, 3 * i + 3))
        x, m = torch.randn(1, 4, 3, 4, 4, generator=g), torch.randn(1, 3, 4, generator=g)
        a = torch.randn(1, 3, 6, 16, generator=g)
        sinks.append((den.sink.replaced, den.rolling_rope_position(pos[0])))
        rec: list = []
        with torch.inference_mode():
            xo, mo = den.denoise(x, m, audio=a, text=text, text_mask=None, positions=pos, block=i,
                                 record=rec if record else None)
            if i == 0 and settings.adaptive_sink:
                den.adaptive_attention_sink(xo[:, :, :1])
        outs.append((xo, mo))
        recs.append(rec)
        audios.append(a)
    return den, outs, recs, audios, sinks, text


@pytest.mark.parametrize("adaptive_sink", [False, True])
@pytest.mark.parametrize("rolling_rope", [False, True])
def test_cached_path_equals_plain_block_causal_path(dit, adaptive_sink, rolling_rope):
    """Every step of every block: the streaming path (rolling cache of 2 blocks, cached sink moved
    by a key rotation) equals one dense pass over all blocks' inputs at that step with the
    block-causal sliding-window mask and the sink recomputed from latents at each placement."""
    nb, hist = 8, 2
    s = CausalSettings(kv_blocks=hist, adaptive_sink=adaptive_sink, rolling_rope=rolling_rope)
    den, outs, recs, audios, sinks, text = rollout(dit, s, nb, record=True)
    ref, valid = reference()
    first = outs[0][0][:, :, :1]
    copies, index = [], []
    for replaced, pos in sinks:  # one sink copy per distinct (sink, placement)
        key = (replaced, pos)
        if key not in [c[3] for c in copies]:
            copies.append((first, None, pos, key) if replaced else (ref, valid, pos, key))
        index.append([c[3] for c in copies].index(key))
    assert len(copies) == (1 + adaptive_sink + (nb - hist - 1) * rolling_rope)
    for j in range(STEPS):
        x = torch.cat([recs[i][j][1] for i in range(nb)], 2)  # [1, C, 3 nb, h, w] inputs at step j
        m = torch.cat([recs[i][j][2] for i in range(nb)], 1)
        sigma = torch.full((1, 3 * nb), float(flow_sigmas(STEPS)[j]))
        cond = DiTCondition(motion=m, audio=torch.cat(audios, 1), text=text,
                            t_pos=torch.arange(3 * nb, dtype=torch.float32))
        with torch.no_grad():
            out = dit.forward_block_causal(x, sigma, cond, [c[:3] for c in copies], index,
                                           block=3, history=hist)
        v = torch.cat([recs[i][j][3] for i in range(nb)], 2)
        mv = torch.cat([recs[i][j][4] for i in range(nb)], 1)
        assert float((out.velocity - v).abs().max()) <= TOL
        assert float((out.motion_velocity - mv).abs().max()) <= TOL


def test_next_history_level_caches_each_step_output(dit):
    """history_level "next": what a block leaves in step j's cache is the K/V of its state after
    step j (the next step's input, and after the last step the finished block at σ = 0), each
    computed against step j's history as it was; "same" leaves its step-j input's. Exact: the same
    forward on the same tensors (tolerance 1e-6)."""
    sig = flow_sigmas(STEPS)
    assert float(sig[-1]) == 0.0
    for level in ("same", "next"):
        s = CausalSettings(kv_blocks=2, adaptive_sink=False, history_level=level)
        den, outs, recs, audios, sinks, text = rollout(dit, s, 1, record=True)
        rec, (x_fin, m_fin) = recs[0], outs[0]
        sink = den.sink.at(den.rolling_rope_position(0))
        for j in range(STEPS):
            if level == "same":
                x, m, sigma = rec[j][1], rec[j][2], sig[j]
            elif j + 1 < STEPS:
                x, m, sigma = rec[j + 1][1], rec[j + 1][2], sig[j + 1]
            else:
                x, m, sigma = x_fin, m_fin, sig[-1]
            cond = DiTCondition(motion=m, audio=audios[0], text=text,
                                t_pos=torch.arange(3, dtype=torch.float32))
            with torch.no_grad():
                _, kv = dit.forward_causal_block(x, torch.full((1, 3), float(sigma)), cond, sink, None)
            for i in range(dit.config.depth):
                k, v = den.caches[j].layer(i)
                assert float((k - kv.k[i]).abs().max()) <= 1e-6
                assert float((v - kv.v[i]).abs().max()) <= 1e-6
    same = rollout(dit, CausalSettings(kv_blocks=2), 3)[1]
    nxt = rollout(dit, CausalSettings(kv_blocks=2, history_level="next"), 3)[1]
    assert torch.equal(same[0][0], nxt[0][0])  # the first block reads no history: the same
    assert float((same[2][0] - nxt[2][0]).abs().max()) > 1e-3  # later blocks read other history
    with pytest.raises(ValueError, match="history_level"):
        CausalSettings(history_level="clean")


@pytest.mark.parametrize("sampler", ["euler", "stochastic"])
def test_parallel_history_pass_is_the_sequential_one(dit, sampler):
    """history_level "next" with each step's extra forward on a thread of its own beside the next
    step (`parallel_history`): every block's output and every cache equal the sequential run's,
    bit for bit (tolerance 0: the same forwards on the same tensors, on another thread)."""
    s = CausalSettings(kv_blocks=2, history_level="next")
    seq = rollout(dit, s, 4, parallel=False, sampler=sampler)
    par = rollout(dit, s, 4, parallel=True, sampler=sampler)
    assert not seq[0].parallel_history and par[0].parallel_history
    for (xa, ma), (xb, mb) in zip(seq[1], par[1]):
        assert torch.equal(xa, xb) and torch.equal(ma, mb)
    for j in range(STEPS):
        for i in range(dit.config.depth):
            assert all(torch.equal(a, b) for a, b in zip(seq[0].caches[j].layer(i), par[0].caches[j].layer(i)))
    assert not CausalDenoiser(Module("dit", dit), flow_sigmas(STEPS), CausalSettings(),
                              parallel_history=True).parallel_history  # "same": nothing to overlap


def test_kv_cache_memory_is_constant_over_many_blocks(dit):
    den, *_ = rollout(dit, CausalSettings(kv_blocks=4), 30)
    sizes = []
    den2 = CausalDenoiser(Module("dit", dit), flow_sigmas(STEPS), CausalSettings(kv_blocks=4))
    ref, valid = reference()
    den2.start(dit.encode_reference(ref, valid, torch.full((R,), -8.0)))
    ptrs = None
    g = torch.Generator().manual_seed(0)
    for i in range(40):
        with torch.inference_mode():
            den2.denoise(torch.randn(1, 4, 3, 4, 4, generator=g), torch.randn(1, 3, 4, generator=g),
                         audio=torch.randn(1, 3, 6, 16, generator=g), text=torch.zeros(1, 1, 16),
                         text_mask=None, positions=[3 * i, 3 * i + 1, 3 * i + 2], block=i)
            if i == 0:
                den2.adaptive_attention_sink(torch.randn(1, 4, 1, 4, 4, generator=g))
        sizes.append(den2.nbytes())
        if i == 1:
            ptrs = [c.k[0].data_ptr() for c in den2.caches.values()]
    assert all(c.held == 4 for c in den2.caches.values())
    assert len(den2.caches) == STEPS  # one cache per denoising step (timestep forcing)
    assert len(set(sizes[6:])) == 1 and sizes[-1] == den.nbytes()  # flat from block 6 on
    assert max(sizes) <= sizes[-1]  # the sink shrinks at AAS; nothing grows
    assert [c.k[0].data_ptr() for c in den2.caches.values()] == ptrs  # a ring: no reallocation
    # steps x layers x (k, v) x [1, heads 2, 4 blocks x 15 tokens, hd 16] float32, + the sink
    assert sizes[-1] == STEPS * 2 * 2 * (2 * 4 * 15 * 16) * 4 + den2.sink.nbytes()


def test_rolling_cache_ring_keeps_the_last_blocks():
    cache = RollingKVCache(layers=1, capacity=3)
    assert cache.layer(0) is None and cache.window_start() is None
    for i in range(5):
        t = torch.full((1, 1, 2, 1), float(i))
        cache.append(BlockKV([t], [t + 10]), position=3 * i)
    k, v = cache.layer(0)
    assert sorted(k.flatten().tolist()) == [2, 2, 3, 3, 4, 4] and cache.window_start() == 6
    assert v.min() == 12 and cache.held == 3
    with pytest.raises(ValueError):
        cache.append(BlockKV([torch.zeros(1, 1, 3, 1)], [torch.zeros(1, 1, 3, 1)]), 15)


def test_rolling_rope_moves_only_the_sink(dit):
    """Rolling RoPE places the sink `ref_t_position` before the oldest block attended to: nothing
    changes while the window still starts at frame 0 (blocks 0..kv_blocks), everything after."""
    on, outs_on, *_, sinks_on, _ = rollout(dit, CausalSettings(kv_blocks=2, adaptive_sink=False), 6)
    off, outs_off, *_, sinks_off, _ = rollout(dit, CausalSettings(kv_blocks=2, adaptive_sink=False,
                                                                 rolling_rope=False), 6)
    assert [p for _, p in sinks_off] == [-8.0] * 6
    assert [p for _, p in sinks_on] == [-8.0, -8.0, -8.0, -5.0, -2.0, 1.0]  # window start - 8
    for i in range(3):
        assert torch.equal(outs_on[i][0], outs_off[i][0])
    for i in range(3, 6):
        assert float((outs_on[i][0] - outs_off[i][0]).abs().max()) > 1e-3
    # relative distance from the sink to the current block's first frame stays <= 8 + 3 * kv_blocks
    assert max(3 * i - p for i, (_, p) in enumerate(sinks_on)) == 8 + 3 * 2


def test_adaptive_sink_replaces_reference_after_first_block(dit):
    aas, outs_a, *_ = rollout(dit, CausalSettings(kv_blocks=2), 3)
    plain, outs_p, *_ = rollout(dit, CausalSettings(kv_blocks=2, adaptive_sink=False), 3)
    assert torch.equal(outs_a[0][0], outs_p[0][0])  # block 0 sees the reference either way
    assert float((outs_a[1][0] - outs_p[1][0]).abs().max()) > 1e-3
    assert aas.sink.replaced and aas.sink.frames == 1 and not plain.sink.replaced
    expect = dit.encode_reference(outs_a[0][0][:, :, :1], None, torch.full((1,), -8.0))
    for a, b in zip(aas.sink.base.k, expect.k):
        assert float((a - b).abs().max()) <= TOL


def test_causal_schedule_blocks_with_one_context_frame():
    s = CausalSchedule(block=3)
    plans = [s.next_chunk(None) for _ in range(3)]
    assert plans[0].positions == (0, 1, 2) and plans[0].emit == (0, 3) and plans[0].keep == (2,)
    assert plans[1].positions == (2, 3, 4, 5) and plans[1].emit == (1, 4)
    assert plans[1].given == (GivenFrame(0, 0, 2),) and plans[1].keep == (3,)
    assert plans[2].given == (GivenFrame(0, 1, 3),) and plans[2].release == (1,)
    assert s.horizon() == 12
    assert s.next_chunk(10).positions == (8, 9, 10, 11)  # whole blocks; the pipeline trims
    assert s.next_chunk(10) is None


# -- the causal strategy in the chunk loop (tiny-random) ------------------------------------------
def run_causal(seconds: float, **over: object):  # type: ignore[no-untyped-def]
    from avatarstream.bench.inputs import face_image, speechlike
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.eval.benchmark import CollectSink
    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    models.config.strategy = "causal"
    for k, v in over.items():
        setattr(models.config, k, v)
    ref = torch.from_numpy(face_image(64)).permute(2, 0, 1).unsqueeze(0)
    sink = CollectSink()
    summary = Pipeline(models).run(ref, iter(torch.from_numpy(speechlike(seconds)).split(3200)), [sink])
    return summary, sink


@pytest.mark.parametrize("seconds", [0.05, 1.0, 3.37])
def test_causal_pipeline_publishes_every_frame_in_blocks(seconds):
    summary, sink = run_causal(seconds)
    n = round(seconds * 25)
    assert summary.frames == len(sink.frames) == n
    # block 0: latents 0-2 = 9 frames, its first frame published alone first; then 12 frames
    # (3 latents) per block
    assert sink.chunk_starts == [s for s in [0, 1] + list(range(9, n, 12)) if s < n]
    assert "causal_denoise" in summary.stage_ms and "appearance_anchor" not in summary.stage_ms


def test_causal_rolling_state_does_not_grow_with_duration():
    a, _ = run_causal(12.0)
    b, _ = run_causal(40.0)
    assert a.rolling_state_bytes == b.rolling_state_bytes > 0


def test_causal_switches_reach_the_pipeline():
    """The ablation switches change the video (after the first block), nothing before."""
    _, base = run_causal(3.0)
    _, no_aas = run_causal(3.0, adaptive_sink=False)
    _, no_rr = run_causal(5.0, rolling_rope=False, kv_blocks=1)
    _, rr = run_causal(5.0, kv_blocks=1)
    a, b = np.stack(base.frames), np.stack(no_aas.frames)
    assert np.array_equal(a[:9], b[:9]) and not np.array_equal(a[9:], b[9:])
    c, d = np.stack(rr.frames), np.stack(no_rr.frames)
    assert np.array_equal(c[:21], d[:21]) and not np.array_equal(c[21:], d[21:])
