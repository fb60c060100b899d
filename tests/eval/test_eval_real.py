"""Real-face metrics with dlib (issue 4, item 5), on real photos shipped with scikit-image.

Skipped without the `real` extra (`pip install 'avatarstream[real]'`). Images: the astronaut
(Eileen Collins, NASA, public domain) and faces of the LFW subset in `skimage.data`. dlib's
detector costs ~5-100 ms and its descriptor ~90 ms a frame on one core: frames are kept few.
"""

from __future__ import annotations

import json
import sys

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("dlib")
skdata = pytest.importorskip("skimage.data")

from avatarstream.bench.inputs import speechlike, write_wav  # noqa: E402
from avatarstream.cli import main  # noqa: E402
from avatarstream.data import render_reference  # noqa: E402
from avatarstream.data.features import FaceState  # noqa: E402
from avatarstream.data.identity import Identity  # noqa: E402
from avatarstream.data.render import AvatarRenderer  # noqa: E402
from avatarstream.data.scene import Scene  # noqa: E402
from avatarstream.errors import ConfigError, InputError  # noqa: E402
from avatarstream.eval.real import (MAR_CLOSED, SAME_PERSON_DIST, RealFaceExperts, evaluate_real,  # noqa: E402
                                    mouth_aspect_ratio, mouth_frames, reference_descriptor)
from avatarstream.eval.report import write_png  # noqa: E402

SPF = 640


def resize(img: np.ndarray, h: int, w: int) -> np.ndarray:
    """[H, W, 3] uint8 -> [h, w, 3] uint8 (bilinear, antialiased)."""
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None].float()
    x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
    return np.ascontiguousarray(x[0].permute(1, 2, 0).round().clamp(0, 255).byte().numpy())


def lfw_like(grey: np.ndarray) -> np.ndarray:
    """A 25 x 25 grey face crop (values 0..1) upscaled 4x into a 200 px RGB frame."""
    big = resize(np.repeat((grey * 255).round().astype(np.uint8)[..., None], 3, 2), 100, 100)
    out = np.full((200, 200, 3), int(np.median(big)), np.uint8)
    out[50:150, 50:150] = big
    return out


