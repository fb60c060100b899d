"""Still images out: PNG through PyAV's png encoder (no imaging library needed)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np

from avatarstream.errors import OutputError


def write_png(path: str | Path, img: np.ndarray) -> Path:
    """[H, W, 3] uint8 -> PNG file; returns the path. An unwritable path is an OutputError."""
    path = Path(path)
    img = np.ascontiguousarray(img)
    try:
        with av.open(str(path), "w", format="image2") as c:
            s = c.add_stream("png", rate=1)
            s.width, s.height, s.pix_fmt = img.shape[1], img.shape[0], "rgb24"
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
            for p in s.encode():
                c.mux(p)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e}") from e
    return path
