"""The quality filters of a stretch, each a named measure with its threshold and reason.

A stretch is rejected for every check it fails (`reasons`, in the order below; the first is the
manifest's `reason`):

- `face_too_small`: median face width (jaw to jaw, landmarks 0-16) in the normalised frame under
  `min_face` px: the crop would be upscaled past what the pixels hold.
- `blur`: median variance of the Laplacian (4-neighbour) of the grey face (the landmarks' box in
  the normalised frame, resized to `SHARP_SIDE` px square, bilinear and antialiased) over
  `SAMPLES` evenly spaced frames, under `min_sharpness`. On the face at a fixed size, not on the
  head crop: a crop reaching past the frame's edge has a black border, a sharp edge that would
  hide any blur, and at the face's own size the measure falls as the face grows (the same drawn
  face read 2,136 at 104 px and 631 at 309 px). Calibration at 96 px: sharp faces 373-747 (the
  astronaut, drawn faces of 104-309 px), the same under a 2-3 px Gaussian blur 4-24; in the
  tests' lossy 320 x 240 H.264 videos sharp faces 160-270, the blurred astronaut 6. The default
  60 sits between (geometric middle of 24 and 160).
- `extreme_pose`: more than half the frames with |yaw| > `max_yaw` or |roll| > `max_roll` degrees
  (`faces.head_pose`).
- `no_speech`: under `min_speech` of the frames are speech: a frame's level (RMS over its 40 ms, in
  dBFS) above both `SPEECH_FLOOR_DB` and 30 dB under the stretch's 95th percentile.
- `av_offset`: the audio-video offset, estimated by cross-correlating the mouth opening
  (`faces.mouth_opening`) with the audio level over lags of +-`max_lag` frames, is beyond
  `max_offset_ms`, where the correlation peak reaches `min_sync_corr`. A weaker peak (a face whose
  lips do not move with the sound, a mouth the landmarks do not follow) leaves the offset
  unmeasured and the stretch is not rejected for it. Positive offsets: the audio comes late.
- `duplicate` (decided over all stretches, `graph.py`): perceptual hashes (imagehash's pHash) of
  `SAMPLES` evenly spaced whole frames within a mean Hamming distance `max_hash_distance` of an
  earlier kept stretch's. Whole frames, not head crops: a crop normalises away the framing, so two
  shots of one person sitting still would hash alike; repeated footage hashes alike either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from avatarstream.data.clip import FPS, SPF
from avatarstream.data.curate.faces import face_size, head_pose, mouth_opening

SAMPLES = 4  # evenly spaced frames read for sharpness, hashes and descriptors
SHARP_SIDE = 96  # px: faces are measured for blur at this size
SPEECH_FLOOR_DB = -50.0
SPEECH_BELOW_PEAK_DB = 30.0
LEVEL_FLOOR_DB = 40.0  # audio level floor under the 95th percentile for the correlation


@dataclass(frozen=True)
class Thresholds:
    """The filters' bounds (module doc); pixels of the normalised frame, degrees, shares, frames, ms."""

    min_face: float = 64.0
    min_sharpness: float = 60.0
    max_yaw: float = 40.0
    max_roll: float = 30.0
    min_speech: float = 0.25
    max_lag: int = 15
    max_offset_ms: float = 120.0
    min_sync_corr: float = 0.5
    max_hash_distance: float = 8.0


def sample_indices(n: int, k: int = SAMPLES) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(k, n)).round().astype(int))


def sharpness(frame: np.ndarray, landmarks: np.ndarray, side: int = SHARP_SIDE) -> float:
    """Variance of the 4-neighbour Laplacian of the grey face of an [H, W, 3] uint8 frame (the box
    of its landmarks [68, 2]) resized to side x side."""
    from PIL import Image  # the curate extra (imagehash) brings Pillow

    lo = np.maximum(np.floor(landmarks.min(0)).astype(int), 0)
    hi = np.ceil(landmarks.max(0)).astype(int)
    face = frame[lo[1]:hi[1], lo[0]:hi[0]]
    if min(face.shape[:2]) < 2:
        return 0.0
    g = np.asarray(Image.fromarray(face).convert("L").resize((side, side), Image.Resampling.BILINEAR), np.float64)
    lap = 4 * g[1:-1, 1:-1] - g[:-2, 1:-1] - g[2:, 1:-1] - g[1:-1, :-2] - g[1:-1, 2:]
    return float(lap.var())


