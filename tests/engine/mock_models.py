"""Mock models for the engine tests (our own logic only; real models are tested elsewhere).

The mock DiT's clean prediction for a latent frame is the mean of its audio tokens; the mock
refiner upsamples, the mock VAE repeats each latent into its video frames. So every published
pixel tells which audio the engine paired it with: a frame shifted, duplicated or dropped at a
chunk boundary changes the picture, and the test sees it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from avatarstream.engine.clock import MediaClock
from avatarstream.engine.module import Module
from avatarstream.engine.config import ModelSet, PipelineConfig

FPS, SR, W = 25, 16000, 1


def feature(frame: np.ndarray | int) -> np.ndarray:
    return 0.9 * np.sin(0.05 * np.asarray(frame, dtype=np.float64))


class MockRef:
    def __init__(self, frames: int) -> None:
        self.frames = frames
        self.motion = torch.zeros(1, frames, 2)

    def concat(self, other: "MockRef") -> "MockRef":
        return MockRef(self.frames + other.frames)

    def nbytes(self) -> int:
        return 0


class MockDiT(nn.Module):
    def __init__(self, latency: float = 0.0) -> None:
        super().__init__()
        self.latency = latency
        self.ref_frames_seen: list[int] = []

    def encode_reference(self, lat, valid, t_pos):  # noqa: ANN001
        return MockRef(lat.shape[2])

    def forward(self, x, sigma, cond, ref):  # noqa: ANN001
        if self.latency:
            time.sleep(self.latency)
        self.ref_frames_seen.append(ref.frames)
        x0 = cond.audio.mean(dim=(2, 3))[:, None, :, None, None].expand_as(x)  # [B, C, T, h, w]
        s = sigma[:, None, :, None, None]
        eps = (x - (1 - s) * x0) / s.clamp_min(1e-6)
        return SimpleNamespace(velocity=eps - x0, motion_velocity=torch.zeros_like(cond.motion))


class MockRefiner(nn.Module):
    def encode_reference(self, lat, valid, t_pos):  # noqa: ANN001
        return MockRef(lat.shape[2])

    def refine(self, lr, noise, cond, ref, sigma):  # noqa: ANN001
        return lr.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)


class MockConvCache:
    def __init__(self) -> None:
        self.first = True

    def layout(self) -> tuple:
        return ()

    def nbytes(self) -> int:
        return 8


class MockVAE(nn.Module):
    def encode(self, video):  # noqa: ANN001
        b, c, f, h, w = video.shape
        t = 1 + (f - 1) // 4
        z = torch.zeros(b, 1, t, h // 8, w // 8)
        return z, z

    def new_cache(self) -> MockConvCache:
        return MockConvCache()

    def decode_step(self, z, cache):  # noqa: ANN001
        reps = [1 if (cache.first and i == 0) else 4 for i in range(z.shape[2])]
        cache.first = False
        v = z.mean(dim=(1, 3, 4))  # [B, T]
        frames = torch.cat([v[:, i : i + 1].repeat(1, r) for i, r in enumerate(reps)], dim=1)
        return frames[:, None, :, None, None].expand(-1, 3, -1, 8, 8)  # [B, 3, F, 8, 8]


class MockStream:
    """Streaming features with a 2-frame look-ahead: feature(f) for video frame f."""

    def __init__(self) -> None:
        self.samples, self.ended = 0, False

    def push(self, x: torch.Tensor) -> None:
        self.samples += x.numel()

    def end(self) -> None:
        self.ended = True

    def available_frames(self) -> int:
        return 1 << 30 if self.ended else self.samples * FPS // SR - 2

    def features(self, start: int, stop: int) -> torch.Tensor:
        return torch.tensor(feature(np.arange(start, stop)), dtype=torch.float32)[None, :, None]


class MockText(nn.Module):
    def encode(self, prompts):  # noqa: ANN001
        return torch.zeros(len(prompts), 1, 4), torch.ones(len(prompts), 1, dtype=torch.bool)


class ListSink:
    def __init__(self, delay: float = 0.0) -> None:
        self.video: list = []
        self.audio_samples = 0
        self.delay = delay
        self.durable_frames = 0

    def write_video(self, chunk) -> None:  # noqa: ANN001
        if self.delay:
            time.sleep(self.delay)
        self.video.append(chunk)
        self.durable_frames += chunk.frames.shape[0]

    def write_audio(self, chunk) -> None:  # noqa: ANN001
        self.audio_samples += chunk.samples.shape[0]


def mock_models(strategy: str = "prefix", latency: float = 0.0, chunk: int = 5,
                scene: bool = False) -> ModelSet:
    """scene False: every frame follows the audio (the mock DiT's x0), the frame-0 scene frame
    of ref2v / N chunks is tested on its own."""
    # watermark off: these tests check the engine's pixel arithmetic exactly (the mark has its own
    # tests, tests/provenance/test_watermark.py)
    cfg = PipelineConfig(lr_size=32, hr_size=64, latent_channels=1, motion_dim=2, chunk=chunk,
                         ref_frames=2, steps=3, strategy=strategy, audio_window=W, scene_frame=scene,
                         watermark=False)
    return ModelSet(
        name="mock", dit=Module("dit", MockDiT(latency)), refiner=Module("refiner", MockRefiner()),
        vae=Module("vae", MockVAE()), audio=Module("audio", nn.Identity()),
        text=Module("text", MockText()), config=cfg, make_audio_stream=MockStream)


def reference() -> torch.Tensor:
    return torch.randint(0, 255, (1, 3, 64, 64), dtype=torch.uint8)


def audio_chunks(seconds: float, piece: int = 3200):
    return iter(torch.zeros(int(round(seconds * SR))).split(piece))


def expected_pixels(n_frames: int) -> np.ndarray:
    """What the mock chain must show at every video frame: its latent's audio-token mean."""
    clock = MediaClock()
    out = []
    p = 0
    while len(out) < n_frames:
        a, b = clock.video_span(p)
        _, e = a, b
        window = np.arange(e - 4 - W, e + W)
        out.extend([feature(window).mean()] * (b - a))
        p += 1
    v = np.asarray(out[:n_frames])
    return np.round((np.clip(v, -1, 1) + 1) * 127.5)


