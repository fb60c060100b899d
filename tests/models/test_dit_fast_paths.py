"""The DiT's CPU fast paths (models/dit_blocks.py, models/rope.py) against the plain computation
they replace, with the tolerances measured on this machine written down:

- `DiTBlock.cross` with one attendable text token (the value row, no queries or scores) against
  the full cross-attention: fp32 ≤ 1e-5 (measured 4.8e-7), bf16 autocast ≤ 2 bf16 ulps of the
  output's scale (2^-7 relative to max |x|, measured identical); a masked-out token and a mixed
  mask still take the full path.
- `apply_rope` (one complex multiply) against x1·cos − x2·sin, x1·sin + x2·cos per consecutive
  pair: ≤ 1e-6 in fp32 (measured 0), bf16 in and out equal to the fp32 formula rounded to bf16
  (measured identical, asserted ≤ 1e-6), for contiguous, transposed and odd-offset q and both
  table layouts.
"""

from __future__ import annotations

import pytest
import torch

from avatarstream.models.dit_blocks import DiTBlock
from avatarstream.models.rope import apply_rope

B, T, P, A, D, HEADS = 2, 3, 10, 4, 64, 4


@pytest.fixture(scope="module")
def block() -> DiTBlock:
    torch.manual_seed(0)
    blk = DiTBlock(D, HEADS, 128, 1e-6).eval()
    with torch.no_grad():  # non-trivial norm affines and biases, so a wrong path shows
        for m in (blk.norm3, blk.norm_audio):
            m.weight.normal_(1.0, 0.2)
            m.bias.normal_(0.0, 0.2)
    return blk


def full_path(blk: DiTBlock, x, text, mask, audio) -> torch.Tensor:
    """`cross` as written before the one-token shortcut: every token queries the text."""
    b, t, p, d = x.shape
    x = x + blk.cross_attn(blk.norm3(x).reshape(b, t * p, d), text, mask).view(b, t, p, d)
    y = blk.audio_attn(blk.norm_audio(x).reshape(b * t, p, d), audio.reshape(b * t, A, d))
    return x + y.view(b, t, p, d)


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, P, D, generator=g), torch.randn(B, 1, D, generator=g),
            torch.randn(B, T, A, D, generator=g))


def run(blk: DiTBlock, fn, *args) -> tuple[torch.Tensor, int]:
    """fn(*args) and how often norm3 ran (the full path's query norm: 0 on the shortcut)."""
    calls = []
    handle = blk.norm3.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            return fn(*args), len(calls)
    finally:
        handle.remove()


@pytest.mark.parametrize("mask", [None, torch.ones(B, 1, dtype=torch.bool)])
def test_one_text_token_shortcut_equals_full_cross_attention(block, mask):
    x, text, audio = inputs(1)
    got, n = run(block, block.cross, x, text, mask, audio)
    ref, _ = run(block, full_path, block, x, text, mask, audio)
    assert n == 0  # the shortcut ran
    assert (got - ref).abs().max() <= 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got16, _ = run(block, block.cross, x, text, mask, audio)
        ref16, _ = run(block, full_path, block, x, text, mask, audio)
    assert got16.dtype == ref16.dtype
    assert (got16.float() - ref16.float()).abs().max() <= 2 ** -7 * ref16.float().abs().max()
    assert (got16.float() - ref).abs().max() <= 0.1 * ref.abs().max()  # and near fp32


@pytest.mark.parametrize("mask", [[False, False], [True, False]])
def test_a_masked_text_token_takes_the_full_path(block, mask):
    x, text, audio = inputs(2)
    m = torch.tensor(mask)[:, None]
    got, n = run(block, block.cross, x, text, m, audio)
    ref, _ = run(block, full_path, block, x, text, m, audio)
    assert n == 1 and torch.equal(got, ref)
    masked_out, _ = run(block, full_path, block, x, text * 0 + 100, m, audio)
    assert torch.equal(got[1], masked_out[1])  # row 1 reads no text at all
    if mask[0]:
        unmasked, _ = run(block, block.cross, x[:1], text[:1], None, audio[:1])
        assert (got[:1] - unmasked).abs().max() <= 1e-5


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "odd_offset"])
@pytest.mark.parametrize("tables", ["shared", "per_batch"])
def test_apply_rope_equals_the_real_formula(dtype, layout, tables):
    g = torch.Generator().manual_seed(3)
    b, h, n, hd = 2, 4, 12, 16
    if layout == "contiguous":
        q = torch.randn(b, h, n, hd, generator=g)
    elif layout == "transposed":  # [B, N, H, hd] seen as [B, H, N, hd], as split() hands it out
        q = torch.randn(b, n, h, hd, generator=g).transpose(1, 2)
    else:  # a narrow view whose pairs start at an odd element
        q = torch.randn(b, h, n, hd + 2, generator=g)[..., 1:hd + 1]
    q = q.to(dtype)
    assert q.is_contiguous() == (layout == "contiguous") or dtype != torch.float32
    ang = 5 * torch.randn(n, hd // 2, generator=g)
    if tables == "per_batch":
        ang = ang[None, None] + torch.randn(b, 1, 1, hd // 2, generator=g)
    cos, sin = ang.cos(), ang.sin()
    got = apply_rope(q, cos, sin)
    ref = rope_reference(q, cos, sin).to(dtype)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - ref.float()).abs().max() <= 1e-6
    q0 = q.clone()
    apply_rope(q, cos, sin)
    assert torch.equal(q, q0)  # the input is left alone