def frame_level_db(audio: np.ndarray, n: int) -> np.ndarray:
    """RMS level of each 40 ms frame in dBFS [n] (-120 for digital silence)."""
    x = np.asarray(audio[: n * SPF], np.float64).reshape(n, SPF)
    return 20 * np.log10(np.maximum(np.sqrt((x * x).mean(1)), 1e-6))


def speech_frames(db: np.ndarray) -> np.ndarray:
    """[n] bool: the frames whose level is speech (module doc)."""
    return db > max(SPEECH_FLOOR_DB, float(np.percentile(db, 95)) - SPEECH_BELOW_PEAK_DB)


def av_offset(mouth: np.ndarray, db: np.ndarray, max_lag: int) -> tuple[int, float]:
    """(lag in frames, Pearson correlation at that lag) maximising the correlation of the mouth
    opening at frame i with the audio level at frame i + lag; (0, nan) when it cannot be computed."""
    level = np.maximum(db, np.percentile(db, 95) - LEVEL_FLOOR_DB)
    n = len(mouth)
    best = (0, float("nan"))
    for lag in range(-max_lag, max_lag + 1):
        m, a = (mouth[: n - lag], level[lag:]) if lag >= 0 else (mouth[-lag:], level[: n + lag])
        if len(m) < 10 or m.std() == 0 or a.std() == 0:
            continue
        c = float(np.corrcoef(m, a)[0, 1])
        if not best[1] >= c:  # also replaces nan
            best = (lag, c)
    return best


def measure(th: Thresholds, frames: np.ndarray, landmarks: np.ndarray, audio: np.ndarray) -> dict[str, Any]:
    """The measures of a stretch (frames [n, H, W, 3], landmarks [n, 68, 2], audio [n * 640]) that
    the checks read: face_px, sharpness, extreme_pose_share, speech_share, av_offset_ms (None:
    unmeasured), av_corr (the correlation peak, None when it cannot be computed)."""
    n = len(frames)
    pose = head_pose(landmarks)
    db = frame_level_db(audio, n)
    lag, corr = av_offset(mouth_opening(landmarks), db, th.max_lag)
    measured = bool(np.isfinite(corr) and corr >= th.min_sync_corr)
    idx = sample_indices(n)
    extreme = (np.abs(pose[:, 0]) > th.max_yaw) | (np.abs(pose[:, 2]) > th.max_roll)
    return {"face_px": round(float(np.median(face_size(landmarks))), 2),
            "sharpness": round(float(np.median([sharpness(frames[i], landmarks[i]) for i in idx])), 2),
            "extreme_pose_share": round(float(extreme.mean()), 4),
            "speech_share": round(float(speech_frames(db).mean()), 4),
            "av_offset_ms": lag * 1000.0 / FPS if measured else None,
            "av_corr": round(corr, 4) if np.isfinite(corr) else None}


def reasons(th: Thresholds, m: dict[str, Any]) -> list[str]:
    """The checks a stretch with measures `m` (`measure`) fails, in the module's order
    (duplicates are decided later, over all stretches)."""
    failed = {"face_too_small": m["face_px"] < th.min_face,
              "blur": m["sharpness"] < th.min_sharpness,
              "extreme_pose": m["extreme_pose_share"] > 0.5,
              "no_speech": m["speech_share"] < th.min_speech,
              "av_offset": m["av_offset_ms"] is not None and abs(m["av_offset_ms"]) > th.max_offset_ms}
    return [k for k, bad in failed.items() if bad]
