"""The FlashHead DiT (`models/flashhead/`): the real Pro and Lite configs key for key against the
official lists on the meta device (through the loader's own adapter), and tiny-config shapes,
audio windowing, batching and config errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from avatarstream.models.flashhead import FlashHeadConfig, FlashHeadDiT, latent_windows
from avatarstream.weights.flashhead import FLASHHEAD

KEYS = Path(__file__).resolve().parents[1] / "fixtures" / "real-models"  # real checkpoints' key lists
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("variant, params", [("pro", 1_507_694_912), ("lite", 1_526_864_256)])
def test_real_configs_have_the_official_keys_and_counts(variant: str, params: int) -> None:
    listed = json.loads((KEYS / f"flashhead_{variant}_keys.json").read_text())
    official = {k: tuple(v) for k, v in listed.items()}
    assert len(official) == 843
    with torch.device("meta"):
        net = FlashHeadDiT(getattr(FlashHeadConfig, variant)())
        stored = {k: torch.empty(s) for k, s in official.items()}
    ours = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    mapped = {k: tuple(v.shape) for k, v in FLASHHEAD.state_dict("dit", stored).items()}
    assert mapped == ours  # every official key has its place, with its shape
    dropped = [k for k in official if not FLASHHEAD.state_dict("dit", {k: stored[k]})]
    assert len(dropped) == 12 and all(k.startswith(("text_embedding.", "audio_emb.")) for k in dropped)
    assert len(ours) + len(dropped) == 843
    total = sum(p.numel() for p in net.parameters()) + sum(math.prod(official[k]) for k in dropped)
    assert total == params


def _inputs(c: FlashHeadConfig, frames: int, h: int, w: int, batch: int = 1, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, c.out_channels, frames, h, w, generator=g)
    y = torch.randn(1, c.in_channels - c.out_channels, frames, h, w, generator=g)
    a = c.audio
    audio = torch.randn(batch, 1 + c.frames_per_latent * (frames - 1), a.window, a.layers, a.channels,
                        generator=g)
    return x, audio, y


def _net(c: FlashHeadConfig) -> FlashHeadDiT:
    torch.manual_seed(0)
    return FlashHeadDiT(c).eval()


@pytest.mark.parametrize("variant", ["pro", "lite"])
def test_tiny_forward_shapes_on_non_square_latents(variant: str) -> None:
    c = FlashHeadConfig.tiny()
    if variant == "lite":  # Lite's channels and patch at the tiny width
        c = replace(c, in_channels=256, out_channels=128, patch=(1, 1, 1), vae_stride=(8, 32, 32))
    x, audio, y = _inputs(c, 3, 4, 6)
    with torch.no_grad():
        v = _net(c)(x, torch.tensor(0.5), audio, y)
    assert v.shape == x.shape and torch.isfinite(v).all()


def test_rows_of_a_batch_are_independent() -> None:
    """The official module runs batch 1; ours takes a batch with one σ per row."""
    c = FlashHeadConfig.tiny()
    net = _net(c)
    x, audio, y = _inputs(c, 2, 4, 4, batch=2)
    sig = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        both = net(x, sig, audio, y)
        one = [net(x[i:i + 1], sig[i], audio[i:i + 1], y) for i in range(2)]
    torch.testing.assert_close(both, torch.cat(one), rtol=0, atol=1e-5)


def test_each_latent_hears_its_own_frames() -> None:
    """Latent 0: frame 0's 5 windows; latent j: frame 4j−3's windows 0–2, the centre windows of
    4j−2 and 4j−1, frame 4j's windows 2–4 (Pro, 4 frames per latent)."""
    frames, win = 9, 5
    idx = torch.arange(frames)[:, None] * 10 + torch.arange(win)[None]  # [frames, W] = 10·frame + window
    audio = idx[None, :, :, None, None].float()  # [1, 9, 5, 1, 1]
    first, later = latent_windows(audio, 4)
    assert first.flatten().tolist() == [0, 1, 2, 3, 4]
    assert later[0, 0].tolist() == [10, 11, 12, 22, 32, 42, 43, 44]
    assert later[0, 1].tolist() == [50, 51, 52, 62, 72, 82, 83, 84]
    with pytest.raises(ValueError, match="whole latents"):
        latent_windows(audio[:, :8], 4)


def test_audio_moves_only_its_own_latent_frame_through_cross_attention() -> None:
    """Changing the audio of latent 2 changes the output everywhere (self-attention mixes frames),
    but the context tokens of latents 0 and 1 stay as they were: the context is per frame."""
    c = FlashHeadConfig.tiny()
    net = _net(c)
    _, audio, _ = _inputs(c, 3, 4, 4)
    other = audio.clone()
    other[:, -1] += 1.0  # the last video frame belongs to latent 2 only
    with torch.no_grad():
        a, b = net.audio_proj(audio), net.audio_proj(other)
    assert torch.equal(a[:, :2], b[:, :2]) and not torch.equal(a[:, 2], b[:, 2])


def test_config_errors() -> None:
    official = {"dim": 64, "in_dim": 32, "out_dim": 16, "ffn_dim": 128, "freq_dim": 256, "eps": 1e-6,
                "num_heads": 2, "num_layers": 2, "patch_size": [1, 2, 2], "vae_stride": [4, 8, 8],
                "text_dim": 32, "has_image_input": False}
    assert FlashHeadConfig.from_official(official).dim == 64
    with pytest.raises(ValueError, match="image input"):
        FlashHeadConfig.from_official({**official, "has_image_input": True})
    with pytest.raises(ValueError, match="lacks 'num_layers'"):
        FlashHeadConfig.from_official({k: v for k, v in official.items() if k != "num_layers"})
    with pytest.raises(ValueError, match="head_dim // 3 even"):
        FlashHeadConfig.from_official({**official, "num_heads": 1})  # head_dim 64: 21 is odd
    with pytest.raises(ValueError, match="width-64"):
        FlashHeadConfig.from_official(official, {"output_dim": 1536, "blocks": 4, "channels": 16,
                                                 "intermediate_dim": 32, "context_tokens": 32})
