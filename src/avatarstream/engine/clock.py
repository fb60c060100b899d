"""The media clock: how latent frames, video frames, audio samples and timestamps line up.

The output is one latent *timeline* decoded by a causal VAE with 4x temporal compression and the
first frame alone: timeline latent 0 decodes to video frame 0, timeline latent j >= 1 to the four
video frames 4j-3 .. 4j. Every published video frame i has pts = i / fps exactly; audio sample s has
pts = s / sample_rate. One clock for the whole session: nothing is re-timed per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MediaClock:
    fps: int = 25
    sample_rate: int = 16000
    temporal_stride: int = 4

    def video_span(self, latent_index: int) -> tuple[int, int]:
        """Video frames [start, stop) that timeline latent `latent_index` decodes to."""
        if latent_index < 0:
            raise ValueError(f"latent index must be >= 0, got {latent_index}")
        if latent_index == 0:
            return 0, 1
        s = self.temporal_stride
        return s * latent_index - (s - 1), s * latent_index + 1

    def latents_for_frames(self, n_frames: int) -> int:
        """Smallest number of timeline latents whose decode covers `n_frames` video frames."""
        if n_frames <= 0:
            return 0
        return 1 + math.ceil((n_frames - 1) / self.temporal_stride)

    def frames_for_samples(self, n_samples: int) -> int:
        """Video frames that cover `n_samples` of audio: round(duration * fps), at least 1."""
        if n_samples <= 0:
            return 0
        return max(1, round(n_samples * self.fps / self.sample_rate))

    def samples_for_frames(self, n_frames: int) -> int:
        """Audio samples up to the end of video frame n_frames - 1 (rounded up)."""
        return math.ceil(n_frames * self.sample_rate / self.fps)

    def frame_pts(self, frame_index: int) -> float:
        return frame_index / self.fps
