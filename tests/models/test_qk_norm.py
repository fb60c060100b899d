"""q/k RMSNorm in a bf16 model (a FlashHead or LiveAvatar DiT loaded in bf16): normalised in
float32 as Wan does, without torch's "Mismatch dtype between input and weight" warning (a float32
input with the bf16 weight sends torch to its unfused path with that warning; the numbers were the
same, so they must stay the same)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from avatarstream.models.dit_blocks import SelfAttention


def test_bf16_qk_norm_is_float32_and_silent() -> None:
    g = torch.Generator().manual_seed(0)
    layer = SelfAttention(64, 2, 1e-6)
    with torch.no_grad():
        layer.norm_q.weight.copy_(1 + 0.2 * torch.randn(64, generator=g))
    layer = layer.to(torch.bfloat16)  # as Module(dtype=bf16) holds a DiT loaded in bf16
    x = torch.randn(1, 8, 64, generator=g).to(torch.bfloat16)
    cos, sin = torch.ones(8, 16), torch.zeros(8, 16)
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch warns once per process otherwise: another test may have used it up
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                q, _, _ = layer.qkv(x, cos, sin)
    finally:
        torch.set_warn_always(was)
    assert not [w for w in caught if "Mismatch dtype" in str(w.message)], [str(w.message) for w in caught]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = layer.q(x).float()
    want = F.rms_norm(h, (64,), layer.norm_q.weight.float(), 1e-6)  # float32 throughout
    assert q.dtype == torch.float32
    torch.testing.assert_close(q.transpose(1, 2).reshape(1, 8, 64), want, rtol=1e-6, atol=1e-6)
