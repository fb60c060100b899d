"""Videos as a phone writes them: the pictures stored turned, with a display matrix that tells a
player how to turn them back (shared by tests/media and tests/data)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np


def write_rotated(path: Path, frames: np.ndarray, fps: int, rotation: int) -> Path:
    """Lossy H.264 (yuv420p, crf 18) of upright `frames` [n, H, W, 3] uint8 as a phone stores them.

    The display matrix says "turn `rotation` degrees counter-clockwise to show" (PyAV's
    `set_display_rotation`, read back as `VideoFrame.rotation`), so the pictures are stored turned
    `rotation` degrees clockwise: a player that honours the matrix shows `frames`, one that ignores
    it shows them sideways. A multiple of 90; 0 writes an ordinary file with no matrix.
    """
    stored = np.rot90(frames, -(rotation // 90), axes=(1, 2))  # clockwise
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = stored.shape[2], stored.shape[1], "yuv420p"
        s.options = {"crf": "18"}
        s.thread_count = 1
        if rotation:
            s.set_display_rotation(rotation)  # before the first frame is encoded
        for f in stored:
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path
