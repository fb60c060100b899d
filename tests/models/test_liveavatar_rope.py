"""Positions without a cap (issue 29, item 2): LiveAvatar's RoPE is computed for any latent frame,
equals the official 45,000-row table where that table reaches, and a 10-hour position works.

The official table (Wan2.2-S2V `rope_params` per axis, concatenated, stored as complex32 by
`rope_precompute`) is rebuilt here from its description: row p of an axis with `n` rotation pairs
holds exp(i·p·θ^(−2j/2n)), j < n, computed in float64 and kept in float16."""

from __future__ import annotations

import pytest
import torch

from avatarstream.models.liveavatar import KVRing, LiveAvatarConfig, LiveAvatarDiT
from avatarstream.models.rope import apply_rope, axis_pairs, rope_tables

ROWS = 45_000  # the official table's length: 45,000 latents × 4 frames / 25 fps = 2 h
TEN_HOURS = 10 * 3600 * 25 // 4  # latent frames (4 video frames each at 25 fps) = 225,000


def _official_table(head_dim: int, theta: float = 10000.0) -> list[torch.Tensor]:
    """Per axis (t, h, w): `[ROWS, pairs]` complex32, as the official code stores it."""
    out = []
    for pairs in axis_pairs(head_dim):
        inv = 1.0 / torch.pow(theta, torch.arange(0, 2 * pairs, 2, dtype=torch.float64) / (2 * pairs))
        ang = torch.outer(torch.arange(ROWS, dtype=torch.float64), inv)
        out.append(torch.polar(torch.ones_like(ang), ang).to(torch.complex32))
    return out


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("head_dim", [128, 32])  # the 14B model's and the fixtures'
def test_computed_tables_equal_the_official_table_where_it_reaches(head_dim: int) -> None:
    table = _official_table(head_dim)
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.tensor([[0, 0, 0], [30, 44, 24], [ROWS - 1, ROWS - 1, ROWS - 1]]),
                     torch.randint(0, ROWS, (500, 3), generator=g)])  # [N, 3] (t, h, w)
    want = torch.cat([table[a][pos[:, a]] for a in range(3)], dim=1)  # [N, hd/2] complex32
    cos, sin = rope_tables(pos[:, 0].double(), pos[:, 1].double(), pos[:, 2].double(), head_dim, fp16=True)
    assert torch.equal(cos, want.real.float()) and torch.equal(sin, want.imag.float())  # exact
    # negative times (FramePack) rotate by the conjugate, i.e. the negative angle
    neg_cos, neg_sin = rope_tables(-pos[:, 0].double(), pos[:, 1].double(), pos[:, 2].double(),
                                   head_dim, fp16=True)
    pt = axis_pairs(head_dim)[0]
    assert torch.equal(neg_cos[:, :pt], cos[:, :pt]) and torch.equal(neg_sin[:, :pt], -sin[:, :pt])


def test_a_ten_hour_position_works() -> None:
    """Past the table's end the angles are still exact (float64), and attention scores depend only
    on the distance between positions: at 10 h as at 0 (fp32 tables, tolerance 1e-4 relative)."""
    hd = 128
    far = torch.tensor([TEN_HOURS, TEN_HOURS + 3, 2 * TEN_HOURS], dtype=torch.float64)
    zeros = torch.zeros(3, dtype=torch.float64)
    cos, sin = rope_tables(far, zeros, zeros, hd, fp16=True)
    pt = axis_pairs(hd)[0]
    inv = 1.0 / torch.pow(10000.0, torch.arange(0, 2 * pt, 2, dtype=torch.float64) / (2 * pt))
    assert torch.equal(cos[:, :pt], torch.cos(far[:, None] * inv).half().float())
    assert torch.equal(sin[:, :pt], torch.sin(far[:, None] * inv).half().float())
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, hd, generator=g), torch.randn(1, 1, 1, hd, generator=g)

    def score(tq: float, tk: float) -> float:
        one = torch.zeros(1, dtype=torch.float64)
        cq, sq = rope_tables(one + tq, one, one, hd)
        ck, sk = rope_tables(one + tk, one, one, hd)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    near = score(3.0, 0.0)
    assert abs(score(TEN_HOURS + 3.0, TEN_HOURS) - near) < 1e-4 * max(1.0, abs(near))


def test_a_block_at_ten_hours_runs() -> None:
    """The streaming forward at latent frame 225,000 (the official table stops at 45,000)."""
    torch.manual_seed(0)
    net = LiveAvatarDiT(LiveAvatarConfig.tiny()).eval()
    g = torch.Generator().manual_seed(2)
    ring = KVRing(len(net.blocks), 12)
    with torch.inference_mode():
        sink = net.prefill_sink(torch.randn(1, 16, 1, 8, 8, generator=g),
                                torch.randn(1, 16, 19, 8, 8, generator=g), torch.randn(5, 32, generator=g))
        x, audio = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 25, 16, 12, generator=g)
        v = net.forward_block(x, 602.15, audio, torch.randn(5, 32, generator=g), sink, ring, TEN_HOURS, 24)
    assert v.shape == (1, 16, 3, 8, 8) and bool(torch.isfinite(v).all())
    assert ring.filled() == 3 and float(sink.times(TEN_HOURS, 24).max()) == TEN_HOURS + 24
