"""Wan2.1 VAE (models/wan/vae.py, vae_blocks.py): the official key layout at the real size (meta
device), shapes, streamed == whole (bit for bit, any chunking, decode and encode), the one-pass
computation agreeing with the piecewise one, causality, explicit latent normalisation and batched
caches. Tiny configs: each test is well under a second."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from avatarstream.cache.conv import ConvCache
from avatarstream.models.wan.vae import WanVAE, WanVAEConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def make(cfg: WanVAEConfig | None = None, seed: int = 0) -> WanVAE:
    """A tiny VAE with random weights in the fixtures' spirit (gains 1 + 0.2·N, weights
    N/√fan_in, biases 0.2·N), so no path is trivially zero."""
    vae = WanVAE(cfg or WanVAEConfig.tiny()).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            n = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * n if name.endswith("gamma") else
                    0.2 * n if p.dim() == 1 else n / p[0].numel() ** 0.5)
    return vae


def latents(vae: WanVAE, t: int, h: int = 2, w: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, vae.cfg.z_dim, t, h, w, generator=torch.Generator().manual_seed(seed))


def video(frames: int, h: int = 16, w: int = 24, seed: int = 2) -> torch.Tensor:
    return torch.rand(1, 3, frames, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_real_config_key_layout_on_meta():
    with torch.device("meta"):
        vae = WanVAE(WanVAEConfig())
    sd = vae.state_dict()
    assert len(sd) == 194  # docs/real-models.md: 194 tensors, 126.9 M parameters
    assert round(sum(t.numel() for t in sd.values()) / 1e6, 1) == 126.9
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    assert shapes["encoder.conv1.weight"] == (96, 3, 3, 3, 3)
    assert shapes["encoder.downsamples.0.residual.0.gamma"] == (96, 1, 1, 1)
    assert shapes["encoder.downsamples.5.time_conv.weight"] == (192, 192, 3, 1, 1)
    assert shapes["encoder.middle.1.norm.gamma"] == (384, 1, 1)
    assert shapes["encoder.head.2.weight"] == (32, 384, 3, 3, 3)
    assert shapes["conv1.weight"] == (32, 32, 1, 1, 1) and shapes["conv2.weight"] == (16, 16, 1, 1, 1)
    assert shapes["decoder.upsamples.3.time_conv.weight"] == (768, 384, 3, 1, 1)
    assert shapes["decoder.upsamples.4.shortcut.weight"] == (384, 192, 1, 1, 1)
    assert shapes["decoder.upsamples.11.resample.1.weight"] == (96, 192, 3, 3)
    assert "decoder.upsamples.11.time_conv.weight" not in shapes  # the last upsampler is 2D only
    assert shapes["decoder.head.2.weight"] == (3, 96, 3, 3, 3)
    assert not any("latent_norm" in k for k in sd)  # the statistics are not checkpoint tensors
    assert vae.spatial_factor == 8 and vae.temporal_factor == 4


def test_from_official_kwargs():
    cfg = WanVAEConfig.from_official({"dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                                      "attn_scales": [], "temperal_downsample": [False, True, True],
                                      "dropout": 0.0})
    assert cfg == WanVAEConfig()
    with pytest.raises(ValueError, match="not Wan VAE constructor arguments"):
        WanVAEConfig.from_official({"dim": 96, "channels": 3})
    with pytest.raises(ValueError, match="z_dim"):
        WanVAEConfig.from_official({"z_dim": 4})  # the Wan2.1 statistics have 16 channels


def test_shapes_and_frame_rules():
    vae = make()
    with torch.inference_mode():
        for k in (0, 1, 3):
            mean, logvar = vae.encode(video(1 + 4 * k))
            assert mean.shape == logvar.shape == (1, 4, 1 + k, 2, 3)
            assert vae.decode(mean).shape == (1, 3, 1 + 4 * k, 16, 24)
        x = vae.decode(latents(vae, 3) * 50, clamp=False)
        assert x.abs().max() > 1 and vae.decode(latents(vae, 3) * 50).abs().max() <= 1
        for bad in (video(4), video(5, h=12)):
            with pytest.raises(ValueError, match="video must be"):
                vae.encode(bad)
        with pytest.raises(ValueError, match="latents must be"):
            vae.decode(torch.zeros(1, 3, 2, 2, 2))
        cache = vae.new_cache()
        vae.encode_step(video(5), cache)
        with pytest.raises(ValueError, match="4k"):
            vae.encode_step(video(5), cache)  # after the first chunk: 4k frames


@pytest.mark.parametrize("sizes", [[1, 1, 1, 1, 1], [2, 3], [3, 1, 1], [1, 4], [5]])
def test_streaming_decode_equals_whole_bit_for_bit(sizes):
    vae = make()
    z = latents(vae, sum(sizes))
    with torch.inference_mode():
        whole = vae.decode(z, clamp=False)
        cache = vae.new_cache()
        parts, start = [], 0
        for n in sizes:
            parts.append(vae.decode_step(z[:, :, start : start + n], cache, clamp=False))
            assert parts[-1].shape[2] == (1 + 4 * (n - 1) if start == 0 else 4 * n)
            start += n
    assert torch.equal(torch.cat(parts, dim=2), whole)
    assert cache.direction == "decode" and cache.chunks == len(sizes)


def test_cache_is_bounded_and_keeps_two_frames():
    vae = make()
    z = latents(vae, 6)
    cache = vae.new_cache()
    with torch.inference_mode():
        vae.decode_step(z[:, :, :1], cache)
        layout, nbytes = cache.layout(), cache.nbytes()
        for i in range(1, 6):
            vae.decode_step(z[:, :, i : i + 1], cache)
            assert cache.layout() == layout and cache.nbytes() == nbytes
    # a causal conv keeps two input frames; the temporal upsamplers' history is still zeros after
    # a first chunk of one latent (the stream's first frame is not part of it)
    assert all(v.shape[2] == 2 for v in cache.frames.values())
    fresh = vae.new_cache()
    with torch.inference_mode():
        vae.decode_step(z[:, :, :1], fresh)
    time_convs = [v for k, v in fresh.frames.items() if k.endswith("time_conv")]
    assert len(time_convs) == 2 and not any(v.any() for v in time_convs)


def test_one_pass_equals_piecewise():
    """The layers' whole-sequence rules (first frame alone through the temporal resamplers, zero
    history) against the official piecewise order: the same numbers up to float rounding."""
    vae = make(dataclasses.replace(WanVAEConfig.tiny(), attn_scales=(1.0, 0.5)))
    z, v = latents(vae, 4), video(13)
    with torch.inference_mode():
        whole = vae.decoder(vae.conv2(vae.latent_norm.denormalise(z)))
        torch.testing.assert_close(whole, vae.decode(z, clamp=False), rtol=0, atol=1e-5)
        h = vae.encoder(v)
        mean = vae.latent_norm.normalise(vae.conv1(h)[:, :4])
        torch.testing.assert_close(mean, vae.encode(v)[0], rtol=0, atol=1e-5)


def test_streaming_encode_equals_whole_bit_for_bit():
    vae = make()
    v = video(17)
    with torch.inference_mode():
        mean, logvar = vae.encode(v)
        cache = vae.new_cache()
        parts = [vae.encode_step(v[:, :, a:b], cache) for a, b in ((0, 5), (5, 13), (13, 17))]
    assert torch.equal(torch.cat([p[0] for p in parts], 2), mean)
    assert torch.equal(torch.cat([p[1] for p in parts], 2), logvar)
    with pytest.raises(ValueError, match="decode"):
        vae.decode_step(mean, cache)  # one cache, one direction


def test_decode_is_causal():
    vae = make()
    z = latents(vae, 5)
    z2 = z.clone()
    z2[:, :, 3] += 1.0
    with torch.inference_mode():
        a, b = vae.decode(z, clamp=False), vae.decode(z2, clamp=False)
    assert torch.equal(a[:, :, :9], b[:, :, :9])  # frames of latents 0..2
    assert not torch.equal(a[:, :, 9:13], b[:, :, 9:13])


def test_latent_normalisation_is_explicit():
    """Only the statistics differ: encode is (μ − mean)·(1/std), decode un-normalises first."""
    cfg = WanVAEConfig.tiny()
    plain = dataclasses.replace(cfg, latent_mean=(0.0,) * 4, latent_std=(1.0,) * 4)
    a, b = make(cfg), make(plain)
    mean, std = torch.tensor(cfg.latent_mean).view(1, 4, 1, 1, 1), torch.tensor(cfg.latent_std).view(1, 4, 1, 1, 1)
    v = video(5)
    with torch.inference_mode():
        (mu_a, lv_a), (mu_b, lv_b) = a.encode(v), b.encode(v)
        torch.testing.assert_close(mu_a, (mu_b - mean) * (1.0 / std), rtol=0, atol=0)
        torch.testing.assert_close(lv_a, lv_b - 2 * torch.log(std), rtol=0, atol=1e-6)
        torch.testing.assert_close(a.decode(mu_a, clamp=False), b.decode(mu_b, clamp=False),
                                   rtol=0, atol=1e-5)


def test_meta_build_then_init_buffers():
    with torch.device("meta"):
        vae = WanVAE(WanVAEConfig.tiny())
    assert vae.latent_norm.mean.is_meta
    vae.init_buffers_()
    assert vae.latent_norm.mean.device.type == "cpu"
    assert torch.equal(vae.latent_norm.inv_std, 1.0 / torch.tensor(WanVAEConfig.tiny().latent_std))


def test_batched_caches_match_single_streams():
    """The engine stacks sessions' caches into one batch (ConvCache.stack/split)."""
    vae = make()
    zs = [latents(vae, 3, seed=s) for s in (1, 2)]
    with torch.inference_mode():
        alone = [vae.decode(z, clamp=False) for z in zs]
        caches = [vae.new_cache(), vae.new_cache()]
        out = []
        for i in range(3):
            stacked = ConvCache.stack(caches) if i else vae.new_cache()
            out.append(vae.decode_step(torch.cat([z[:, :, i : i + 1] for z in zs]), stacked, clamp=False))
            ConvCache.split(stacked, caches)
    got = torch.cat(out, 2)
    for b in range(2):
        torch.testing.assert_close(got[b : b + 1], alone[b], rtol=0, atol=1e-5)
