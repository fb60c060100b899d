"""LiveAvatar memory plans (weights/plans.py) from the real checkpoint's key list and config: the
figures of docs/real-models.md "Memory plans" (ring 11.1 GB a step at 720x400, sink 2.3 GB, DiT 32.6 GB in bf16),
the token counts the official code allocates for, and the plans' arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from avatarstream.models.liveavatar import LiveAvatarConfig
from avatarstream.weights.plans import (CARDS, Geometry, Sizes, card, dit_sizes, kv_bytes_per_token, memory_plans,
                                        rank_parts)

KEYS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "real-models" / "s2v14b_keys.json").read_text())
CFG = LiveAvatarConfig.full()


@pytest.fixture(scope="module")
def sizes() -> Sizes:
    whole, unit, resident = dit_sizes(KEYS, CFG.audio_inject_layers)
    # Wan2.1 VAE 126.9 M and wav2vec2-large 315.5 M parameters (docs/real-models.md, LiveAvatar's table), bf16
    return Sizes(dim=CFG.dim, layers=CFG.num_layers, ffn_dim=CFG.ffn_dim, dit=whole, unit=unit,
                 resident=resident, vae=2 * 126_900_000, audio=2 * 315_500_000)


def test_token_counts_match_the_official_buffers() -> None:
    """720x400: 1125 tokens a latent frame, a 13 500-token ring (the official `kv_cache_size`),
    a 2778-token sink that fits the official 2800-token sink buffer; the golden fixture's 8x8
    latents: 40 sink tokens (its `settings.sink_tokens`)."""
    g = Geometry()
    assert (g.tokens_per_frame, g.ring_tokens, g.sink_tokens) == (1125, 13_500, 2778)
    assert Geometry(width=64, height=64).sink_tokens == 40


def test_figures_of_the_spec(sizes: Sizes) -> None:
    """DiT 32.59 GB bf16 and about half in fp8; ring 11.06 GB and sink 2.28 GB per step; the offload
    unit is one block and its injector (the largest: a block with one of the 12 injectors)."""
    assert round(sizes.dit["bf16"] / 1e9, 2) == 32.59
    assert 0.49 < sizes.dit["fp8"] / sizes.dit["bf16"] < 0.53
    kv = kv_bytes_per_token(sizes)
    assert kv == 40 * 2 * 5120 * 2
    assert round(kv * Geometry().ring_tokens / 1e9, 2) == 11.06 and round(kv * Geometry().sink_tokens / 1e9, 2) == 2.28
    per_block = (sizes.dit["bf16"] - sizes.resident["bf16"]) / 40
    assert per_block < sizes.unit["bf16"] < 2 * per_block
    assert sizes.resident["bf16"] == sizes.resident["fp8"] < 1e9  # embeddings, head, audio encoder: bf16


def test_plans(sizes: Sizes) -> None:
    """Each plan's rank holds what its topology says; 1x80 GB (fp8 + offload), 2x80 GB and 4+1 all fit
    an 80 GB card; a TPP DiT rank is the spec's ≈ 46 GB + activations."""
    p = memory_plans(sizes)
    plans = p["plans"]
    assert all(plan["fits"] for plan in plans.values())
    one = plans["1x80GB"]["ranks"]["gpu"]
    assert one["bytes"] == sum(one["parts"].values()) < CARDS["80GB"]
    assert plans["1x80GB"]["host_pinned_bytes"] > 15e9  # the offloaded fp8 blocks
    tpp = plans["4+1"]["ranks"]
    assert tpp["DiT rank"]["count"] == 4 and 46e9 < tpp["DiT rank"]["bytes"] < 49e9
    assert tpp["VAE rank"]["bytes"] < 8e9
    sp0, sp1 = (plans["2x80GB"]["ranks"][r]["parts"] for r in ("rank 0", "rank 1"))
    rings = next(v for k, v in sp0.items() if k.startswith("KV rings"))
    assert rings == 4 * p["geometry"]["ring_bytes"] // 2  # half of every step's ring
    assert "VAE + wav2vec2 weights" in sp0 and "VAE + wav2vec2 weights" not in sp1
    # all resident on one GPU: bf16 leaves about 1 GB of an 80 GB card, fp8 about 17 GB
    bf16, fp8 = (sum(rank_parts(sizes, Geometry(), precision=p).values()) for p in ("bf16", "fp8"))
    assert 0 < CARDS["80GB"] - bf16 < 2e9 and 15e9 < CARDS["80GB"] - fp8 < 20e9
    assert sum(rank_parts(sizes, Geometry(), rings=4).values()) == bf16  # one sink, shared by the 4 steps


def test_small_cards(sizes: Sizes) -> None:
    """A 24 GB card: not the 720x400 stream; the 432x240 one, or 720x400 with a 1-block ring, and
    TPP's VAE rank. A 48 GB card: 576x320, or 720x400 with a 3-block ring, or a TPP DiT rank."""
    c24, c48 = card(sizes, Geometry(), "24GB"), card(sizes, Geometry(), "48GB")
    assert not c24["single_gpu_fits"] and c24["largest_size"] == "432x240" and c24["ring_blocks_at_size"] == 1
    assert c24["tpp_roles"] == ["TPP VAE rank"]
    assert not c48["single_gpu_fits"] and c48["largest_size"] == "576x320" and c48["ring_blocks_at_size"] == 3
    assert "TPP DiT rank (fp8)" in c48["tpp_roles"]


def test_plans_scale_with_the_stream(sizes: Sizes) -> None:
    """Rings and sinks grow with the pixel count, weights do not: a 4x smaller stream needs less."""
    big, small = Geometry(), Geometry(width=360, height=200)
    b, s = (sum(rank_parts(sizes, g, rings=1, with_vae=False).values()) for g in (big, small))
    assert s < b and b - s > 0.7 * (kv_bytes_per_token(sizes) * (big.ring_tokens - small.ring_tokens))
