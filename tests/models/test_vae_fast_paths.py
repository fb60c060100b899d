"""The VAE's CPU fast paths (models/vae.py, models/vae_blocks.py) against the plain computation
they replace, with the tolerances measured on this machine written down:

- `decode_step_frames` (uint8 pictures) == `decode_step` then round((clamp(x) + 1)·127.5) and
  channels-last: exactly in fp32; under bf16 autocast measured identical too, asserted ≤ 1 level.
- `patches_to_uint8` == F.pixel_shuffle + that conversion, and `pixel_shuffle` == F.pixel_shuffle:
  exactly (a permutation of the same values).
- `conv3d` with a 1×1×1 kernel (bmm/baddbmm): fp32 ≤ 1e-5 relative to F.conv3d (measured 0);
  under bf16 autocast bf16 and equal to F.conv3d under autocast (measured 0; asserted ≤ 1 bf16
  ulp of the output's scale, 2^-8 relative).
- `RMSNorm` in bf16 (y·γ rounded, then + β): ≤ 1 bf16 ulp of max(|y·γ|, |result|) from fp32
  addcmul rounded once (measured exactly 1 at worst; near cancellation, y·γ ≈ -β, that is up to
  ~240 ulps of the small result, so "≤ 1 ulp of the result" does not hold there); fp32: addcmul.
- `FrameAttention`: SDPA's fused CPU kernel, never the math path; ≤ 1e-5 from softmax(QKᵀ/√C)V
  (measured 2.4e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from avatarstream.models import vae_blocks as vb
from avatarstream.models.vae import CausalVAE, VAEConfig, patches_to_uint8

CONFIGS = {"tiny": VAEConfig.tiny, "small": VAEConfig.small,
           "flat": lambda: VAEConfig(z_channels=4, channels=(8, 8, 16, 16), res_blocks=(1, 1, 1, 1),
                                     temporal_down=(False, True, True), patch_size=1)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """The plain conversion: [B, 3, F, H, W] in [-1, 1] -> uint8 [B, F, H, W, 3]."""
    u = ((video.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    return u.permute(0, 2, 3, 4, 1).contiguous()


def streamed(vae: CausalVAE, z: torch.Tensor, sizes: list[int], method: str) -> list[torch.Tensor]:
    cache, out, t = vae.new_cache(), [], 0
    for n in sizes:  # the first chunk (1 + 4(T-1) frames) and later chunks (4T) both run
        out.append(getattr(vae, method)(z[:, :, t:t + n], cache))
        t += n
    return out


@pytest.mark.parametrize("name,hw,batch", [("tiny", 2, 1), ("small", 8, 2), ("flat", 2, 2)])
def test_decode_step_frames_equals_decode_step_then_conversion(name, hw, batch):
    vae = CausalVAE(CONFIGS[name]()).init_random_(0).eval()
    z = 0.5 * torch.randn(batch, vae.cfg.z_channels, 5, hw, hw, generator=gen(1))
    sizes = [1, 2, 2]
    with torch.inference_mode():
        fast = streamed(vae, z, sizes, "decode_step_frames")
        plain = streamed(vae, z, sizes, "decode_step")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast16 = streamed(vae, z, sizes, "decode_step_frames")
            plain16 = streamed(vae, z, sizes, "decode_step")
    for f, p, f16, p16 in zip(fast, plain, fast16, plain16):
        assert f.dtype == torch.uint8 and f.is_contiguous() and f.shape == (batch, p.shape[2], 8 * hw, 8 * hw, 3)
        assert torch.equal(f, to_uint8(p))
        assert (f16.int() - to_uint8(p16).int()).abs().max() <= 1
    assert [f.shape[1] for f in fast] == [1, 8, 8]
    u = to_uint8(torch.cat(plain, 2))
    inside = ((u > 0) & (u < 255)).float().mean()
    assert 0.1 < inside < 0.99, inside  # the rounding and the clamp both matter (random weights clip a lot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patches_to_uint8_equals_pixel_shuffle_then_conversion(dtype):
    x = (1.3 * torch.randn(2, 12, 3, 5, 7, generator=gen(2))).to(dtype)  # [B, 3·2², F, h, w]
    shuffled = torch.stack([F.pixel_shuffle(x[:, :, i], 2) for i in range(3)], dim=2)
    got = patches_to_uint8(x, 2)
    assert got.shape == (2, 3, 10, 14, 3) and got.is_contiguous() and torch.equal(got, to_uint8(shuffled))
    got1 = patches_to_uint8(x[:, :3], 1)
    assert got1.is_contiguous() and torch.equal(got1, to_uint8(x[:, :3]))
    x0 = x.clone()
    patches_to_uint8(x, 2)
    assert torch.equal(x, x0)  # the in-place arithmetic works on its own copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r", [2, 3])
def test_pixel_shuffle_equals_library(dtype, r):
    x = torch.randn(3, 4 * r * r, 5, 6, generator=gen(3)).to(dtype)
    got = vb.pixel_shuffle(x, r)
    assert got.dtype == dtype and torch.equal(got, F.pixel_shuffle(x, r))


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("with_bias", [True, False])
def test_pointwise_conv3d_equals_library(batch, with_bias):
    g = gen(4)
    x = torch.randn(batch, 6, 16, 4, 5, generator=g).transpose(1, 2)  # [B, 16, 6, 4, 5], not contiguous
    assert not x.is_contiguous()
    w = torch.randn(12, 16, 1, 1, 1, generator=g) / 4
    b = torch.randn(12, generator=g) if with_bias else None
    args = ((1, 1, 1), (0, 0, 0))
    got, ref = vb.conv3d(x, w, b, *args), F.conv3d(x, w, b)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got16, ref16 = vb.conv3d(x, w, b, *args), F.conv3d(x, w, b)
    assert got16.dtype == ref16.dtype == torch.bfloat16
    assert (got16.float() - ref16.float()).abs().max() <= 2 ** -8 * ref16.float().abs().max()


def _ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers (8 significant bits) at |v|."""
    return torch.ldexp(torch.ones_like(v), torch.frexp(v)[1] - 8)


