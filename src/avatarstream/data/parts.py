"""Per-frame moving parts (eyes with lids and irises, brows, lips with the mouth opening, teeth and
tongue), painted batched over frames into their sprite patches. Shapes are curves y = f(x) in
local head units with one-pixel coverage ramps; only + - * / sqrt min max on per-pixel arrays.

Per-frame parameters are float32 arrays [N, 1, 1]; patches are premultiplied RGB [N, 3, h, w]
(opaque skin under the parts, so alpha is left alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from avatarstream.data.draw import F32
from avatarstream.data.features import MOUTH_INTERIOR
from avatarstream.data.head import clear_of_mouth
from avatarstream.data.identity import Identity

SCLERA = np.array([0.96, 0.94, 0.91], F32)
LASH = np.array([0.07, 0.05, 0.05], F32)
TEETH = np.array([0.95, 0.93, 0.87], F32)
TONGUE = np.array([0.82, 0.42, 0.47], F32)


def _ramp(d: np.ndarray, px: float) -> np.ndarray:
    """Coverage of d > 0 with a one-pixel ramp (d in head units)."""
    return np.clip(d * (1.0 / px) + 0.5, 0.0, 1.0)


def _safe(c: np.ndarray) -> np.ndarray:
    """A lip/tongue colour kept clear of MOUTH_INTERIOR over its shading range (×0.85 .. ×1.1)."""
    for _ in range(3):
        c = clear_of_mouth(clear_of_mouth(c * 0.85) / 0.85)
    return clear_of_mouth(c)


def _blend(p: np.ndarray, colour: np.ndarray, alpha: np.ndarray) -> None:
    """p [N, 3, h, w] += (colour - p) · alpha; colour [3] or [N, 3, h, w]; alpha [N, h, w]."""
    c = colour[None, :, None, None] if colour.ndim == 1 else colour
    p += (c - p) * alpha[:, None]


@dataclass
class PartColours:
    """Lit colours of the moving parts of one renderer ([3] float32 each)."""

    eye_rgb: np.ndarray  # light falling on the eyes
    iris: np.ndarray
    brow: np.ndarray
    lip_upper: np.ndarray
    lip_lower: np.ndarray
    lip_line: np.ndarray
    teeth: np.ndarray
    tongue: np.ndarray
    highlight_x: float  # -1 .. 1: side of the eye highlight (towards the light)

    @classmethod
    def build(cls, idn: Identity, eye_rgb: np.ndarray, mouth_rgb: np.ndarray, light_x: float) -> "PartColours":
        lip = np.array(idn.lip_colour, F32) * mouth_rgb
        return cls(eye_rgb=eye_rgb, iris=np.array(idn.iris, F32) * eye_rgb,
                   brow=np.array(idn.brow_colour, F32) * eye_rgb, lip_upper=_safe(np.clip(lip * 0.86, 0, 1)),
                   lip_lower=_safe(np.clip(lip * 1.04, 0, 1)), lip_line=_safe(np.clip(lip * 0.6, 0, 1)),
                   teeth=np.clip(TEETH * np.maximum(mouth_rgb, 0.75), 0, 1),
                   tongue=_safe(np.clip(TONGUE * mouth_rgb, 0, 1)), highlight_x=float(np.clip(light_x * 2, -1, 1)))


def paint_eye(p: np.ndarray, x: np.ndarray, y: np.ndarray, side: float, idn: Identity, col: PartColours,
              px: float, blink: np.ndarray, gaze_x: np.ndarray, gaze_y: np.ndarray, brow: np.ndarray) -> None:
    """Eye and brow into p [N, 3, h, w]. x [1, w], y [h, 1]: local coords from the eye centre,
    x mirrored so that +x points to the outer corner; side +1 for the image-right eye."""
    es = idn.eye_size
    ew, ehu, ehl = 0.19 * es, 0.105 * es, 0.068 * es
    t = x * (1.0 / ew)
    s = np.clip(1.0 - t * t, 0.0, 1.0)
    sq = np.sqrt(s)
    base = -idn.eye_tilt * x
    f_u = base - ehu * sq * (0.6 + 0.4 * s)  # [1, w]
    f_l = base + ehl * s
    f_lid = f_u + blink * (f_l - f_u)  # [N, 1, w]
    inside = _ramp((1.0 - np.abs(t)) * ew, px)
    vis = _ramp(y - f_lid, px) * _ramp(f_l - y, px) * inside  # [N, h, w]
    lid = _ramp(y - f_u, px) * _ramp(f_lid - y, px) * inside
    p *= 1.0 - 0.1 * lid[:, None]
    shadow = 1.0 - 0.3 * np.clip(1.0 - (y - f_lid) * (1.0 / 0.06), 0.0, 1.0)
    _blend(p, SCLERA * col.eye_rgb, vis)
    p *= (1.0 - vis * (1.0 - shadow))[:, None]
    ri = 0.088 * es
    ix, iy = gaze_x * side * (0.085 * es), 0.008 + gaze_y * (0.04 * es)
    dx, dy = x - ix, y - iy
    r = np.sqrt(dx * dx + dy * dy)  # [N, h, w]
    iris = _ramp(ri - r, px) * vis
    ring = np.clip((r - 0.65 * ri) * (1.0 / (0.35 * ri)), 0.0, 1.0)
    grad = 0.8 + 0.4 * np.clip((dy + ri) * (1.0 / (2 * ri)), 0.0, 1.0)
    icol = col.iris[None, :, None, None] * (grad * (1.0 - 0.5 * ring * ring))[:, None]
    _blend(p, icol, iris)
    _blend(p, np.array([0.03, 0.025, 0.03], F32), _ramp(0.42 * ri - r, px) * vis)
    hx, hy = dx - col.highlight_x * side * 0.3 * ri, dy + 0.35 * ri
    _blend(p, np.array([1.0, 1.0, 1.0], F32), 0.85 * _ramp(0.2 * ri - np.sqrt(hx * hx + hy * hy), px) * vis)
    th = (0.021 + 0.014 * np.clip(t, 0.0, 1.0)) * es
    lash = _ramp(th * 0.5 - np.abs(y - f_lid + 0.004), px) * _ramp((1.04 - np.abs(t)) * ew, px)
    _blend(p, LASH, 0.95 * lash)
    lower = _ramp(0.006 - np.abs(y - f_l - 0.004), px) * inside * (1.0 - blink)
    _blend(p, LASH * 0.5 + col.eye_rgb * 0.2, 0.35 * lower)
    # brow: an arched band, thick at the inner end, raised (and the inner end more) by `brow`
    bw, bx = 0.26 * es, 0.02
    tb = (x - bx) * (1.0 / bw)
    sb = np.clip(1.0 - tb * tb, 0.0, 1.0)
    yb = -(0.25 + 0.09 * brow) * es - (idn.brow_arch + 0.02 * brow) * sb - 0.035 * brow * np.clip(-tb, 0.0, 1.0)
    thb = idn.brow_thickness * (1.05 - 0.3 * (tb + 1.0)) * (0.35 + 0.65 * np.sqrt(sb))
    bcov = np.clip((thb * 0.5 - np.abs(y - yb)) * (1.0 / (1.5 * px)) + 0.5, 0.0, 1.0)  # soft, hairy edge
    bcov = bcov * _ramp((1.0 - np.abs(tb)) * bw, px)
    _blend(p, col.brow, 0.92 * bcov)


def paint_mouth(p: np.ndarray, x: np.ndarray, y: np.ndarray, idn: Identity, col: PartColours, px: float,
                open_: np.ndarray, width: np.ndarray, round_: np.ndarray, teeth: np.ndarray,
                smile: np.ndarray) -> None:
    """Lips, opening (MOUTH_INTERIOR), teeth and tongue into p [N, 3, h, w]. x [1, w], y [h, 1]:
    local coords from the centre of the lips' line (which the opening grows down from)."""
    pos = np.maximum(smile, 0.0)
    w_ = idn.mouth_width * (1.0 + 0.22 * width - 0.28 * round_ + 0.1 * pos)
    # opening height: narrower (rounder) mouths open taller, so the opening's area follows `open`
    # whatever the shape; the lips part by ~1.5 px at once (a sub-pixel slit would only be blended
    # lip colour), so the visible dark area grows about linearly with `open`
    narrow = np.minimum(1.0 / ((1.0 + 0.22 * width - 0.28 * round_) * (1.0 - 0.22 * round_)
                               * (1.0 + 0.12 * round_)), 1.6)
    h_ = open_ * 0.24 * narrow + (1.5 * px) * np.clip(open_ * (1.0 / 0.06), 0.0, 1.0)
    t = x / w_  # [N, 1, w] across the lips
    s = np.clip(1.0 - t * t, 0.0, 1.0)
    sq = np.sqrt(s)
    ti = x / (w_ * (1.0 - 0.22 * round_))  # across the opening (narrower when puckered)
    si = np.clip(1.0 - ti * ti, 0.0, 1.0)
    sqi = np.sqrt(si)
    c = -0.12 * smile * t * t
    shape = si + (sqi - si) * (0.35 + 0.65 * round_)
    # showing teeth lifts the upper lip (and drops the lower one a little): the dark opening
    # between the teeth keeps the area that `open` gives it
    th = teeth * np.minimum(0.07, 0.35 * h_) * sqi
    thl = teeth * np.minimum(0.03, 0.14 * h_) * shape
    yu = c - 0.18 * h_ * sqi - th
    yl = c + 0.82 * h_ * shape + thl
    tu = idn.lip_upper * (1.0 + 0.35 * round_) * (1.0 - 0.25 * pos)
    tl = idn.lip_lower * (1.0 - 0.25 * round_) * (1.0 - 0.2 * pos)
    bow = np.maximum(1.0 - (x * (1.0 / 0.075)) ** 2, 0.0)
    yt = yu - tu * sq * (0.55 + 0.45 * s) * (1.0 + 0.5 * round_ * (1.0 - sqi)) + 0.3 * tu * bow * bow
    yb = yl + tl * sq * (0.6 + 0.4 * s) * (1.0 + 0.9 * round_ * (1.0 - sqi))
    inside = _ramp(w_ - np.abs(x), px)  # [N, 1, w]
    alpha = _ramp(y - yt, px) * _ramp(yb - y, px) * inside  # [N, h, w]
    w_up = _ramp(yu - y, px)
    w_low = _ramp(y - yl, px)
    w_in = np.maximum(1.0 - w_up - w_low, 0.0)
    interior = np.empty_like(p)
    interior[:] = (MOUTH_INTERIOR.astype(F32) / 255.0)[None, :, None, None]
    dome = np.sqrt(np.clip(1.0 - (x / (0.62 * w_)) ** 2, 0.0, 1.0))
    tongue_top = yl - thl - 0.3 * np.maximum(h_ - 3.0 * px, 0.0) * dome  # only in openings over 3 px
    _blend(interior, col.tongue, 0.95 * _ramp(y - tongue_top, px))
    tcov = _ramp(y - yu + 0.01, px) * _ramp(yu + th - y, px) * _ramp(0.8 * w_ - np.abs(x), px)
    tshade = 0.82 + 0.18 * np.clip((y - yu) / (th + 1e-3), 0.0, 1.0)
    _blend(interior, col.teeth[None, :, None, None] * tshade[:, None], tcov)
    _blend(interior, col.teeth * 0.85, 0.9 * _ramp(y - yl + thl, px) * _ramp(0.62 * w_ - np.abs(x), px))
    shine = 1.0 + 0.12 * sq * np.clip(1.0 - np.abs(y - (yl + 0.35 * (yb - yl))) / (0.3 * (yb - yl) + px), 0.0, 1.0)
    colour = (col.lip_upper[None, :, None, None] * w_up[:, None] + interior * w_in[:, None]
              + col.lip_lower[None, :, None, None] * (w_low * shine)[:, None])
    _blend(p, colour, alpha)
    closed = np.clip(1.0 - h_ * (1.0 / (1.5 * px)), 0.0, 1.0)
    line = _ramp(0.011 - np.abs(y - c), px) * _ramp(1.06 * w_ - np.abs(x), px) * closed
    _blend(p, col.lip_line, 0.75 * line)
