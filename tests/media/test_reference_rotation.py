"""A reference is loaded as a viewer sees it: a phone video's display matrix and a JPEG's EXIF
orientation turn its frames upright (`media.reference.upright`), and `source_size` is the upright
(width, height).

Each picture is 64 x 96 upright (portrait) and gray with a red square in its top-left corner. The
files store it turned, as phones do, so the square is stored in another corner; the loaded frame
must show it top-left again and the other corners gray.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image, ImageOps

from avatarstream.media.reference import load_reference

from .rotated import write_rotated

W, H, MARK = 64, 96, 16  # upright width and height; side of the red square
RED, GRAY = (255, 0, 0), (128, 128, 128)
CORNERS = {"top-left": (slice(0, MARK), slice(0, MARK)), "top-right": (slice(0, MARK), slice(-MARK, None)),
           "bottom-left": (slice(-MARK, None), slice(0, MARK)),
           "bottom-right": (slice(-MARK, None), slice(-MARK, None))}


def marked(width: int, height: int) -> np.ndarray:
    """[height, width, 3]: gray with a red square in the top-left corner."""
    img = np.empty((height, width, 3), np.uint8)
    img[:] = GRAY
    img[:MARK, :MARK] = RED
    return img


def red_corners(img: np.ndarray) -> list[str]:
    """The corners of an [H, W, 3] picture that are red (within lossy-codec tolerance); the others
    must be gray."""
    found = []
    for name, (r, c) in CORNERS.items():
        mean = img[r, c].reshape(-1, 3).astype(float).mean(0)
        if np.abs(mean - RED).max() < 40:
            found.append(name)
        else:
            assert np.abs(mean - GRAY).max() < 40, (name, mean)
    return found


def stored_picture(path: Path) -> np.ndarray:
    """The first picture of a file as stored (no rotation applied)."""
    with av.open(str(path)) as c:
        return next(c.decode(video=0)).to_ndarray(format="rgb24")


# rotation (counter-clockwise, the display matrix) -> where the upright top-left square is stored
STORED_AT = {90: "top-right", 180: "bottom-right", 270: "bottom-left"}


@pytest.mark.parametrize("rotation", sorted(STORED_AT))
def test_rotated_video_reference_loads_upright(tmp_path, rotation):
    path = write_rotated(tmp_path / f"phone{rotation}.mp4", marked(W, H)[None], 25, rotation)
    stored = stored_picture(path)
    assert stored.shape == ((H, W, 3) if rotation == 180 else (W, H, 3))
    assert red_corners(stored) == [STORED_AT[rotation]]  # turned back by `rotation` CCW: top-left
    ref = load_reference(path, size=(H, W), max_frames=1)
    assert ref.source_size == (W, H)
    assert ref.frames.shape == (1, 3, H, W)
    assert red_corners(ref.frames[0].permute(1, 2, 0).numpy()) == ["top-left"]


def test_exif_rotated_jpeg_reference_loads_upright(tmp_path):
    """EXIF orientation 6 ("the 0th row is the visual right side": turn 90 degrees clockwise to
    view): the square stored top-left is seen top-right, as Pillow's `exif_transpose` shows it."""
    path = tmp_path / "phone.jpg"
    im = Image.fromarray(marked(H, W))  # stored landscape, 96 x 64
    ex = im.getexif()
    ex[0x0112] = 6
    im.save(path, exif=ex.tobytes(), quality=95)
    seen = np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB"))  # Pillow's reading
    assert seen.shape == (H, W, 3) and red_corners(seen) == ["top-right"]
    ref = load_reference(path, size=(H, W), max_frames=1)
    assert ref.is_image and ref.source_size == (W, H)
    got = ref.frames[0].permute(1, 2, 0).numpy()  # [H, W, 3]
    assert red_corners(got) == ["top-right"]
    assert np.abs(got.astype(np.int16) - seen).mean() < 2.0  # FFmpeg's and Pillow's JPEG decoders
