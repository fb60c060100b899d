"""Causal VAE (models/vae.py, vae_blocks.py): shapes (1+4k <-> 1+k), streaming == whole (decode
and encode), bounded ConvCache, causality, bf16 autocast, the parameter names checkpoints use, and
the `bench vae` smoke run. Small sizes: each test is seconds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from avatarstream.cache.conv import ConvCache
from avatarstream.models.vae import CausalVAE, VAEConfig

CONFIGS = {
    "tiny": VAEConfig.tiny,
    "small": VAEConfig.small,
    # no pixel patch: 4 levels, the first resampler spatial only (the Wan 2.1 layout)
    "flat": lambda: VAEConfig(z_channels=4, channels=(8, 8, 16, 16), res_blocks=(1, 1, 1, 1),
                              temporal_down=(False, True, True), patch_size=1),
}


def make(name: str = "tiny", seed: int = 0) -> CausalVAE:
    return CausalVAE(CONFIGS[name]()).init_random_(seed).eval()


def latents(vae: CausalVAE, t: int, hw: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, vae.cfg.z_channels, t, hw, hw, generator=g)


def video(frames: int, size: int = 16, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, frames, size, size, generator=g) * 2 - 1


@pytest.mark.parametrize("name", ["tiny", "small", "flat"])
def test_shapes(name):
    vae = make(name)
    with torch.inference_mode():
        for k in (0, 1, 3):
            mean, logvar = vae.encode(video(1 + 4 * k, size=32))
            assert mean.shape == logvar.shape == (1, vae.cfg.z_channels, 1 + k, 4, 4)
            x = vae.decode(mean)
            assert x.shape == (1, 3, 1 + 4 * k, 32, 32)
            assert x.min() >= -1 and x.max() <= 1
        with pytest.raises(ValueError):
            vae.encode(video(4, size=32))  # not 1+4k


@pytest.mark.parametrize("name,sizes", [("tiny", [1, 2, 3, 1, 2]), ("tiny", [3, 1, 4, 1]),
                                        ("small", [1, 2, 3, 1, 2]), ("flat", [2, 1, 3])])
def test_streaming_decode_equals_whole(name, sizes):
    vae = make(name)
    z = latents(vae, sum(sizes))
    with torch.inference_mode():
        whole = vae.decode(z)
        cache = vae.new_cache()
        outs, s = [], 0
        for i, n in enumerate(sizes):
            out = vae.decode_step(z[:, :, s:s + n], cache)
            assert out.shape[2] == (1 + 4 * (n - 1) if i == 0 else 4 * n)
            outs.append(out)
            s += n
    stream = torch.cat(outs, dim=2)
    assert stream.shape == whole.shape
    assert (stream - whole).abs().max().item() <= 1e-4
    assert whole.std() > 0.05  # not a constant output


@pytest.mark.parametrize("name", ["tiny", "small", "flat"])
def test_streaming_encode_equals_whole(name):
    vae = make(name)
    frames = [5, 4, 8, 4]  # 1+4k first, then 4k
    v = video(sum(frames))
    with torch.inference_mode():
        mean, logvar = vae.encode(v)
        cache = vae.new_cache()
        ms, lvs, s = [], [], 0
        for n in frames:
            m, lv = vae.encode_step(v[:, :, s:s + n], cache)
            ms.append(m)
            lvs.append(lv)
            s += n
        with pytest.raises(ValueError):
            vae.encode_step(v[:, :, :5], cache)  # later chunks take 4k frames
        with pytest.raises(ValueError):
            vae.decode_step(mean[:, :, :1], cache)  # an encode cache cannot decode
    assert torch.cat(ms, 2).shape == mean.shape
    assert (torch.cat(ms, 2) - mean).abs().max().item() <= 1e-4
    assert (torch.cat(lvs, 2) - logvar).abs().max().item() <= 1e-4


def test_cache_bounded():
    vae = make("tiny")
    z = latents(vae, 1 + 3 * 6)
    sizes = []
    with torch.inference_mode():
        cache = vae.new_cache()
        assert isinstance(cache, ConvCache) and cache.nbytes() == 0
        vae.decode_step(z[:, :, :1], cache)
        for s in range(1, z.shape[2], 3):
            vae.decode_step(z[:, :, s:s + 3], cache)
            sizes.append(cache.nbytes())
    assert sizes[0] > 0
    assert len(set(sizes)) == 1, sizes  # constant: does not grow with the number of chunks


@pytest.mark.parametrize("name", ["tiny", "flat"])
def test_decode_causal(name):
    vae = make(name)
    z = latents(vae, 5)
    z2 = z.clone()
    j = 3  # change latent frame 3: video frames >= 4j-3 = 9 may change, frames < 9 must not
    z2[:, :, j] += 1.0
    with torch.inference_mode():
        a, b = vae.decode(z, clamp=False), vae.decode(z2, clamp=False)
    assert torch.equal(a[:, :, :4 * j - 3], b[:, :, :4 * j - 3])
    assert (a[:, :, 4 * j - 3:] - b[:, :, 4 * j - 3:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["tiny", "flat"])
def test_encode_causal(name):
    vae = make(name)
    v = video(13)
    v2 = v.clone()
    f = 6  # video frame 6 belongs to latent frame ceil(6/4) = 2: latents 0, 1 must not change
    v2[:, :, f] = -v2[:, :, f]
    with torch.inference_mode():
        (a, _), (b, _) = vae.encode(v), vae.encode(v2)
    assert torch.equal(a[:, :, :2], b[:, :, :2])
    assert (a[:, :, 2:] - b[:, :, 2:]).abs().max() > 1e-4


def test_init_random_deterministic():
    a, b, c = make("tiny", 3), make("tiny", 3), make("tiny", 4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    names = set(sa)
    for prefix in ("encoder.conv_in.", "encoder.down_blocks.0.resnets.0.conv1.",
                   "encoder.down_blocks.0.downsampler.time_conv.",
                   "encoder.mid_block.attentions.0.", "encoder.head.conv.", "quant_conv.",
                   "post_quant_conv.", "decoder.up_blocks.0.upsampler.time_conv.",
                   "decoder.head.conv."):
        assert any(n.startswith(prefix) for n in names), prefix


def test_parameter_names_are_the_bundled_checkpoints():
    """The module tree (one `ResnetLevel` class for the encoder's and the decoder's levels,
    `downsampler` / `upsampler` inside) keeps the names the bundled VAE was saved with: its file
    has exactly the small preset's keys and shapes."""
    from safetensors import safe_open

    path = Path(__file__).resolve().parents[2] / "src/avatarstream/weights/avatarstream-small/vae.safetensors"
    want = {k: tuple(v.shape) for k, v in CausalVAE(VAEConfig.small()).state_dict().items()}
    with safe_open(str(path), "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == want


def test_bf16_autocast_runs():
    vae = make("tiny")
    z = latents(vae, 3)
    with torch.inference_mode():
        ref = vae.decode(z)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            whole = vae.decode(z)
            cache = vae.new_cache()
            stream = torch.cat([vae.decode_step(z[:, :, :1], cache),
                                vae.decode_step(z[:, :, 1:], cache)], dim=2)
            mean, _ = vae.encode(video(5))
    assert whole.shape == stream.shape == ref.shape
    assert torch.isfinite(whole.float()).all() and torch.isfinite(mean.float()).all()
    assert (whole.float() - ref).abs().mean() < 0.05
    assert (stream.float() - whole.float()).abs().max() < 0.1


def test_bench_vae_quick():
    from avatarstream.bench import vae as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    res = bench.run(p.parse_args(["--quick"]))
    for key in ("max_abs_diff", "peak_mem_ratio", "stream_peak_mb", "chunk_peak_mb", "seconds",
                "latent_frames", "frames"):
        assert key in res, key
    assert res["frames"] == 1 + 4 * (res["latent_frames"] - 1)
    assert res["max_abs_diff"] <= 1e-4
    assert res["stream_peak_mb"] > 0 and res["chunk_peak_mb"] > 0


def test_bench_vae_wan_worker(tmp_path):
    """`bench vae --wan`'s workers on the real-width Wan2.1 VAE at 16²: the whole and the
    streamed decode (one latent a call) write the same frames, bit for bit."""
    from avatarstream.bench import vae as bench

    runs = {m: bench._worker(m, 3, 1, 0, str(tmp_path / f"{m}.f32"), "wan", 16) for m in ("whole", "stream")}
    assert runs["stream"]["cache_nbytes"] > 0 and all(r["seconds"] > 0 for r in runs.values())
    assert bench._max_abs_diff(tmp_path / "whole.f32", tmp_path / "stream.f32", 3 * 16 * 16) == 0.0
    assert (tmp_path / "whole.f32").stat().st_size == 4 * 3 * 16 * 16 * (1 + 4 * 2)


@pytest.mark.parametrize("shortcut", [False, True])
def test_upsampler_on_the_small_picture_equals_nearest_then_conv(shortcut):
    """Upsample computes nearest ×2 + 3×3 conv (+ the pixel-shuffle shortcut) as one 3×3 conv on
    the small picture with 4× the channels, then pixel shuffle (models/vae_blocks.py subpixel_weights):
    the same sums in another order. Tolerance: 1e-12 in float64, 1e-5 relative in float32."""
    import torch.nn.functional as F

    from avatarstream.models.vae_blocks import Upsample

    def unfold_up(x, cout):  # the parameter-free shortcut: channels repeated, pixel-shuffled ×2
        return F.pixel_shuffle(x.repeat_interleave(4 * cout // x.shape[1], dim=1), 2)

    torch.manual_seed(0)
    up = Upsample(32, 16, temporal=True, shortcut=shortcut).double()
    x = torch.randn(2, 32, 3, 9, 7, dtype=torch.float64)

    def reference(x):  # the plain formula, per frame
        y = up.time_conv(x)  # whole-sequence form: first frame alone, then two frames each
        b, c, t, h, w = x.shape
        y = y.reshape(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        if shortcut:
            y = y + x.repeat_interleave(2, dim=2)
        y = torch.cat([x[:, :, :1], y[:, :, 2:]], dim=2)
        f = y.transpose(1, 2).reshape(-1, c, h, w)
        out = up.resample(F.interpolate(f, scale_factor=2.0, mode="nearest"))
        if shortcut:
            out = out + unfold_up(f, 16)
        return out.reshape(b, -1, 16, 2 * h, 2 * w).transpose(1, 2)

    with torch.no_grad():
        want = reference(x)
        got = up(x)
        assert got.shape == want.shape == (2, 16, 5, 18, 14)
        assert (got - want).abs().max() < 1e-12
        up32 = up.float()
        got32 = up32(x.float())
        assert ((got32 - want.float()).abs().max() / want.abs().max()) < 1e-5
