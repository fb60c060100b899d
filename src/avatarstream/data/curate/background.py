"""What is behind the person: a window's background descriptor, for grouping shots into scenes.

Avatar V pairs a reference and a target from different scenes, so two shots of one room (a camera
cut, two clips filmed in one place) must count as one scene (`graph.assign_scenes`). The
descriptor is the colour distribution of the background: a soft (trilinear) joint RGB histogram of
`BINS`^3 cells over `filters.SAMPLES` evenly spaced frames of a window, with every person masked
out, normalised to sum 1 and stored as its square root (a unit vector: the Euclidean distance of
two is sqrt(2) times their Hellinger distance, 0 for the same distribution, sqrt(2) for disjoint
ones).

Why a colour histogram, not a small image or a perceptual hash: the same place filmed twice is
rarely framed twice alike. A camera that pans, zooms or is set up again moves every pixel, which
changes a downsampled image or a pHash as much as a change of room does, while a histogram counts
the same colours wherever they land (the tests' pan over a sixth of the frame and 320 -> 270 px
zooms move it by 0.2-0.45; different backgrounds are 1.29-1.41 apart). Soft binning keeps a colour
near a cell edge (a white wall under slightly other light, a codec's drift) from jumping cells.
What it cannot tell apart is two places of one palette (two beige rooms): they join one scene,
which costs pairs but never makes a same-scene pair.

The person: for every track present in a sampled frame, its head-crop square (`crop_windows`:
`crop_scale` times the landmarks' box, hair included) and a torso column below the head's middle,
`TORSO` times the square's width, down to the frame's bottom are left out, so neither the face
and its movement nor hair and clothes move the descriptor (two of our drawn people over one
background are 0.34 apart). A window where the mask leaves under `MIN_SHARE` of the pixels (a face
filling the frame) is described by its whole frames instead.
"""

from __future__ import annotations

import itertools

import numpy as np

from avatarstream.data.curate.filters import sample_indices

BINS = 8  # histogram cells per colour channel
TORSO = 1.5  # torso column width / head-crop side
MIN_SHARE = 0.02  # least share of background pixels for the mask to be used


def soft_histogram(px: np.ndarray, bins: int = BINS) -> np.ndarray:
    """Trilinear joint RGB histogram [bins^3] of pixels [n, 3] uint8 (each adds weight 1)."""
    p = px.astype(np.float64) * bins / 256 - 0.5
    lo = np.floor(p)
    frac = p - lo
    hist = np.zeros(bins ** 3)
    for corner in itertools.product((0, 1), repeat=3):
        c = np.array(corner)
        idx = np.clip(lo + c, 0, bins - 1).astype(np.int64)
        w = np.prod(np.where(c, frac, 1 - frac), 1)
        hist += np.bincount((idx[:, 0] * bins + idx[:, 1]) * bins + idx[:, 2], w, bins ** 3)
    return hist


def person_mask(shape: tuple[int, ...], windows: list[np.ndarray]) -> np.ndarray:
    """[H, W] bool, True on the background: False in each head-crop square (left, top, side) and
    the torso column below it (module doc)."""
    h, w = shape[:2]
    keep = np.ones((h, w), bool)
    for x0, y0, side in windows:
        cx, half = x0 + side / 2, TORSO * side / 2
        keep[max(0, int(y0)):max(0, int(np.ceil(y0 + side))), max(0, int(x0)):max(0, int(np.ceil(x0 + side)))] = False
        keep[max(0, int(y0 + side / 2)):, max(0, int(cx - half)):max(0, int(np.ceil(cx + half)))] = False
    return keep


def background_descriptor(frames: np.ndarray, tracks: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """[BINS^3] unit vector: the background colours of a window's frames [n, H, W, 3] uint8, the
    people of `tracks` (first frame, head-crop windows [m, 3] of frames start..start+m) masked out."""
    idx = sample_indices(len(frames))
    keep = [person_mask(frames.shape[1:], [win[i - start] for start, win in tracks if start <= i < start + len(win)])
            for i in idx]
    if sum(int(k.sum()) for k in keep) < MIN_SHARE * sum(k.size for k in keep):
        keep = [np.ones_like(k) for k in keep]
    h = sum(soft_histogram(frames[i][k]) for i, k in zip(idx, keep))
    return np.sqrt(h / h.sum())
