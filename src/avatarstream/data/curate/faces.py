"""Faces in a shot with dlib: detection on key frames, tracks, landmarks on every frame.

`DlibFaces` loads dlib's HOG frontal face detector, the 68-point landmark predictor (iBUG 300-W
layout) and the 128-d ResNet face descriptor from a folder holding the model files of the
face-recognition-models package (the `real` extra, `default_model_dir`). Unlike the
evaluation's reader, which keeps the largest face of a frame, curation needs every face: a shot
may show two people, and each becomes a track of its own.

Tracking (`track_faces`): faces are detected on every `every`-th frame of a shot (and its last),
upsampling the frame once when nothing is found on a small frame, so that faces down to ~40 px are
still seen (and can be rejected as too small rather than missed). Detections on consecutive key
frames are joined greedily by box overlap (IoU >= 0.3, largest overlap first); a track survives
one key frame without a detection. Boxes between key frames are interpolated linearly and the
landmark predictor runs on every frame in its box, so every frame of a track has 68 landmarks.

Measures read off the landmarks (all per frame):
- head pose, approximate, from 2-D landmarks only: roll is the angle of the line between the eye
  centres; after undoing the roll, yaw is asin of the nose tip's left-right imbalance between the
  jaw ends (0 frontal, +-90 deg a profile) and pitch is the nose tip's height between the eye line
  and the chin relative to a frontal 0.42 (positive: looking down);
- mouth opening: the mean gap between the inner lips (61-67, 62-66, 63-65) over the distance
  between the eye centres (stays put when the mouth widens in a smile).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.media.dlib_models import load_dlib, models_dir

SMALL_FRAME = 400  # frames with a shorter side under this are upsampled once when no face is found
MIN_IOU = 0.3  # box overlap that joins two key-frame detections into one track
NOSE, CHIN, JAW_L, JAW_R = 30, 8, 0, 16
INNER_TOP, INNER_BOTTOM = [61, 62, 63], [67, 66, 65]
FRONTAL_PITCH = 0.42  # nose-tip height between eye line and chin of a frontal face

Box = tuple[float, float, float, float]  # left, top, right, bottom
INSTALL_HINT = "pip install 'avatarstream[real,curate]'"


def default_model_dir() -> Path:
    """The model folder of the face-recognition-models package."""
    return models_dir(INSTALL_HINT)


class DlibFaces:
    """dlib's detector, landmark predictor and face descriptor, loaded from `model_dir`."""

    def __init__(self, model_dir: str | Path) -> None:
        m = load_dlib(model_dir, INSTALL_HINT)
        self._dlib, self._detector, self._predictor, self._encoder = m.dlib, m.detector, m.predictor, m.encoder

    def detect(self, frame: np.ndarray) -> list[Box]:
        """Boxes of every face in an [H, W, 3] uint8 frame, largest first."""
        img = np.ascontiguousarray(frame, dtype=np.uint8)
        tries = 2 if min(img.shape[:2]) < SMALL_FRAME else 1
        for up in range(tries):
            rects = self._detector(img, up)
            if len(rects):
                boxes = [(float(r.left()), float(r.top()), float(r.right()), float(r.bottom())) for r in rects]
                return sorted(boxes, key=lambda b: (-(b[2] - b[0]) * (b[3] - b[1]), b[0], b[1]))
        return []

    def _shape(self, frame: np.ndarray, box: Box) -> Any:
        r = self._dlib.rectangle(*(int(round(v)) for v in box))
        return self._predictor(np.ascontiguousarray(frame, dtype=np.uint8), r)

    def landmarks(self, frame: np.ndarray, box: Box) -> np.ndarray:
        """68 landmarks [68, 2] (x, y) in frame pixels of the face in `box`."""
        s = self._shape(frame, box)
        return np.array([(s.part(i).x, s.part(i).y) for i in range(68)], np.float64)

    def descriptor(self, frame: np.ndarray, box: Box) -> np.ndarray:
        """dlib's 128-d face descriptor [128] of the face in `box`."""
        img = np.ascontiguousarray(frame, dtype=np.uint8)
        return np.asarray(self._encoder.compute_face_descriptor(img, self._shape(img, box)), np.float64)


@dataclass
class Track:
    """One person through part of a shot: frames [start, start + len(boxes)) of the shot."""

    start: int
    boxes: np.ndarray  # [n, 4] left, top, right, bottom (interpolated between key frames)
    landmarks: np.ndarray  # [n, 68, 2]

    @property
    def end(self) -> int:
        return self.start + len(self.boxes)


