"""Shoulders and clothing of an avatar, painted once per renderer in frame space (they do not move):
a premultiplied layer that goes over the head layer, with the neckline open onto the neck."""

from __future__ import annotations

import numpy as np

from avatarstream.data.draw import F32, coverage, lambert, over, sd_ellipse, sd_segment, smoothstep, value_noise
from avatarstream.data.head import Lighting
from avatarstream.data.identity import Identity
from avatarstream.data.rig import Rig


def paint_body(idn: Identity, rig: Rig, lt: Lighting) -> tuple[np.ndarray, np.ndarray]:
    """-> premultiplied RGB [3, S, S] and alpha [S, S] of torso, clothing and the chest skin showing
    in the neckline."""
    s = rig.size
    px = 1.0 / rig.a
    sw, nw, top = idn.shoulder_width, idn.neck_width, 1.9
    r0 = min(s, max(0, int(rig.cy + (min(top, idn.chin) - 0.1) * rig.a)))  # rows above hold no body
    out_p, out_a = np.zeros((3, s, s), F32), np.zeros((s, s), F32)
    if r0 >= s:
        return out_p, out_a
    h = s - r0
    u = ((np.arange(s, dtype=F32) + 0.5 - rig.cx) / rig.a)[None, :]  # [1, S] head units
    v = ((np.arange(r0, s, dtype=F32) + 0.5 - rig.cy) / rig.a)[:, None]  # [h, 1]
    u, v = np.broadcast_to(u, (h, s)), np.broadcast_to(v, (h, s))
    rng = np.random.default_rng([idn.seed & 0xFFFFFFFF, 0xB0])
    r = 2.2
    # torso: |u/sw|^4 + ((v - top - r)/r)^2 = 1, distance from the implicit function's gradient
    fx, fy = u / sw, (v - top - r) / r
    f = fx ** 4 + fy ** 2
    g = np.sqrt((4 * fx ** 3 / sw) ** 2 + (2 * fy / r) ** 2) + 1e-4
    torso_d = (f - 1) / g
    torso = coverage(torso_d, px)
    # neckline
    kind = idn.clothing
    hole_d = sd_ellipse(u, v - top + 0.02, nw + 0.14, 0.36)
    if kind == "scoop":
        hole_d = sd_ellipse(u, v - top + 0.02, nw + 0.34, 0.62)
    if kind in ("vneck", "collar"):
        depth = 0.8 if kind == "vneck" else 0.65
        vd = np.maximum(np.abs(u) * depth / (nw + 0.1) + (v - top - depth), -(v - top + 0.4))
        hole_d = np.minimum(hole_d, vd * 0.8)
    if kind == "turtleneck":
        hole_d = np.full_like(u, 1.0)
    p, al = out_p[:, r0:], out_a[r0:]  # views: painted in place
    skin = np.array(idn.skin, F32)
    # chest skin inside the neckline, fading out upwards where the (moving) neck covers it
    nx = np.clip(u / 1.6, -0.9, 0.9)
    chest_lit = lt.shade(lambert(nx, -0.2, np.sqrt(1 - nx * nx), lt.light))
    chest = torso * smoothstep(top + 0.05, top + 0.3, v)
    shadow = 1.0 - 0.35 * smoothstep(top + 0.45, top, v) * smoothstep(nw + 0.4, nw - 0.1, np.abs(u))
    over(p, al, skin[:, None, None] * chest_lit * 0.88 * shadow[None], chest)
    # cloth: lit like a wide cylinder, soft folds
    nxc = np.clip(u / (sw * 1.05), -0.95, 0.95)
    lam = lambert(nxc, -0.35 + 0.25 * smoothstep(top, top + 1.2, v), np.sqrt(1 - nxc * nxc), lt.light)
    folds = 1.0 + 0.06 * value_noise(rng, h, s, 4.0) + 0.04 * np.sin(u * 5.0 + v * 2.0)
    cloth_col = np.array(idn.clothing_colour, F32)[:, None, None] * lt.shade(lam, warm=False) * folds[None]
    neck_shadow = 1.0 - 0.3 * smoothstep(top + 0.7, top - 0.1, v) * smoothstep(nw + 0.7, nw, np.abs(u))
    cloth_col = cloth_col * neck_shadow[None]
    cloth = torso * (1 - coverage(hole_d, px))
    over(p, al, np.clip(cloth_col, 0, 1), cloth)
    accent = np.array(idn.clothing_accent, F32)[:, None, None]
    trim = coverage(np.abs(hole_d) - 0.03, px) * torso
    if kind in ("crew", "scoop", "vneck"):
        over(p, al, np.clip(cloth_col * 0.82, 0, 1), trim)
    elif kind == "collar":
        for sd in (-1, 1):  # two collar flaps either side of the V
            d = np.maximum(sd_segment(u, v, sd * (nw + 0.02), top - 0.25, sd * 0.12, top + 0.5) - 0.2,
                           -sd * u + 0.02)
            flap = coverage(d, px) * torso * smoothstep(top - 0.3, top - 0.22, v)
            col = np.clip(accent * lt.shade(lam, warm=False) * 1.05, 0, 1)
            over(p, al, col, flap)
            edge = coverage(np.abs(d) - 0.012, px) * torso * smoothstep(top - 0.3, top - 0.22, v)
            over(p, al, col * 0.6, edge * 0.8)
    elif kind == "turtleneck":
        band = coverage(np.abs(u) - nw - 0.1, px) * smoothstep(idn.chin + 0.33, idn.chin + 0.4, v) * (v < top + 1)
        ribs = 1.0 + 0.07 * np.sin(u * 60.0) * smoothstep(0.3, 0.6, 1.0 / px * 0.02)
        over(p, al, np.clip(cloth_col * 0.92 * ribs[None], 0, 1), band)
        over(p, al, np.clip(cloth_col * 0.75, 0, 1), coverage(np.abs(v - idn.chin - 0.4) - 0.02, px)
             * coverage(np.abs(u) - nw - 0.1, px) * 0.7)
    elif kind == "hoodie":
        ring = coverage(np.abs(sd_ellipse(u, v - top - 0.05, nw + 0.42, 0.5)) - 0.13, px) * torso
        over(p, al, np.clip(cloth_col * 0.88, 0, 1), ring * smoothstep(top - 0.25, top - 0.1, v))
        for sd in (-1, 1):
            cord = coverage(sd_segment(u, v, sd * 0.25, top + 0.3, sd * 0.3, top + 1.2) - 0.025, px)
            over(p, al, np.clip(accent * lt.shade(lam, warm=False), 0, 1), cord)
    return out_p, out_a
