"""The Wan VAE's RMS norm as √(Σx²) over channels (the fast path) against `F.normalize` (the
official arithmetic, the plain path): per position, and through whole FlashHead chunks of the
tiny folder in the official layout (decode, colour correction, motion re-encode fed back into
the next chunk's DiT).

Tolerances: the normalised vectors within 4e-7 of each other (float rounding of a different
summation order, measured 1.2e-7); over 3 chunks the decoded latents within 1e-5 · max(1, |x|)
(the flashhead-dit parity bound) and the published frames within 1 grey level (a rounding
boundary crossed; measured 0).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from avatarstream.models.wan.vae_blocks import RMSNorm

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The official arithmetic: `F.normalize(x, dim=1) * scale * gamma`."""
    return F.normalize(x, dim=1) * self.scale * self.gamma


@pytest.mark.parametrize("shape", [(1, 4, 1, 64, 64), (2, 24, 3, 9, 7), (3, 8, 5, 5)])
def test_rms_norm_equals_f_normalize(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[1], video=len(shape) == 5)
    with torch.no_grad():
        norm.gamma.copy_(1 + 0.2 * torch.randn(norm.gamma.shape, generator=g))
    x = torch.randn(shape, generator=g) * 3
    x[0, :, 0] = 0.0  # an all-zero channel vector: eps keeps it 0, as F.normalize does
    fast, plain = norm(x), plain_forward(norm, x)
    assert torch.equal(fast[0, :, 0], torch.zeros_like(fast[0, :, 0]))
    assert (fast - plain).abs().max().item() <= 4e-7 * plain.abs().max().item()


def _chunks(folder: Path, n: int) -> tuple[list[torch.Tensor], list[np.ndarray]]:
    """n chunks of the tiny folder through the engine: (latents decoded, frames published)."""
    from dataclasses import replace

    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.eval.benchmark import CollectSink
    from avatarstream.registry import load_model

    models = load_model(f"flashhead-pro:{folder}", bf16=False)
    vae = models.vae.model
    latents: list[torch.Tensor] = []
    real_decode = vae.decode

    def recording_decode(z: torch.Tensor, **kw: object) -> torch.Tensor:
        latents.append(z.clone())
        return real_decode(z, **kw)

    vae.decode = recording_decode
    c = replace(models.config, watermark=False)
    g = torch.Generator().manual_seed(3)
    ref = (torch.rand(1, 3, c.hr_size, c.hr_size, generator=g) * 255).to(torch.uint8)
    wave = 0.3 * torch.randn(28 * 640 * n, generator=g)
    sink = CollectSink()
    summary = Pipeline(models, c).run(ref, iter(wave.split(4000)), [sink])
    assert summary.chunks == n == len(latents)
    return latents, sink.frames


def test_tiny_flashhead_chunks_equal_the_plain_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from avatarstream.weights.flashhead_folder import write_official_folder

    folder = write_official_folder(tmp_path / "fh", "pro")
    fast_lat, fast_frames = _chunks(folder, 3)
    monkeypatch.setattr(RMSNorm, "forward", plain_forward)
    plain_lat, plain_frames = _chunks(folder, 3)
    for k, (a, b) in enumerate(zip(fast_lat, plain_lat)):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item()), k
    assert len(fast_frames) == len(plain_frames) == 84  # 3 chunks of 28 new frames
    diff = np.abs(np.stack(fast_frames).astype(int) - np.stack(plain_frames).astype(int)).max()
    assert diff <= 1
