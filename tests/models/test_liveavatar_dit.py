"""LiveAvatar's DiT (`models/liveavatar/`): the full 14B config key for key against the official
list on the meta device, and at the tiny config the pieces the engine and the parallel executors
rely on: the text K/V cache, the pluggable attention, hooks on `blocks`, the ring and the rolling
sink, on non-square latents."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from avatarstream.models.liveavatar import (KVRing, LiveAvatarBlock, LiveAvatarConfig, LiveAvatarDiT,
                                            TextKV, reference_time, sdpa_attention)

KEYS = Path(__file__).resolve().parents[1] / "fixtures" / "real-models" / "s2v14b_keys.json"
pytestmark = pytest.mark.usefixtures("one_thread")


def test_full_config_has_the_official_keys_shapes_and_count() -> None:
    official = {k: tuple(v) for k, v in json.loads(KEYS.read_text()).items()}
    with torch.device("meta"):
        net = LiveAvatarDiT(LiveAvatarConfig.full())
    ours = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    assert ours == official and len(ours) == 1260
    assert sum(v.numel() for v in net.state_dict().values()) == 16_295_755_609  # 16.296 B
    assert len(net.blocks) == 40 and all(isinstance(b, LiveAvatarBlock) for b in net.blocks)


def test_official_kwargs_are_read_and_unsupported_paths_refused() -> None:
    tiny = LiveAvatarConfig.tiny()
    kwargs = {f.name: getattr(tiny, f.name) for f in dataclasses.fields(tiny)}
    assert LiveAvatarConfig.from_official({**kwargs, "_class_name": "WanModel_S2V"}) == tiny
    with pytest.raises(ValueError, match="enable_motioner"):  # the official default, asserted off
        LiveAvatarConfig.from_official({k: v for k, v in kwargs.items() if k != "enable_motioner"})
    with pytest.raises(ValueError, match="audio_inject_layers"):
        dataclasses.replace(tiny, audio_inject_layers=(0, 2))


def _model(seed: int = 0) -> LiveAvatarDiT:
    torch.manual_seed(seed)
    net = LiveAvatarDiT(LiveAvatarConfig.tiny()).eval()
    with torch.no_grad():  # no zero-initialised path stays trivially zero
        for p in net.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return net


def _inputs(h: int = 8, w: int = 12, frames: int = 3, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"ref": torch.randn(1, 16, 1, h, w, generator=g),
            "motion": torch.randn(1, 16, 19, h, w, generator=g),
            "context": torch.randn(5, 32, generator=g),
            "audio": torch.randn(1, 25, 16, 4 * frames, generator=g),
            "x": torch.randn(1, 16, frames, h, w, generator=g)}


def test_text_kv_cache_equals_recomputing_and_is_made_once() -> None:
    net, a = _model(), _inputs()
    calls = []
    hooks = [b.cross_attn.k.register_forward_hook(lambda *_: calls.append(1)) for b in net.blocks]
    with torch.inference_mode():
        sink = net.prefill_sink(a["ref"], a["motion"], a["context"])  # raw prompt: made here
        fresh = [net.forward_block(a["x"], 900.0, a["audio"], a["context"], sink, KVRing(2, 12), 0, 24)
                 for _ in range(2)]
        n_fresh = len(calls)
        cache = net.text_cache(a["context"])
        assert isinstance(cache, TextKV) and cache.filled == 0
        sink2 = net.prefill_sink(a["ref"], a["motion"], cache)
        assert cache.filled == 2
        cached = [net.forward_block(a["x"], 900.0, a["audio"], cache, sink2, KVRing(2, 12), 0, 24)
                  for _ in range(2)]
    for h in hooks:
        h.remove()
    assert n_fresh == 3 * 2 and len(calls) - n_fresh == 2  # per forward and layer vs once per layer
    assert all(torch.equal(f, c) for f, c in zip(fresh, cached))  # tolerance 0: same function
    assert all(torch.equal(k1, k2) for k1, k2 in zip(sink.k, sink2.k))


def test_attention_is_pluggable_and_blocks_see_all_layer_work() -> None:
    """The self-attention goes through `attention(q, k, v)` ([B, heads, N, hd]; keys = filled ring
    then sink); every layer runs inside `block(...)`, so hooks on `blocks` (offload) fire."""
    net, a = _model(), _inputs()
    seen, entered = [], []
    hooks = [b.register_forward_pre_hook(lambda *_: entered.append(1)) for b in net.blocks]

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(q.shape), tuple(k.shape)))
        return sdpa_attention(q, k, v)

    with torch.inference_mode():
        sink = net.prefill_sink(a["ref"], a["motion"], a["context"], attention=recording)
        ref = net.forward_block(a["x"], 500.0, a["audio"], a["context"], sink, KVRing(2, 12), 0, 24)
        out = net.forward_block(a["x"], 500.0, a["audio"], a["context"], sink, KVRing(2, 12), 0, 24,
                                attention=recording)
    for h in hooks:
        h.remove()
    s = 24 + 24 + 2 * 3 + 4 * 1  # reference 4×6 patches; FramePack 4×6, 2×3, 4 frames × 1×1
    assert sink.tokens == s and seen[0] == ((1, 2, s, 32), (1, 2, s, 32))
    assert seen[-1] == ((1, 2, 3 * 24, 32), (1, 2, 3 * 24 + s, 32))
    assert len(entered) == 3 * 2 and torch.equal(ref, out)


def test_ring_writes_at_frame_slots_and_stays_bounded() -> None:
    ring = KVRing(layers=1, frames=12)
    for b in range(6):
        k = torch.full((1, 2, 3 * 4, 8), float(b))
        ring.write(0, 3 * b, 3, k, k)
        if b == 0:
            size = ring.nbytes()
        got, _ = ring.read(0)
        assert ring.filled() == min(12, 3 * (b + 1)) and ring.nbytes() == size
        held = torch.arange(max(0, b - 3), b + 1, dtype=torch.float32)  # the last 4 blocks
        assert torch.equal(got[0, 0, ::12, 0].unique(), held)
    with pytest.raises(ValueError, match="straddles"):
        ring.write(0, 10, 3, k, k)


def test_reference_rolls_ahead_by_the_sink_distance_framepack_stays() -> None:
    assert [reference_time(30, 3 * b, 24) for b in range(6)] == [30, 30, 30, 33, 36, 39]
    assert reference_time(30, 225_000, 4) == 225_004
    net, a = _model(), _inputs()
    with torch.inference_mode():
        sink = net.prefill_sink(a["ref"], a["motion"], a["context"])
    t0, t9 = sink.times(0, 24), sink.times(27, 24)
    assert torch.equal((t9 - t0)[sink.moves], torch.full((24,), 21.0, dtype=torch.float64))
    assert torch.equal(t9[~sink.moves], t0[~sink.moves])
    assert sorted(t0[~sink.moves].unique().tolist()) == [-19, -14, -9, -4, -3, -1]


def test_sink_distance_changes_the_output_and_is_an_argument() -> None:
    net, a = _model(), _inputs()
    with torch.inference_mode():
        sink = net.prefill_sink(a["ref"], a["motion"], a["context"])
        v = [net.forward_block(a["x"], 900.0, a["audio"], a["context"], sink, KVRing(2, 12), 27, d)
             for d in (24, 24, 25)]
    assert torch.equal(v[0], v[1]) and (v[0] - v[2]).abs().max() > 1e-4


def test_zero_pose_is_the_cond_encoder_bias() -> None:
    """The pipeline passes zero pose latents; adding only `cond_encoder`'s bias is the same."""
    net, a = _model(), _inputs()
    with torch.inference_mode():
        sink = net.prefill_sink(a["ref"], a["motion"], a["context"])
        v = [net.forward_block(a["x"], 900.0, a["audio"], a["context"], sink, KVRing(2, 12), 0, 24, pose=pose)
             for pose in (None, torch.zeros_like(a["x"]))]
    assert torch.equal(v[0], v[1])
