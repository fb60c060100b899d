"""SampleTimeline: audio kept by sample index until the video frame that carries it takes it.

Used where a stream's audio must leave with its frames (the LiveKit worker's room audio, the
Pipecat service's speech): pieces are added as they are published, `take(a, b)` returns samples
[a, b) with zeros where none were placed and drops everything before b.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class SampleTimeline:
    """Pieces of audio (any dtype, kept as given) by start sample; `take` returns `dtype`."""

    def __init__(self, dtype: type = np.int16) -> None:
        self.dtype = dtype
        self.pieces: deque[tuple[int, np.ndarray]] = deque()

    def add(self, start: int, samples: np.ndarray) -> None:
        self.pieces.append((start, samples))

    def take(self, a: int, b: int) -> np.ndarray:
        """Samples [a, b) (zeros where none were placed); drops everything before b."""
        out = np.zeros(b - a, self.dtype)
        while self.pieces:
            start, x = self.pieces[0]
            end = start + x.size
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                out[lo - a : hi - a] = x[lo - start : hi - start]
            if end > b:
                break
            self.pieces.popleft()
        return out
