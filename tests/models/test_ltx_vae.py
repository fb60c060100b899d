"""The LTX-Video 0.9 VAE (`models/ltx/`): the real config key for key against the on-disk
(diffusers) list on the meta device, and at the tiny config the shapes, the causal encoder, the
non-causal decoder (why it cannot stream), the per-channel normalisation and the sampling option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from avatarstream.models.ltx import LTXVAEConfig, LTXVideoVAE

KEYS = Path(__file__).resolve().parents[1] / "fixtures" / "real-models"  # real checkpoints' key lists
pytestmark = pytest.mark.usefixtures("one_thread")


def test_real_config_has_the_on_disk_keys_and_counts() -> None:
    listed = json.loads((KEYS / "ltx_vae_diffusers_keys.json").read_text())
    official = {k: tuple(v) for k, v in listed.items()}
    with torch.device("meta"):
        vae = LTXVideoVAE(LTXVAEConfig())
    ours = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    assert len(ours) == 190 and ours == official  # a downloaded VAE_LTX file loads with no renames
    assert sum(v.numel() for v in vae.state_dict().values()) == 419_193_905
    assert (vae.spatial_factor, vae.temporal_factor) == (32, 8)


def _vae(seed: int = 0, stats: bool = True) -> LTXVideoVAE:
    torch.manual_seed(seed)
    vae = LTXVideoVAE(LTXVAEConfig.tiny()).eval()
    if stats:
        g = torch.Generator().manual_seed(seed + 1)
        vae.latents_mean.copy_(0.2 * torch.randn(8, generator=g))
        vae.latents_std.copy_(torch.exp(0.3 * torch.randn(8, generator=g)))
    return vae


def _video(frames: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(1, 3, frames, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
@pytest.mark.parametrize("frames, h, w", [(9, 64, 64), (17, 64, 96), (1, 32, 32)])
def test_shapes_square_and_not(frames: int, h: int, w: int) -> None:
    vae = _vae()
    z = vae.encode(_video(frames, h, w))
    t = 1 + (frames - 1) // 8
    assert z.shape == (1, 8, t, h // 32, w // 32)
    assert vae.decode(z).shape == (1, 3, frames, h, w)


@torch.no_grad()
def test_encoder_is_causal_decoder_is_not() -> None:
    """Frames ≥ 9 do not touch latents 0-1 (bit for bit); the last latent moves the first frame:
    the decoder sees the future, which is why `decode` takes whole chunks only."""
    vae = _vae()
    video = _video(17, 64, 64)
    later = video.clone()
    later[:, :, 9:] = _video(8, 64, 64, seed=1)
    a, b = vae.encode(video), vae.encode(later)
    assert torch.equal(a[:, :, :2], b[:, :, :2]) and not torch.allclose(a[:, :, 2], b[:, :, 2])
    z2 = a.clone()
    z2[:, :, -1] += 1.0
    assert (vae.decode(a)[:, :, 0] - vae.decode(z2)[:, :, 0]).abs().max() > 1e-4


@torch.no_grad()
def test_latents_are_normalised_per_channel() -> None:
    vae, plain = _vae(stats=True), _vae(stats=False)  # same weights, statistics (0, 1) in `plain`
    video = _video(9, 64, 64)
    mean, std = vae.latents_mean.view(1, -1, 1, 1, 1), vae.latents_std.view(1, -1, 1, 1, 1)
    torch.testing.assert_close(vae.encode(video), (plain.encode(video) - mean) / std)
    z = torch.randn(1, 8, 2, 2, 2)
    torch.testing.assert_close(vae.decode(z), plain.decode(z * std + mean))


@torch.no_grad()
def test_mode_by_default_sample_with_a_generator() -> None:
    vae, video = _vae(), _video(9, 64, 64)
    mode = vae.encode(video)
    assert torch.equal(mode, vae.encode(video))  # deterministic
    s1 = vae.encode(video, generator=torch.Generator().manual_seed(3))
    s2 = vae.encode(video, generator=torch.Generator().manual_seed(3))
    assert torch.equal(s1, s2) and not torch.allclose(s1, mode)
    _, logvar = vae.latent_dist(video)
    assert logvar.shape == mode.shape and torch.all(logvar == logvar[:, :1])  # one shared variance


def test_bad_shapes_and_configs() -> None:
    vae = _vae()
    with pytest.raises(ValueError, match="1\\+8k frames"):
        vae.encode(_video(8, 64, 64))
    with pytest.raises(ValueError, match="multiples of 32"):
        vae.encode(_video(9, 48, 64))
    with pytest.raises(ValueError, match="latents must be"):
        vae.decode(torch.zeros(1, 4, 2, 2, 2))
    with pytest.raises(ValueError, match="one layer count per stage"):
        LTXVAEConfig(layers_per_block=(1, 1, 1))
    with pytest.raises(ValueError, match="latent_log_var"):
        LTXVAEConfig(latent_log_var="none")
