"""One window of a shot in, its stretches out: tracks, head crops, measures and verdicts.

Shots are read in windows of at most `max_frames` frames (`windows`: a longer shot is cut into
equal parts, so a worker never holds more than one window of frames); a stretch is one track (one
person) in one window. For each stretch `window_records` reads the measures of `filters.py`, and
for a stretch that passes makes the head crops and writes them with the audio into the work folder
(`KEY.mkv`, `KEY.wav`; the driver later moves the kept ones into the shards). Every stretch, kept
or not, and every window without a usable track becomes a record for the manifest, each with its
shot (`shot_id`) and the window's background descriptor (`background.py`, every track masked out),
from which the driver groups shots into scenes (`graph.assign_scenes`).

Head crops: a square around the landmarks' bounding box, `crop_scale` times its longer side, its
centre raised by a tenth of the side (hair and the top of the head), centre and side smoothed over
`SMOOTH` frames so the crop does not shake with the landmarks; taken with bilinear resampling at
the training size (`size`, the shards' frame size), the parts outside the frame black. Landmarks
are stored in crop pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.data.clip import FPS, SAMPLE_RATE, SPF
from avatarstream.data.curate import faces as F
from avatarstream.data.curate.background import background_descriptor
from avatarstream.data.curate.filters import (Thresholds, frame_level_db, measure, reasons, sample_indices,
                                              speech_frames)
from avatarstream.data.shards import write_pcm, write_video

SMOOTH = 9  # frames in the moving average of crop centre and side


@dataclass(frozen=True)
class StretchOptions:
    """Crop size (the shards' frame size), crop scale, detection interval, stretch length bounds
    in frames, and the filters' thresholds."""

    size: int = 256
    crop_scale: float = 2.2
    detect_every: int = 5
    min_frames: int = 25
    max_frames: int = 250
    thresholds: Thresholds = field(default_factory=Thresholds)


def _r(x: np.ndarray, nd: int = 3) -> list:
    return np.round(np.asarray(x, np.float64), nd).tolist()


def windows(n: int, max_frames: int) -> list[tuple[int, int]]:
    """[start, end) cuts of n frames into the fewest equal parts of at most max_frames."""
    k = -(-n // max_frames)
    edges = np.linspace(0, n, k + 1).round().astype(int)
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def smooth(x: np.ndarray, k: int = SMOOTH) -> np.ndarray:
    """Centred moving average along axis 0, edges repeated: [n, ...] -> [n, ...]."""
    h = k // 2
    p = np.concatenate([np.repeat(x[:1], h, 0), x, np.repeat(x[-1:], h, 0)])
    c = np.cumsum(np.concatenate([np.zeros_like(x[:1]), p]), 0)
    return (c[k:] - c[:-k]) / k


def crop_windows(lm: np.ndarray, scale: float) -> np.ndarray:
    """Square crop windows [n, 3] (left, top, side) in frame pixels for landmarks [n, 68, 2]."""
    lo, hi = lm.min(1), lm.max(1)  # [n, 2]
    side = smooth(scale * (hi - lo).max(1))
    centre = smooth((lo + hi) / 2)
    centre[:, 1] -= 0.1 * side
    return np.stack([centre[:, 0] - side / 2, centre[:, 1] - side / 2, side], 1)


def crop(frame: np.ndarray, window: np.ndarray, size: int) -> np.ndarray:
    """[size, size, 3] uint8: the square `window` (left, top, side) of a frame, bilinear."""
    from PIL import Image  # the curate extra (imagehash) brings Pillow

    x0, y0, s = (float(v) for v in window)
    img = Image.fromarray(frame).transform((size, size), Image.Transform.EXTENT, (x0, y0, x0 + s, y0 + s),
                                           resample=Image.Resampling.BILINEAR, fillcolor=(0, 0, 0))
    return np.asarray(img)


def head_motion(pose: np.ndarray, centre: np.ndarray, width: np.ndarray) -> dict[str, float]:
    """Summary of a stretch's head motion: spread (deg) and mean speed (deg/s) of yaw, pitch, roll;
    mean speed of the face centre (face widths/s) and spread of the face width (relative)."""
    d = np.abs(np.diff(pose, axis=0)).mean(0) * FPS if len(pose) > 1 else np.zeros(3)
    shift = np.linalg.norm(np.diff(centre, axis=0), axis=1) / width[1:] if len(pose) > 1 else np.zeros(1)
    out = {f"{a}_std": float(pose[:, i].std()) for i, a in enumerate(("yaw", "pitch", "roll"))}
    out.update({f"{a}_speed": float(d[i]) for i, a in enumerate(("yaw", "pitch", "roll"))})
    out.update(shift_speed=float(shift.mean() * FPS), scale_std=float(width.std() / width.mean()))
    return {k: round(v, 4) for k, v in out.items()}


def annotations(frames: np.ndarray, lm: np.ndarray, audio: np.ndarray, win: np.ndarray, size: int,
                metrics: dict[str, Any]) -> dict[str, Any]:
    """A kept stretch's annotations (without identity, scene and the record's fields, which the
    driver adds)."""
    n, h, w = frames.shape[:3]
    pose = F.head_pose(lm)
    width = F.face_size(lm)
    centre = lm.mean(1)
    lm_crop = (lm - win[:, None, :2]) * (size / win[:, 2])[:, None, None]
    per_frame = {"landmarks": _r(lm_crop, 1), "yaw": _r(pose[:, 0], 2), "pitch": _r(pose[:, 1], 2),
                 "roll": _r(pose[:, 2], 2), "mouth_open": _r(F.mouth_opening(lm), 4),
                 "head_x": _r(centre[:, 0] / w, 4), "head_y": _r(centre[:, 1] / h, 4),
                 "head_scale": _r(width / h, 4), "crop": _r(win, 2),
                 "speaking": [bool(v) for v in speech_frames(frame_level_db(audio, n))]}
    return {"fps": FPS, "sample_rate": SAMPLE_RATE, "size": size, "frames": n, "seconds": n / FPS,
            "frame_size": [int(w), int(h)], "quality": metrics, "head_motion": head_motion(pose, centre, width),
            "per_frame": per_frame}


def _box(lm: np.ndarray) -> F.Box:
    lo, hi = lm.min(0), lm.max(0)
    return (float(lo[0]), float(lo[1]), float(hi[0]), float(hi[1]))


def stretch_record(faces: F.DlibFaces, frames: np.ndarray, audio: np.ndarray, lm: np.ndarray,
                   opt: StretchOptions, info: dict[str, Any], work: Path) -> dict[str, Any]:
    """Measures and verdict of one stretch (frames [n, H, W, 3], landmarks [n, 68, 2], audio
    [n * 640]); one that passes also gets its descriptor, hashes, annotations and work files."""
    metrics = measure(opt.thresholds, frames, lm, audio)
    rec = dict(info, frames=len(frames), reasons=reasons(opt.thresholds, metrics), metrics=metrics)
    if rec["reasons"]:
        return rec
    import imagehash
    from PIL import Image

    idx = sample_indices(len(frames))
    win = crop_windows(lm, opt.crop_scale)
    rec.update(descriptor=np.mean([faces.descriptor(frames[i], _box(lm[i])) for i in idx], 0).tolist(),
               hashes=[str(imagehash.phash(Image.fromarray(frames[i]))) for i in idx],
               annotations=annotations(frames, lm, audio, win, opt.size, metrics))
    write_video(work / f"{info['key']}.mkv", (crop(f, w, opt.size) for f, w in zip(frames, win)), opt.size)
    write_pcm(work / f"{info['key']}.wav", audio)
    return rec


def shot_id(row: dict[str, Any]) -> str:
    """A shot's name, `vNNNN-STEM-sNNNN` (input and shot number)."""
    return f"{row['video']}-s{row['shot']:04d}"


def window_key(row: dict[str, Any]) -> str:
    return f"{shot_id(row)}-{row['window']:04d}"


def window_records(faces: F.DlibFaces, frames: np.ndarray, audio: np.ndarray, opt: StretchOptions,
                   row: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """Records of every stretch of one window (frames [n, H, W, 3], audio [n * 640]); `row` holds
    video, source, shot, window, start, end (frames of the normalised video)."""
    tracks = F.track_faces(faces, frames, opt.detect_every)
    bg = np.round(background_descriptor(frames, [(t.start, crop_windows(t.landmarks, opt.crop_scale))
                                                 for t in tracks]), 4).tolist()
    base = {"video": row["video"], "source": row["source"], "shot": row["shot"], "window": row["window"],
            "shot_id": shot_id(row), "background": bg}
    out = []
    for t, tr in enumerate(tracks):
        a, b = tr.start, tr.end
        info = dict(base, key=f"{window_key(row)}-t{t}", track=t, start=row["start"] + a, end=row["start"] + b)
        if b - a < opt.min_frames:
            out.append(dict(info, frames=b - a, reasons=["too_short"], metrics={}))
        else:
            out.append(stretch_record(faces, frames[a:b], audio[a * SPF:b * SPF], tr.landmarks, opt, info, work))
    return out or [whole_window_record(row, "no_face", background=bg)]


def whole_window_record(row: dict[str, Any], reason: str, background: list[float] | None = None,
                        **metrics: Any) -> dict[str, Any]:
    """The record of a window rejected as a whole (no usable face; unreadable, without frames and
    so without a background descriptor)."""
    return {"key": window_key(row), "video": row["video"], "source": row["source"], "shot": row["shot"],
            "window": row["window"], "shot_id": shot_id(row), "background": background, "track": None,
            "start": row["start"], "end": row["end"], "frames": row["end"] - row["start"], "reasons": [reason],
            "metrics": metrics}
