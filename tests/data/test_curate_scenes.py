"""Scenes of `avatarstream curate`: shots grouped by what is behind the person (background.py,
graph.assign_scenes), on real frames with known answers (tests/data/curate_inputs.py): our drawn
people over the renderer's backgrounds (scene seeds 11, 12, 13) and scikit-image's astronaut photo
under a moving camera. The same background must be one scene whatever the camera does (pan, zoom,
blur) and whoever sits in front of it; different backgrounds must be different scenes. The
end-to-end check (the pairs of a real run never join one scene) is in test_curate.py.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("dlib")
skdata = pytest.importorskip("skimage.data")

from avatarstream.data.clip import Clip, ClipSpec  # noqa: E402
from avatarstream.data.curate.background import background_descriptor  # noqa: E402
from avatarstream.data.curate.faces import DlibFaces, default_model_dir, track_faces  # noqa: E402
from avatarstream.data.curate.graph import assign_scenes  # noqa: E402
from avatarstream.data.curate.pipeline import CurateConfig  # noqa: E402
from avatarstream.data.curate.stretch import StretchOptions, crop_windows  # noqa: E402

from .curate_inputs import SYNTH_VOICE, camera, fit  # noqa: E402

THRESHOLD = CurateConfig().scene_threshold
FRAMES = 50  # two seconds, a shot of the pipeline tests

# name: (background, how the shot is made); same background = one scene
SHOTS = {
    "A@11": ("bg11", ("synth", 1, 11, 3)),  # person A (identity 1) in scene 11
    "A@11-again": ("bg11", ("synth", 1, 11, 5)),  # the same place, other words and head motion
    "B@11": ("bg11", ("synth", 5, 11, 4)),  # another person (hair, skin, beard, clothes) there
    "B@12": ("bg12", ("synth", 5, 12, 4)),
    "A@12": ("bg12", ("synth", 1, 12, 7)),
    "A@13": ("bg13", ("synth", 1, 13, 6)),
    "astro-pan": ("astro", ("astro", "pan")),  # a cut between camera moves over one photograph
    "astro-zoom-in": ("astro", ("astro", "zoom_in")),
    "astro-zoom-out": ("astro", ("astro", "zoom_out")),
    "astro-blur": ("astro", ("astro", "blur")),
}


def shot_frames(how: tuple) -> np.ndarray:
    if how[0] == "synth":
        _, identity, scene, seed = how
        clip = Clip(ClipSpec(identity=identity, scene=scene, voice=SYNTH_VOICE, seed=seed, seconds=FRAMES / 25,
                             size=256))
        return np.stack([fit(f) for f in clip.frames()])
    return camera(skdata.astronaut(), how[1], FRAMES)


@pytest.fixture(scope="module")
def shots():
    """{name: (background label, frames, tracks as (start, head-crop windows))}."""
    faces, scale = DlibFaces(default_model_dir()), StretchOptions().crop_scale
    out = {}
    for name, (bg, how) in SHOTS.items():
        frames = shot_frames(how)
        tracks = [(t.start, crop_windows(t.landmarks, scale)) for t in track_faces(faces, frames, every=5)]
        assert len(tracks) == 1, name
        out[name] = (bg, frames, tracks)
    return out


def distances(desc: dict[str, np.ndarray], labels: dict[str, str]) -> tuple[list, list]:
    names = list(desc)
    pairs = [(a, b, float(np.linalg.norm(desc[a] - desc[b]))) for i, a in enumerate(names) for b in names[i + 1:]]
    return [p for p in pairs if labels[p[0]] == labels[p[1]]], [p for p in pairs if labels[p[0]] != labels[p[1]]]


def test_one_background_is_close_whatever_the_camera_and_the_person(shots):
    """Same background under other camera moves or another person: well under the threshold;
    different backgrounds: well over it (the margin the default threshold sits in)."""
    desc = {n: background_descriptor(f, t) for n, (_, f, t) in shots.items()}
    assert all(abs(np.linalg.norm(d) - 1) < 1e-9 for d in desc.values())
    same, other = distances(desc, {n: s[0] for n, s in shots.items()})
    worst_same, best_other = max(same, key=lambda p: p[2]), min(other, key=lambda p: p[2])
    print(f"scene descriptor: same background at most {worst_same}, different at least {best_other}")
    assert worst_same[2] < THRESHOLD - 0.2 and best_other[2] > THRESHOLD + 0.3, (worst_same, best_other)


def test_the_person_is_masked_out(shots):
    """Two people over one background: the mask takes their faces, hair and clothes out of the
    descriptor (closer with it than the whole frames are); windows the person fills (nothing
    left around them) are described by their whole frames."""
    (_, fa, ta), (_, fb, tb) = shots["A@11"], shots["B@11"]
    masked = np.linalg.norm(background_descriptor(fa, ta) - background_descriptor(fb, tb))
    whole = np.linalg.norm(background_descriptor(fa, []) - background_descriptor(fb, []))
    assert masked < 0.75 * whole, (masked, whole)
    everywhere = [(0, np.tile([[-10.0, -10.0, 1000.0]], (len(fa), 1)))]  # a head crop over the whole frame
    d = background_descriptor(fa, everywhere)
    assert np.allclose(d, background_descriptor(fa, []))


def records(shots_in_order: list[tuple[str, int, list[float]]]) -> list[dict]:
    """Pipeline-like records (in key order) of one track per window: (shot id, window, background)."""
    return [{"key": f"{sid}-{w:04d}-t0", "shot_id": sid, "window": w, "track": 0, "background": list(bg)}
            for sid, w, bg in shots_in_order]


def test_shots_over_one_background_are_one_scene_across_inputs(shots):
    """Two inputs, each a run of cuts (as a user's two clips filmed in a few places): the scenes
    are the backgrounds, numbered in order of first appearance, and an unreadable shot has none."""
    order = [("v0000-a-s0000", "A@11"), ("v0000-a-s0001", "astro-pan"), ("v0000-a-s0002", "B@12"),
             ("v0000-a-s0003", "astro-zoom-out"), ("v0001-b-s0000", "A@13"), ("v0001-b-s0001", "B@11"),
             ("v0001-b-s0002", "astro-blur"), ("v0001-b-s0003", "A@12"), ("v0001-b-s0004", "A@11-again")]
    recs = records([(sid, 0, background_descriptor(shots[n][1], shots[n][2])) for sid, n in order])
    recs.append({"key": "v0001-b-s0005-0000", "shot_id": "v0001-b-s0005", "window": 0, "track": None,
                 "background": None})
    assign_scenes(recs, THRESHOLD)
    assert [r["scene"] for r in recs] == ["scene-000", "scene-001", "scene-002", "scene-001", "scene-003",
                                          "scene-000", "scene-001", "scene-002", "scene-000", None]


def test_windows_of_one_shot_are_one_scene():
    """A long shot read in windows is one scene even when its windows look apart (the camera
    pans from one wall to another), and a shot like either window joins it."""
    e = np.eye(3)
    recs = records([("v0000-x-s0000", 0, e[0]), ("v0000-x-s0000", 1, e[1]), ("v0000-x-s0001", 0, e[2]),
                    ("v0001-y-s0000", 0, 0.99 * e[1] + 0.141 * e[2])])
    recs.insert(1, dict(recs[0], key="v0000-x-s0000-0000-t1", track=1))  # a second person, same window
    assign_scenes(recs, 0.5)
    assert [r["scene"] for r in recs] == ["scene-000"] * 3 + ["scene-001", "scene-000"]


def test_components_in_row_blocks_equal_the_whole_matrix(monkeypatch):
    """`components` holds ROWS rows of distances at a time (memory linear in the windows): the
    labels equal those of the whole matrix at once, with and without forced groups, exactly."""
    import numpy as np

    from avatarstream.data.curate import graph

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1300, 8))
    groups = [str(i % 37) if i % 5 == 0 else f"own-{i}" for i in range(1300)]
    for forced in (None, groups):
        monkeypatch.setattr(graph, "ROWS", 10**9)
        whole = graph.components(x, 2.0, forced)
        assert 1 < len(set(whole)) < 1300  # a threshold that joins some rows, not all
        for rows in (7, 512):
            monkeypatch.setattr(graph, "ROWS", rows)
            assert graph.components(x, 2.0, forced) == whole
