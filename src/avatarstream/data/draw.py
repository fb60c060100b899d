"""Anti-aliased drawing primitives on numpy arrays: signed distances, coverage, premultiplied
"over" compositing, smooth value noise and box blur.

Distances are in the caller's units (head units for the avatar: 1 = face half-width); `px` is
the size of one pixel in those units, so `coverage(d, px)` ramps over one pixel. Per-frame code
uses only + - * / sqrt min max (correctly rounded everywhere), so the same inputs give the same
bits whatever the batch layout.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def smoothstep(e0: float, e1: float, x: np.ndarray) -> np.ndarray:
    """Hermite step 0 at e0 .. 1 at e1 (e0 > e1 gives the falling step)."""
    t = np.clip((x - e0) / (e1 - e0), 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def coverage(d: np.ndarray, px: float, soft: float = 1.0) -> np.ndarray:
    """Signed distance (negative inside) -> coverage 0..1, a linear ramp `soft` pixels wide."""
    return np.clip(0.5 - d / (px * soft), 0.0, 1.0)


def sd_ellipse(x: np.ndarray, y: np.ndarray, rx: float, ry: float) -> np.ndarray:
    """Approximate signed distance to an axis-aligned ellipse centred at 0 (exact on circles, good
    near the outline, which is all coverage needs)."""
    k0 = np.sqrt((x / rx) ** 2 + (y / ry) ** 2)
    k1 = np.sqrt((x / (rx * rx)) ** 2 + (y / (ry * ry)) ** 2) + 1e-6
    return k0 * (k0 - 1.0) / k1


def sd_segment(x: np.ndarray, y: np.ndarray, ax: float, ay: float, bx: float, by: float) -> np.ndarray:
    """Unsigned distance to the segment a-b (subtract a radius for a capsule)."""
    px, py, dx, dy = x - ax, y - ay, bx - ax, by - ay
    h = np.clip((px * dx + py * dy) / (dx * dx + dy * dy + 1e-12), 0.0, 1.0)
    return np.sqrt((px - dx * h) ** 2 + (py - dy * h) ** 2)


def smin(a: np.ndarray, b: np.ndarray, k: float) -> np.ndarray:
    """Polynomial smooth minimum (union of two distance fields with a rounded seam of size k)."""
    h = np.maximum(k - np.abs(a - b), 0.0) / k
    return np.minimum(a, b) - h * h * k * 0.25


def smax(a: np.ndarray, b: np.ndarray, k: float) -> np.ndarray:
    """Polynomial smooth maximum."""
    return -smin(-a, -b, k)


def over(p: np.ndarray, a: np.ndarray | None, colour: np.ndarray, alpha: np.ndarray) -> None:
    """Composite `colour` with coverage `alpha` over premultiplied RGB `p` (and alpha `a`), in place.
    p [..., 3, H, W]; a [..., H, W] or None (opaque target); colour [3] or broadcastable to p;
    alpha broadcastable to [..., H, W]."""
    al = alpha[..., None, :, :]
    col = colour[:, None, None] if colour.ndim == 1 else colour
    p += (col - p) * al if a is None else col * al - p * al
    if a is not None:
        a += (1.0 - a) * alpha


def over_layer(p: np.ndarray, a: np.ndarray, p2: np.ndarray, a2: np.ndarray) -> None:
    """Premultiplied layer (p2 [..., 3, H, W], a2 [..., H, W]) over (p, a), in place."""
    k = 1.0 - a2
    p *= k[..., None, :, :]
    p += p2
    a *= k
    a += a2


def value_noise(rng: np.random.Generator, h: int, w: int, cells: float) -> np.ndarray:
    """Smooth noise [h, w] in about -1..1: random values on a coarse lattice (`cells` across the
    larger side), bicubic-smoothed (static layers only)."""
    n = max(2, int(np.ceil(cells))) + 3
    lat = rng.uniform(-1, 1, (n, n)).astype(F32)
    step = max(h, w) / max(cells, 1.0)
    yy = (np.arange(h, dtype=F32) + 0.5) / step + 1.0
    xx = (np.arange(w, dtype=F32) + 0.5) / step + 1.0
    iy, ix = yy.astype(int), xx.astype(int)
    fy, fx = smoothstep(0.0, 1.0, yy - iy), smoothstep(0.0, 1.0, xx - ix)
    top = lat[iy][:, ix] * (1 - fx) + lat[iy][:, ix + 1] * fx
    bot = lat[iy + 1][:, ix] * (1 - fx) + lat[iy + 1][:, ix + 1] * fx
    return (top * (1 - fy)[:, None] + bot * fy[:, None]).astype(F32)


def box_blur(img: np.ndarray, r: int) -> np.ndarray:
    """Separable box blur of radius r over the last two axes (edges clamped); twice ~ Gaussian."""
    if r <= 0:
        return img
    out = img
    for axis in (-1, -2):
        pad = [(0, 0)] * out.ndim
        pad[axis] = (r + 1, r)
        c = np.cumsum(np.pad(out, pad, mode="edge"), axis=axis, dtype=np.float64)
        n = out.shape[axis]
        hi = np.take(c, np.arange(2 * r + 1, 2 * r + 1 + n), axis=axis)
        lo = np.take(c, np.arange(0, n), axis=axis)
        out = ((hi - lo) / (2 * r + 1)).astype(F32)
    return out


def lambert(nx: np.ndarray, ny: np.ndarray, nz: np.ndarray, light: np.ndarray) -> np.ndarray:
    """max(0, n·l) for a unit light vector (x right, y down, z towards the camera)."""
    return np.maximum(nx * light[0] + ny * light[1] + nz * light[2], 0.0)


def normals_from_height(h: np.ndarray, px: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unit normals (nx, ny, nz) of a height field h [H, W] sampled every `px` units."""
    gy, gx = np.gradient(h, px)
    inv = 1.0 / np.sqrt(gx * gx + gy * gy + 1.0)
    return (-gx * inv).astype(F32), (-gy * inv).astype(F32), inv.astype(F32)
