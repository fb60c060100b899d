"""Metrics on real faces with dlib (optional extra: `pip install 'avatarstream[real]'`).

The expert CNNs of `experts.py` are trained on our synthetic avatars; for real photos and videos a
user brings, this module reads faces with dlib's pretrained models instead (dlib-bin, and the
model files of face-recognition-models): the HOG frontal face detector, the 68-point landmark
predictor (iBUG 300-W layout) and the 128-d ResNet face descriptor. Its metrics carry the names of
the expert metrics with the suffix `_real`:

- face_found_real: share of the 2 fps sampled frames (`metrics.sample_indices`) in which a face is
  found (the largest one counts when there are several).
- face_sim_real: cosine similarity between the 128-d descriptor of each sampled frame's face and
  the mean descriptor of up to 16 evenly spaced reference frames, 10% trimmed mean
  (`metrics.trimmed_mean`) over the frames with a face. face_dist_real: the same frames'
  Euclidean distance to that mean descriptor, the number dlib users know (< 0.6: same person in
  dlib's LFW calibration). Both None when no sampled frame has a face.
- mouth_open_real: the track of the inner-lip mouth aspect ratio (MAR, `mouth_aspect_ratio`):
  mean vertical gap between the inner lips (landmark pairs 61-67, 62-66, 63-65, 0-based) over the
  mouth width between the inner corners (60-64). 0 with the lips together; ~0.15 lips apart with
  the teeth showing; 0.3 and more wide open. Read on every frame of the video, except that at most
  `MAX_MOUTH_FRAMES` (250) evenly spaced frames are read from a longer one (landmarks need a face
  detection per frame, ~10-150 ms depending on frame size).
- mouth_audio_corr_real: Pearson correlation of that MAR track with the audio level of the same
  frames (`metrics.frame_energy_db`, floored at 40 dB under the clip's speech level so digital
  silence does not dominate). Frames without a face are left out.
- silence_mouth_closed_real: share of the read frames that are silent (`metrics.silent_frames`)
  whose MAR is under `MAR_CLOSED`.

MAR_CLOSED = 0.10 was calibrated on what dlib's predictor reads here (one reading per image):
closed mouths (open = 0) of 12 synthetic avatars read 0.00-0.08 in 11 of them (the 12th, whose
lips dlib misplaces, 0.13); half open (open = 0.5) mostly 0.10-0.22 and fully open 0.30-0.44
where dlib follows the drawn lips; the astronaut of scikit-image's sample data (Eileen Collins,
smiling with the lips apart and the teeth showing) reads 0.15-0.17. 0.10 separates the closed
readings from a lips-apart smile. It is a calibration on a handful of images, not on a labelled
real-face data set.

Scale: dlib's descriptors are not centred, so the cosine of two different real people is still
high (0.78-0.86 for the LFW faces of scikit-image against the astronaut; drawn avatars 0.88-0.91);
the same person moved and rescaled reads 0.99. Read face_sim_real against those numbers, not
against the expert's face_sim, or use face_dist_real with dlib's 0.6 threshold.

`avatarstream eval VIDEO --reference REF --real` adds these keys to the summary (the reference is
read as the same 256 px square frames the other metrics use; the video at its own size).
A video in which no face is found is a result, not an error (face_found_real = 0, the other keys
None); a reference in which no face is found is an InputError, since nothing can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.errors import InputError
from avatarstream.eval.metrics import frame_energy_db, sample_indices, silent_frames, trimmed_mean
from avatarstream.media.dlib_models import load_dlib

INSTALL_HINT = "pip install 'avatarstream[real]'"
MAR_CLOSED = 0.10  # inner-lip mouth aspect ratio under which the mouth counts as closed (see above)
SAME_PERSON_DIST = 0.6  # dlib's threshold on the descriptor distance for "same person"
MAX_MOUTH_FRAMES = 250  # frames whose landmarks are read for the mouth track (evenly spaced)
MAX_REF_FRAMES = 16  # reference frames averaged into the reference descriptor
DETECT_SIDE = 480  # frames are shrunk (integer factor) until the shorter side is under 2x this for detection
ENERGY_FLOOR_DB = 40.0  # audio level floor under the speech level (95th percentile) for the correlation
INNER_TOP, INNER_BOTTOM, INNER_CORNERS = (61, 62, 63), (67, 66, 65), (60, 64)


@dataclass
class Face:
    """The largest face of a frame: box (left, top, right, bottom) in frame pixels, landmarks
    [68, 2] (x, y) in frame pixels, and dlib's shape object (for the descriptor)."""

    box: tuple[int, int, int, int]
    landmarks: np.ndarray
    shape: Any = field(repr=False)


