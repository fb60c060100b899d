"""Fixtures shared by the weights tests."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """0.5 s of noise at 16 kHz: enough speech for a run that must stop at its weights."""
    path = tmp_path_factory.mktemp("audio") / "a.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.random.default_rng(0).standard_normal(8000) * 3000).astype("<i2").tobytes())
    return path
