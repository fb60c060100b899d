"""Timed media units passed from the engine to the sinks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VideoChunk:
    """frames: [N, H, W, 3] uint8 RGB; the first is timeline frame `start_frame` (pts = index/fps)."""

    frames: np.ndarray
    start_frame: int
    fps: int

    @property
    def end_frame(self) -> int:
        return self.start_frame + int(self.frames.shape[0])

    def pts_seconds(self) -> np.ndarray:
        return (self.start_frame + np.arange(self.frames.shape[0])) / self.fps


@dataclass(frozen=True)
class AudioChunk:
    """samples: [N] float32 mono in [-1, 1]; the first is timeline sample `start_sample`."""

    samples: np.ndarray
    start_sample: int
    sample_rate: int

    @property
    def start_seconds(self) -> float:
        """Presentation time of the first sample (what a consumer timing audio to video needs)."""
        return self.start_sample / self.sample_rate

    @property
    def end_sample(self) -> int:
        return self.start_sample + int(self.samples.shape[0])
