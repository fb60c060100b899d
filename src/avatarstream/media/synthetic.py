"""Synthetic inputs: a drawn face image and speech-like audio (and a WAV writer for them).

They exercise the engine with realistic sizes and rates; they are not training data. The
benchmarks and tests use them, and so does the server (its capacity calibration and default
avatar), which is why they live in `media/` and not in `bench/`.
"""

from __future__ import annotations

import math
import wave
from pathlib import Path

import numpy as np


def face_image(size: int = 256, seed: int = 0) -> np.ndarray:
    """[size, size, 3] uint8: a shaded oval face with eyes and a mouth on a gradient background."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    img = np.empty((size, size, 3), np.float32)
    bg = rng.uniform(0.2, 0.8, 3)
    img[:] = bg * (0.7 + 0.3 * y[..., None])
    face = ((x - 0.5) / 0.28) ** 2 + ((y - 0.5) / 0.36) ** 2 < 1
    skin = rng.uniform([0.55, 0.35, 0.25], [0.95, 0.8, 0.7])
    shade = 0.75 + 0.25 * (1 - x)
    img[face] = (skin * shade[..., None])[face]
    for ex in (0.4, 0.6):
        eye = ((x - ex) / 0.04) ** 2 + ((y - 0.42) / 0.025) ** 2 < 1
        img[eye] = (0.1, 0.1, 0.15)
    mouth = ((x - 0.5) / 0.09) ** 2 + ((y - 0.66) / 0.025) ** 2 < 1
    img[mouth] = (0.55, 0.1, 0.12)
    return (img.clip(0, 1) * 255).astype(np.uint8)


def speechlike(seconds: float, sample_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """Float32 mono: syllable-rate (4 Hz) amplitude-modulated harmonic bursts with pauses."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    t = np.arange(n, dtype=np.float64) / sample_rate
    f0 = 120 + 30 * np.sin(2 * math.pi * 0.3 * t)
    phase = 2 * math.pi * np.cumsum(f0) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    env = np.clip(np.sin(2 * math.pi * 4.0 * t), 0, None) ** 2
    pauses = (np.sin(2 * math.pi * 0.25 * t + rng.uniform(0, 6)) > -0.6).astype(np.float64)
    x = 0.3 * voice * env * pauses + 0.003 * rng.standard_normal(n)
    return x.astype(np.float32)


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int = 16000, channels: int = 1) -> Path:
    path = Path(path)
    data = np.clip(samples, -1, 1)
    if channels == 2:
        data = np.stack([data, data], axis=1)
    pcm = (data * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return path