def iou(a: Box, b: Box) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0.0, w) * max(0.0, h)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def key_frames(n: int, every: int) -> list[int]:
    return sorted(set(range(0, n, max(1, every))) | {n - 1})


def link_detections(keys: list[int], dets: dict[int, list[Box]]) -> list[dict[int, Box]]:
    """Greedy IoU association of key-frame detections into tracks ({key frame: box}); a track
    may miss one key frame."""
    tracks: list[dict[int, Box]] = []
    open_: list[int] = []  # indices of tracks still open
    for j, k in enumerate(keys):
        pairs = sorted(((iou(tracks[t][max(tracks[t])], b), t, i) for t in open_ for i, b in enumerate(dets[k])),
                       reverse=True)
        used_t: set[int] = set()
        used_i: set[int] = set()
        for score, t, i in pairs:
            if score < MIN_IOU or t in used_t or i in used_i:
                continue
            tracks[t][k] = dets[k][i]
            used_t.add(t)
            used_i.add(i)
        for i, b in enumerate(dets[k]):
            if i not in used_i:
                tracks.append({k: b})
                used_t.add(len(tracks) - 1)
        prev = keys[j - 1] if j else None
        open_ = [t for t in range(len(tracks)) if max(tracks[t]) == k or (prev is not None and max(tracks[t]) == prev)]
    return tracks


def interpolate(track: dict[int, Box]) -> tuple[int, np.ndarray]:
    """(first frame, boxes [n, 4]) linearly interpolated between the key frames of a track."""
    ks = sorted(track)
    frames = np.arange(ks[0], ks[-1] + 1)
    cols = [np.interp(frames, ks, [track[k][c] for k in ks]) for c in range(4)]
    return ks[0], np.stack(cols, 1)


def track_faces(faces: DlibFaces, frames: np.ndarray, every: int) -> list[Track]:
    """Tracks of every face in a shot's frames [n, H, W, 3], in order of first frame then position."""
    keys = key_frames(len(frames), every)
    dets = {k: faces.detect(frames[k]) for k in keys}
    out = []
    for t in link_detections(keys, dets):
        start, boxes = interpolate(t)
        lms = np.stack([faces.landmarks(frames[start + i], tuple(b)) for i, b in enumerate(boxes)])
        out.append(Track(start, boxes, lms))
    return sorted(out, key=lambda t: (t.start, float(t.boxes[0, 0])))


def eye_centres(lm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([..., 2] the eye on the image's left, [..., 2] the other) of landmarks [..., 68, 2]."""
    return lm[..., 36:42, :].mean(-2), lm[..., 42:48, :].mean(-2)


def head_pose(lm: np.ndarray) -> np.ndarray:
    """Approximate (yaw, pitch, roll) in degrees [n, 3] of landmarks [n, 68, 2] (module doc)."""
    le, re = eye_centres(lm)
    d = re - le
    roll = np.arctan2(d[:, 1], d[:, 0])
    c, s = np.cos(-roll)[:, None], np.sin(-roll)[:, None]
    centre = (le + re) / 2
    p = lm - centre[:, None]
    x = p[..., 0] * c - p[..., 1] * s  # [n, 68] roll undone
    y = p[..., 0] * s + p[..., 1] * c
    left, right = x[:, NOSE] - x[:, JAW_L], x[:, JAW_R] - x[:, NOSE]
    yaw = np.arcsin(np.clip((left - right) / np.maximum(left + right, 1e-6), -1, 1))
    rel = y[:, NOSE] / np.maximum(y[:, CHIN], 1e-6)
    pitch = np.arcsin(np.clip((rel - FRONTAL_PITCH) / FRONTAL_PITCH, -1, 1))
    return np.degrees(np.stack([yaw, pitch, roll], 1))


def mouth_opening(lm: np.ndarray) -> np.ndarray:
    """Inner-lip gap over the distance between the eye centres [n] of landmarks [n, 68, 2]."""
    gap = np.linalg.norm(lm[:, INNER_TOP] - lm[:, INNER_BOTTOM], axis=-1).mean(-1)
    le, re = eye_centres(lm)
    return gap / np.maximum(np.linalg.norm(re - le, axis=-1), 1e-6)


def face_size(lm: np.ndarray) -> np.ndarray:
    """Face width in pixels [n]: the distance between the jaw ends (landmarks 0 and 16)."""
    return np.linalg.norm(lm[:, JAW_R] - lm[:, JAW_L], axis=-1)