def mouth_aspect_ratio(landmarks: np.ndarray) -> float:
    """Inner-lip mouth aspect ratio of 68 landmarks [68, 2]: mean distance of the pairs 61-67,
    62-66, 63-65 (upper and lower inner lip) over the distance 60-64 (inner corners)."""
    p = np.asarray(landmarks, np.float64)
    if p.shape != (68, 2):
        raise ValueError(f"expected 68 landmarks [68, 2], got shape {p.shape}")
    gap = np.linalg.norm(p[list(INNER_TOP)] - p[list(INNER_BOTTOM)], axis=1).mean()
    width = np.linalg.norm(p[INNER_CORNERS[0]] - p[INNER_CORNERS[1]])
    return float(gap / width) if width > 0 else float("nan")


class RealFaceExperts:
    """dlib's face detector, 68-point landmark predictor and 128-d face descriptor, loaded on first
    use. `model_dir`: folder with the two .dat files (default: face-recognition-models')."""

    def __init__(self, model_dir: str | Path | None = None) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._dlib: Any = None
        self._detector: Any = None
        self._predictor: Any = None
        self._encoder: Any = None

    def load(self) -> RealFaceExperts:
        """Import dlib and read the models (once); ConfigError naming the install command if missing."""
        if self._encoder is not None:
            return self
        m = load_dlib(self.model_dir, INSTALL_HINT)
        self._dlib, self._detector, self._predictor, self._encoder = m.dlib, m.detector, m.predictor, m.encoder
        return self

    def detect(self, frame: np.ndarray) -> tuple[int, int, int, int] | None:
        """Box (left, top, right, bottom) of the largest face in an [H, W, 3] uint8 frame, or None.

        Large frames are shrunk by an integer factor for detection (HOG cost grows with pixels);
        when nothing is found the detector retries on the image upsampled once, and for small
        frames (shorter side under 320 px after shrinking) twice, so that faces smaller than its
        80 px window are still found."""
        self.load()
        k = max(1, min(frame.shape[:2]) // DETECT_SIDE)
        small = frame if k == 1 else _shrink(frame, k)
        small = np.ascontiguousarray(small, dtype=np.uint8)
        tries = 3 if min(small.shape[:2]) < 320 else 2
        for up in range(tries):
            rects = self._detector(small, up)
            if len(rects):
                r = max(rects, key=lambda r: r.width() * r.height())
                return (r.left() * k, r.top() * k, r.right() * k, r.bottom() * k)
        return None

    def face(self, frame: np.ndarray) -> Face | None:
        """The largest face of an [H, W, 3] uint8 RGB frame with its 68 landmarks, or None."""
        box = self.detect(frame)
        if box is None:
            return None
        img = np.ascontiguousarray(frame, dtype=np.uint8)
        shape = self._predictor(img, self._dlib.rectangle(*box))
        pts = np.array([(shape.part(i).x, shape.part(i).y) for i in range(68)], np.float64)
        return Face(box, pts, shape)

    def descriptor(self, frame: np.ndarray, face: Face) -> np.ndarray:
        """dlib's 128-d face descriptor [128] (float64, not unit length) of a face found in `frame`."""
        img = np.ascontiguousarray(frame, dtype=np.uint8)
        return np.asarray(self._encoder.compute_face_descriptor(img, face.shape), np.float64)


def _shrink(frame: np.ndarray, k: int) -> np.ndarray:
    """Block mean over k x k pixels: [H, W, 3] -> [H // k, W // k, 3] uint8."""
    h, w = frame.shape[0] // k * k, frame.shape[1] // k * k
    x = frame[:h, :w].reshape(h // k, k, w // k, k, -1).mean((1, 3))
    return np.round(x).astype(np.uint8)


@dataclass
class RealEvaluation:
    """Scalars (`metrics`, the `_real` keys) and per-frame tracks (`tracks`)."""

    metrics: dict[str, Any]
    tracks: dict[str, np.ndarray]


def reference_descriptor(ex: RealFaceExperts, reference: np.ndarray, max_frames: int = MAX_REF_FRAMES) -> np.ndarray:
    """Mean 128-d descriptor of up to `max_frames` evenly spaced reference frames [F_r, h, w, 3]
    uint8 (frames without a face are skipped); InputError if no frame shows a face."""
    idx = np.unique(np.linspace(0, len(reference) - 1, min(max_frames, len(reference))).round().astype(int))
    embs = []
    for i in idx:
        f = ex.face(reference[i])
        if f is not None:
            embs.append(ex.descriptor(reference[i], f))
    if not embs:
        raise InputError(f"no face found in the reference ({len(idx)} frame(s) checked with dlib's frontal face "
                         "detector); --real needs a reference showing one face, roughly frontal")
    return np.mean(embs, 0)


def face_similarity_real(ex: RealFaceExperts, frames: np.ndarray, ref_desc: np.ndarray,
                         faces: dict[int, Face | None] | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """face_sim_real, face_dist_real, face_found_real of frames [F, H, W, 3] uint8 (25 fps) against
    a reference descriptor [128], at the 2 fps samples; `faces` caches detections by frame index.
    Returns (metrics, tracks: face_sim_real, face_dist_real (NaN where no face), face_sim_real_idx)."""
    idx = sample_indices(len(frames))
    faces = {} if faces is None else faces
    sims = np.full(len(idx), np.nan)
    dists = np.full(len(idx), np.nan)
    ref_unit = ref_desc / np.linalg.norm(ref_desc)
    for j, i in enumerate(idx):
        if i not in faces:
            faces[i] = ex.face(frames[i])
        f = faces[i]
        if f is not None:
            e = ex.descriptor(frames[i], f)
            sims[j] = float(e @ ref_unit / np.linalg.norm(e))
            dists[j] = float(np.linalg.norm(e - ref_desc))
    found = np.isfinite(sims)
    met = {"face_sim_real": trimmed_mean(sims[found]) if found.any() else None,
           "face_dist_real": trimmed_mean(dists[found]) if found.any() else None,
           "face_found_real": float(found.mean()) if len(idx) else 0.0}
    return met, {"face_sim_real": sims, "face_dist_real": dists, "face_sim_real_idx": idx}


def mouth_frames(n: int, max_frames: int = MAX_MOUTH_FRAMES) -> np.ndarray:
    """Indices of the frames whose mouth is read: all n, or `max_frames` evenly spaced."""
    if n <= max_frames:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_frames).round().astype(int))


def mouth_track_real(ex: RealFaceExperts, frames: np.ndarray, max_frames: int = MAX_MOUTH_FRAMES,
                     faces: dict[int, Face | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(frame indices [K], inner-lip MAR [K], NaN where no face) over `mouth_frames(len(frames))`."""
    idx = mouth_frames(len(frames), max_frames)
    faces = {} if faces is None else faces
    mar = np.full(len(idx), np.nan)
    for j, i in enumerate(idx):
        if i not in faces:
            faces[i] = ex.face(frames[i])
        if faces[i] is not None:
            mar[j] = mouth_aspect_ratio(faces[i].landmarks)
    return idx, mar


def mouth_audio_corr_real(idx: np.ndarray, mar: np.ndarray, audio: np.ndarray, n: int) -> float | None:
    """Pearson correlation of the MAR at frames `idx` with their audio level (dBFS, floored at
    ENERGY_FLOOR_DB under the 95th percentile); None with fewer than 3 frames or a flat track."""
    db = frame_energy_db(audio, n)
    db = np.maximum(db, np.percentile(db, 95) - ENERGY_FLOOR_DB)[idx]
    ok = np.isfinite(mar)
    if ok.sum() < 3 or mar[ok].std() == 0 or db[ok].std() == 0:
        return None
    return float(np.corrcoef(mar[ok], db[ok])[0, 1])


def silence_mouth_closed_real(idx: np.ndarray, mar: np.ndarray, audio: np.ndarray, n: int,
                              closed: float = MAR_CLOSED) -> tuple[float | None, int]:
    """(share of the silent read frames with a face whose MAR < `closed`, number of such frames);
    None when there is none."""
    silent = silent_frames(audio, n)[idx] & np.isfinite(mar)
    if not silent.any():
        return None, 0
    return float((mar[silent] < closed).mean()), int(silent.sum())


def evaluate_real(frames: np.ndarray, reference: np.ndarray | None = None, audio: np.ndarray | None = None,
                  ex: RealFaceExperts | None = None, *, ref_desc: np.ndarray | None = None,
                  max_mouth_frames: int = MAX_MOUTH_FRAMES) -> RealEvaluation:
    """All `_real` metrics of frames [F, H, W, 3] uint8 at 25 fps.

    reference [F_r, h, w, 3] uint8 (or its descriptor `ref_desc`, from `reference_descriptor`);
    audio [N] float32 16 kHz starting with frame 0 (None: no audio metrics). Metrics:
    face_sim_real, face_dist_real, face_found_real, mouth_frames_real (frames read for the mouth),
    and with audio mouth_audio_corr_real, silence_mouth_closed_real, silent_frames_real.
    """
    n = len(frames)
    if n == 0:
        raise InputError("the video has no frames")
    ex = (ex or RealFaceExperts()).load()
    if ref_desc is None:
        if reference is None:
            raise ValueError("give the reference frames or their descriptor")
        ref_desc = reference_descriptor(ex, reference)
    faces: dict[int, Face | None] = {}
    met, tracks = face_similarity_real(ex, frames, ref_desc, faces)
    idx, mar = mouth_track_real(ex, frames, max_mouth_frames, faces)
    met["mouth_frames_real"] = int(len(idx))
    tracks.update(mouth_open_real=mar, mouth_open_real_idx=idx)
    if audio is not None:
        met["mouth_audio_corr_real"] = mouth_audio_corr_real(idx, mar, audio, n)
        met["silence_mouth_closed_real"], met["silent_frames_real"] = silence_mouth_closed_real(idx, mar, audio, n)
    return RealEvaluation(met, tracks)