def test_rmsnorm_bf16_and_fp32_against_addcmul():
    g = gen(5)
    norm = vb.RMSNorm(16)
    with torch.no_grad():
        norm.gamma.copy_(1 + 0.3 * torch.randn(16, generator=g))
        norm.bias.copy_(0.3 * torch.randn(16, generator=g))
    shape = (1, -1, 1, 1, 1)
    for dtype in (torch.bfloat16, torch.float32):
        x = (3 * torch.randn(2, 16, 5, 16, 16, generator=g)).to(dtype)
        with torch.no_grad():
            out = norm(x)
            y = x * (norm.scale / x.square().sum(1, keepdim=True).sqrt().clamp_min(norm.eps))
            gamma, bias = norm.gamma.view(shape).to(dtype), norm.bias.view(shape).to(dtype)
        assert out.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(out, torch.addcmul(bias, y, gamma))
            continue
        ref = torch.addcmul(bias.float(), y.float(), gamma.float()).bfloat16().float()
        scale = torch.maximum((y.float() * gamma.float()).abs(), ref.abs())
        assert ((out.float() - ref).abs() <= _ulp_bf16(scale)).all()
        assert (out.float() != ref).float().mean() < 0.5  # mostly the same rounding


def _ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_frame_attention_takes_the_fused_kernel_and_matches_softmax():
    torch.manual_seed(6)
    attn = vb.FrameAttention(16, 1e-6).eval()
    x = torch.randn(2, 16, 3, 6, 5)
    with torch.no_grad():
        for autocast in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                ops = _ops(lambda: attn(x))
            assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, (autocast, ops)
            assert "aten::_scaled_dot_product_attention_math" not in ops, autocast
        got = attn(x)
        f = attn.norm(x).transpose(1, 2).reshape(6, 16, 6, 5)  # [B·T, C, H, W]
        n, c, h, w = f.shape
        q, k, v = attn.to_qkv(f).reshape(n, 3, c, h * w).transpose(2, 3).unbind(1)
        o = torch.softmax(q @ k.transpose(1, 2) / c ** 0.5, dim=-1) @ v  # [N, HW, C]
        o = attn.proj(o.transpose(1, 2).reshape(n, c, h, w))
        ref = x + o.reshape(2, 3, c, h, w).transpose(1, 2)
    assert (got - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("offload", [False, True])
def test_front_then_back_equals_decode_step_frames(offload):
    """The two parts of the split decode (`decode_front` then `decode_back`, the second part of
    chunk k after the first part of chunk k+1, as two threads run them) give
    `decode_step_frames`' pictures exactly, also with the decoder's levels offloaded block by
    block (an offloaded ModuleList is iterated, never sliced)."""
    from avatarstream.engine.offload import offload_blocks

    torch.manual_seed(0)
    vae = CausalVAE(VAEConfig.tiny()).eval()
    z = torch.randn(2, vae.cfg.z_channels, 7, 8, 8)
    parts = (z[:, :, :1], z[:, :, 1:3], z[:, :, 3:5], z[:, :, 5:])
    with torch.inference_mode():
        c = vae.new_cache()
        want = [vae.decode_step_frames(p, c) for p in parts]
        if offload:
            offload_blocks(vae.decoder, "cpu", attr="up_blocks")
        c = vae.new_cache()
        got = [vae.decode_step_frames(parts[0], c)]
        assert any(vae.is_back_layer(k) for k in c.frames) and not all(vae.is_back_layer(k) for k in c.frames)
        h = vae.decode_front(parts[1], c)
        for p in parts[2:]:
            h_next = vae.decode_front(p, c)  # chunk k+1's front before chunk k's back
            got.append(vae.decode_back(h, c))
            h = h_next
        got.append(vae.decode_back(h, c))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
