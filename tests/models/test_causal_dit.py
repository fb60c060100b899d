"""The causal forwards of the VideoRef DiT (`VideoRefDiT.forward_causal_block`,
`forward_block_causal`), the block-causal mask and the RoPE time shift that places a cached sink
(tiny config, fp32). The streaming loop over them is tested in tests/test_causal.py.

Tolerance of causal vs bidirectional: 1e-5 absolute on velocities of order 1 in float32 (the
paths sum the same attention terms in different orders).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from avatarstream.models.attention import block_causal_mask
from avatarstream.models.dit import DiTConfig, VideoRefDiT
from avatarstream.models.rope import apply_rope, rope_tables, shift_time
from avatarstream.models.sink import SinkCache
from avatarstream.models.transformer import DiTCondition

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
R = 3


@pytest.fixture(scope="module")
def dit() -> VideoRefDiT:
    m = VideoRefDiT(DiTConfig.tiny()).eval()
    m.init_random_(0)
    return m


def reference(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference latents `[1, 4, R, 4, 4]` and their validity `[1, R]` (frame 1 invalid)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, R, 4, 4, generator=g), torch.tensor([[True, False, True]])


@pytest.mark.parametrize("x0_skip", [False, True])
def test_one_block_without_history_is_the_plain_dit(dit, x0_skip):
    """A single block holding the whole sequence, with no history and the reference as the sink,
    attends to exactly what the bidirectional DiT attends to, so both causal paths (streaming and
    dense) equal `VideoRefDiT.forward` on the same inputs, scene anchor included (its embedding
    joins the generation patches on every path; tolerance 1e-5)."""
    net = dit
    if x0_skip:
        net = VideoRefDiT(dataclasses.replace(dit.config, x0_skip=True)).eval()
        net.load_state_dict(dit.state_dict())
    assert getattr(net, "anchor_embedding", None) is not None
    ref, valid = reference()
    g = torch.Generator().manual_seed(5)
    t = 6
    x, m = torch.randn(1, 4, t, 4, 4, generator=g), torch.randn(1, t, 4, generator=g)
    cond = DiTCondition(motion=m, audio=torch.randn(1, t, 6, 16, generator=g),
                        text=torch.randn(1, 5, 16, generator=g), t_pos=torch.arange(10, 10 + t, dtype=torch.float32),
                        anchor=torch.randn(1, 4, 4, 4, generator=g))
    sigma = torch.full((1, t), 0.6)
    with torch.no_grad():
        cached = net.encode_reference(ref, valid, torch.full((R,), 2.0))
        want = net(x, sigma, cond, cached)
        sink = SinkCache(cached, 2.0, head_dim=net.config.head_dim, theta=net.config.rope_theta)
        got, _ = net.forward_causal_block(x, sigma, cond, sink.at(2.0), None)
        dense = net.forward_block_causal(x, sigma, cond, [(ref, valid, 2.0)], [0], block=t, history=0)
        no_anchor = net(x, sigma, dataclasses.replace(cond, anchor=None), cached)
    for out in (got, dense):
        assert float((out.velocity - want.velocity).abs().max()) <= TOL
        assert float((out.motion_velocity - want.motion_velocity).abs().max()) <= TOL
    assert float((no_anchor.velocity - want.velocity).abs().max()) > 100 * TOL  # the anchor matters


def test_block_causal_mask_layout():
    valid = [torch.tensor([[True, False]]), torch.tensor([[True]])]
    p, blk = 1, 2
    mask = block_causal_mask(valid, [0, 1, 1], p, blk, 3, 1)[0, 0]  # 3 sink frames + 6 gen
    gen = mask[3:]
    assert gen[:2, :3].tolist() == [[True, False, False]] * 2  # block 0: copy 0, frame 1 invalid
    assert gen[2:, :3].tolist() == [[False, False, True]] * 4  # blocks 1, 2: copy 1
    g = gen[:, 3:]
    assert g[0].tolist() == [True, True, False, False, False, False]  # block 0 sees itself
    assert g[2].tolist() == [True, True, True, True, False, False]  # block 1 sees 0 and 1
    assert g[4].tolist() == [False, False, True, True, True, True]  # block 2: window of 1 block
    assert mask[:3, :3].equal(torch.eye(3, dtype=torch.bool)) and not mask[:3, 3:].any()


def test_shift_time_is_rope_at_shifted_positions():
    g = torch.Generator().manual_seed(0)
    hd, n = 16, 10
    x = torch.randn(2, 2, n, hd, generator=g)
    t = (torch.rand(n, generator=g) * 50).double()  # float64: t + 6250 stays exact
    h, w = torch.rand(n, generator=g) * 4, torch.rand(n, generator=g) * 4
    for delta in (3.0, -7.5, 6250.0):
        a = shift_time(apply_rope(x, *rope_tables(t, h, w, hd)), delta, hd)
        b = apply_rope(x, *rope_tables(t + delta, h, w, hd))
        assert float((a - b).abs().max()) < 1e-4
