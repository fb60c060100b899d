"""`curate` honours a phone video's display rotation (the user's own iPhone footage).

A portrait clip of scikit-image's astronaut photograph (Eileen Collins, NASA, public domain; a
slow pan, 1.2 s at 30 fps) is written twice: upright, and as a phone stores it (the pictures turned,
a display matrix of 90, 180 or 270 degrees, tests/media/rotated.py). Normalising the turned file
must give what normalising the upright one gives: the same upright size and the same frames, up
to the two lossy H.264 encodes of differently turned pixel grids: mean absolute difference under
MAX_MEAN_DIFF = 2 levels of 255 (measured 1.35-1.43; the same frames one pixel apart differ by ~7,
one frame apart by ~3.2). dlib must find her face through the whole turned clip, with landmarks
within a pixel of the upright clip's on average (measured 0.16-0.19 px), where on the stored
pictures (what curate read before) it finds none.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dlib")
pytest.importorskip("scenedetect")
skdata = pytest.importorskip("skimage.data")

from media.rotated import write_rotated  # noqa: E402

from avatarstream.data.curate import CurateConfig  # noqa: E402
from avatarstream.data.curate.faces import DlibFaces, default_model_dir, track_faces  # noqa: E402
from avatarstream.data.curate.normalise import NormalisedVideo, normalise_video, read_frames  # noqa: E402

FPS_IN, N_IN = 30, 36  # 1.2 s at 30 fps: 30 frames at 25 fps
MAX_SIDE = 256  # the 240 x 320 portrait is shrunk to 192 x 256 (exercises the resize)
MAX_MEAN_DIFF = 2.0  # mean |rotated - upright| of the normalised frames, levels of 255 (module doc)
EVERY = 5  # key-frame interval of the face tracker


def portrait() -> np.ndarray:
    """[36, 320, 240, 3]: a 240 x 320 portrait window on the astronaut panning 16 px right."""
    astro = skdata.astronaut()  # [512, 512, 3]
    return np.stack([astro[0:320, x:x + 240] for x in np.round(np.linspace(100, 116, N_IN)).astype(int)])


def normalise(path: Path, name: str) -> tuple[NormalisedVideo, np.ndarray]:
    c = CurateConfig()
    nv = normalise_video(str(path), name, path.parent, MAX_SIDE, c.cut_threshold, c.min_shot_frames)
    return nv, read_frames(nv.video_path, 0, nv.frames)


@pytest.fixture(scope="module")
def upright(tmp_path_factory):
    """(upright frames, the upright file normalised, its frames, dlib)."""
    frames = portrait()
    path = write_rotated(tmp_path_factory.mktemp("rot") / "upright.mp4", frames, FPS_IN, 0)
    nv, out = normalise(path, "v0000-upright")
    return frames, nv, out, DlibFaces(default_model_dir())


@pytest.mark.parametrize("rotation", [90, 180, 270])
def test_rotated_phone_video_is_normalised_upright(upright, tmp_path, rotation):
    frames, nv0, out0, faces = upright
    assert (nv0.width, nv0.height, nv0.frames) == (192, 256, 30)
    path = write_rotated(tmp_path / f"phone{rotation}.mp4", frames, FPS_IN, rotation)
    nv, out = normalise(path, f"v0001-phone{rotation}")
    assert (nv.width, nv.height, nv.frames, nv.shots) == (nv0.width, nv0.height, nv0.frames, nv0.shots)
    assert out.shape == out0.shape == (30, 256, 192, 3)
    diff = np.abs(out.astype(np.int16) - out0).mean()
    assert diff < MAX_MEAN_DIFF, diff

    tracks = track_faces(faces, out, EVERY)  # curate's face step on the normalised turned file
    assert len(tracks) == 1 and (tracks[0].start, tracks[0].end) == (0, nv.frames)
    want = track_faces(faces, out0, EVERY)[0].landmarks
    assert np.abs(tracks[0].landmarks - want).mean() < 1.0  # px: the same face, in the same place

    stored = np.ascontiguousarray(np.rot90(out[0], -(rotation // 90)))  # the picture as stored
    assert faces.detect(stored) == []  # read without the rotation, the face is missed