def write_mp4(path, frames: np.ndarray, fps: int = 25):
    """Lossy H.264 (yuv420p), as a user's video would be."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.height, s.width = frames.shape[1:3]
        s.pix_fmt = "yuv420p"
        s.thread_count = 1
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


@pytest.fixture(scope="module")
def ex():
    torch.set_num_threads(1)
    return RealFaceExperts().load()


@pytest.fixture(scope="module")
def astro():
    return skdata.astronaut()  # [512, 512, 3]; face box about x 179..266, y 83..170


@pytest.fixture(scope="module")
def ref_desc(ex, astro):
    return reference_descriptor(ex, astro[None])


def sim_dist(ex, img, ref):
    f = ex.face(img)
    assert f is not None
    e = ex.descriptor(img, f)
    return float(e @ ref / np.linalg.norm(e) / np.linalg.norm(ref)), float(np.linalg.norm(e - ref))


def test_mouth_aspect_ratio_formula():
    p = np.zeros((68, 2))
    p[60], p[64] = (0, 0), (10, 0)  # inner corners: width 10
    p[[61, 62, 63], 0] = p[[67, 66, 65], 0] = (2.5, 5, 7.5)
    assert mouth_aspect_ratio(p) == 0.0  # inner lips on one line: closed
    p[[61, 62, 63], 1] = (-1, -1.5, -1)
    p[[67, 66, 65], 1] = (1, 1.5, 1)
    assert mouth_aspect_ratio(p) == pytest.approx((2 + 3 + 2) / 3 / 10)
    with pytest.raises(ValueError):
        mouth_aspect_ratio(np.zeros((5, 2)))
    assert mouth_frames(100).tolist() == list(range(100))
    idx = mouth_frames(1000)
    assert len(idx) == 250 and idx[0] == 0 and idx[-1] == 999


def test_face_found_on_a_real_photo(ex, astro):
    f = ex.face(astro)
    assert f is not None
    cx, cy = (f.box[0] + f.box[2]) / 2, (f.box[1] + f.box[3]) / 2
    assert 200 < cx < 245 and 105 < cy < 150, f.box  # her face, not the patch on the suit
    assert f.landmarks.shape == (68, 2)
    x0, y0, x1, y1 = f.box
    assert ((f.landmarks[:, 0] > x0 - 20) & (f.landmarks[:, 0] < x1 + 20)).all()
    # a small frame (face ~44 px, under the detector's 80 px window) is found by upsampling
    assert ex.face(resize(astro, 256, 256)) is not None


def test_face_sim_real_same_shifted_different(ex, astro, ref_desc):
    same, d_same = sim_dist(ex, astro, ref_desc)
    assert same == pytest.approx(1.0, abs=1e-6) and d_same < 1e-6
    moved = resize(astro[37:459, 61:483], 300, 300)  # shifted off-centre and scaled to ~0.71
    shifted, d_shifted = sim_dist(ex, moved, ref_desc)
    assert shifted > 0.9 and d_shifted < SAME_PERSON_DIST, (shifted, d_shifted)
    # different real people: LFW faces, 25 px grey crops; the astronaut degraded the same way
    # stays the same person, so the gap is the identity, not the blur
    lfw = [lfw_like(g) for g in skdata.lfw_subset()[:8]]  # the first 100 are faces
    others = [sim_dist(ex, im, ref_desc) for im in lfw if ex.face(im) is not None]
    assert len(others) >= 6  # a turned head can escape the frontal detector
    f = ex.face(astro)
    x0, y0, x1, y1 = f.box
    crop = astro[y0 - 5:y1 + 5, x0 - 5:x1 + 5].mean(2) / 255.0
    grey = resize(np.repeat(crop[..., None] * 255, 3, 2).astype(np.uint8), 25, 25)[..., 0] / 255.0
    degraded, d_degraded = sim_dist(ex, lfw_like(grey), ref_desc)
    assert d_degraded < SAME_PERSON_DIST, d_degraded
    assert all(d > SAME_PERSON_DIST and d > d_degraded + 0.1 for _, d in others), others
    assert max(s for s, _ in others) < shifted - 0.05, (others, shifted)
    # a drawn avatar is a face to dlib, but further than the shifted copy
    avatar, d_avatar = sim_dist(ex, render_reference(3, 4, 256)[0], ref_desc)
    assert avatar < shifted - 0.03 and d_avatar > d_shifted + 0.2, (avatar, d_avatar)


def test_mouth_aspect_ratio_opens_with_the_mouth(ex, astro):
    # the renderer draws the same avatar with the lips shut and with the jaw fully dropped
    r = AvatarRenderer(Identity.from_seed(8), Scene.from_seed(4), 256)
    mar = []
    for o in (0.0, 1.0):
        f = ex.face(r.render(FaceState(open=o)))
        assert f is not None
        mar.append(mouth_aspect_ratio(f.landmarks))
    assert mar[0] < MAR_CLOSED < mar[1], mar
    # the astronaut smiles with her lips apart and teeth showing: not closed
    assert mouth_aspect_ratio(ex.face(astro).landmarks) > MAR_CLOSED


@pytest.fixture(scope="module")
def media(tmp_path_factory, astro):
    d = tmp_path_factory.mktemp("real")
    head = resize(astro[20:340, 60:380], 256, 256)  # head and shoulders, face ~70 px
    n = 50
    frames = np.stack([np.roll(np.roll(head, round(3 * np.sin(i / 4)), 1), i % 5 - 2, 0) for i in range(n)])
    audio = np.concatenate([np.zeros(20 * SPF, np.float32), speechlike(n / 25 - 0.8)])[:n * SPF]
    noise = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    return {"video": write_mp4(d / "astro.mp4", frames), "wav": write_wav(d / "a.wav", audio),
            "ref": write_png(d / "ref.png", astro), "noise": write_png(d / "noise.png", noise), "dir": d}


def test_eval_cli_real_keys(media, capsys):
    rc = main(["eval", str(media["video"]), "--reference", str(media["ref"]), "--audio", str(media["wav"]),
               "--real", "--no-plots", "--out", str(media["dir"] / "rep"), "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["face_found_real"] == 1.0
    assert r["face_sim_real"] > 0.9 and r["face_dist_real"] < SAME_PERSON_DIST, r
    assert r["mouth_frames_real"] == 50 and len(r["mouth_open_real"]["mar"]) == 50
    assert all(0 <= m < 0.5 for m in r["mouth_open_real"]["mar"])
    assert r["mouth_audio_corr_real"] is None or -1 <= r["mouth_audio_corr_real"] <= 1
    assert r["silent_frames_real"] > 0 and 0 <= r["silence_mouth_closed_real"] <= 1
    assert "face_sim" in r and "sync_c" in r  # the expert metrics are still there


def test_no_face_in_video_is_a_result_no_face_in_reference_an_error(ex, ref_desc, media, capsys):
    blank = np.random.default_rng(1).integers(0, 256, (10, 128, 128, 3), dtype=np.uint8)
    ev = evaluate_real(blank, audio=np.zeros(10 * SPF, np.float32), ex=ex, ref_desc=ref_desc)
    assert ev.metrics["face_found_real"] == 0.0
    assert ev.metrics["face_sim_real"] is None and ev.metrics["face_dist_real"] is None
    assert ev.metrics["mouth_audio_corr_real"] is None and ev.metrics["silence_mouth_closed_real"] is None
    with pytest.raises(InputError, match="no face found in the reference"):
        reference_descriptor(ex, blank[:2])
    rc = main(["eval", str(media["video"]), "--reference", str(media["noise"]), "--audio", str(media["wav"]),
               "--real", "--no-plots", "--out", str(media["dir"] / "rep2")])
    assert rc != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert len(err) == 1 and err[0].startswith("avatarstream: error: no face found in the reference"), err


def test_missing_extra_is_a_config_error(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"shape_predictor_68_face_landmarks.dat not found"):
        RealFaceExperts(model_dir=tmp_path).load()
    monkeypatch.setitem(sys.modules, "dlib", None)  # `import dlib` now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'avatarstream\[real\]'"):
        RealFaceExperts().load()
