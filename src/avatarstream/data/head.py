"""The static head layer of a renderer, painted once in sprite (head) space: back hair, neck, ears,
shaded face (height-field normals: nose, sockets, cheeks, chin), beard, front hair, glasses,
earrings. The moving parts (eyes, brows, mouth) are left out and painted per frame into
`Patch`es: their boxes keep the layer under them and the layer drawn over them (fringe, glasses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from avatarstream.data.draw import (F32, box_blur, coverage, lambert, normals_from_height, over, over_layer,
                                    sd_ellipse, sd_segment, smin, smoothstep, value_noise)
from avatarstream.data.features import MOUTH_INTERIOR
from avatarstream.data.hair import paint_hair
from avatarstream.data.identity import Identity
from avatarstream.data.rig import Rig
from avatarstream.data.scene import Scene

U0, V0, U1, V1 = -1.8, -2.05, 1.8, 2.45  # sprite extent in head units
MOUTH_CLEAR = 36.0  # min max-channel distance (0..255) of anything near the mouth from MOUTH_INTERIOR


@dataclass
class Patch:
    """A box of the sprite where moving parts are painted: rows i0:i1, cols j0:j1; head coords of
    its pixel centres u [1, w], v [h, 1]; the layer under the parts (premultiplied RGB [3, h, w],
    alpha [h, w]) and the layer over them."""

    i0: int
    i1: int
    j0: int
    j1: int
    u: np.ndarray
    v: np.ndarray
    under_p: np.ndarray
    under_a: np.ndarray
    over_p: np.ndarray
    over_a: np.ndarray


@dataclass
class Lighting:
    """Scene light as seen by the face: unit vector [3], direct colour [3], ambient fraction."""

    light: np.ndarray
    rgb: np.ndarray
    ambient: float

    @classmethod
    def of(cls, scene: Scene) -> "Lighting":
        return cls(scene.light_vector(), np.array(scene.light_tint, F32) * scene.light_intensity, scene.ambient)

    def shade(self, lam: np.ndarray, warm: bool = True) -> np.ndarray:
        """Per-channel light [3, ...] from a Lambert term (warm ambient for skin)."""
        amb = np.array([1.0, 0.95, 0.92] if warm else [1.0, 1.0, 1.0], F32) * self.ambient
        lam = np.asarray(lam, F32)
        ex = (slice(None),) + (None,) * lam.ndim
        return amb[ex] + (1 - self.ambient) * 1.12 * self.rgb[ex] * lam[None]


def face_sd(idn: Identity, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Signed distance of the face outline: cranium ellipse smoothly joined with the jaw ellipse."""
    jr = 0.78
    return smin(sd_ellipse(u, v, 1.0, idn.cranium), sd_ellipse(u, v - (idn.chin - jr), idn.jaw_width, jr), 0.3)


def bump(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Compact smooth bump (1 - r²)² on the unit disc."""
    return np.maximum(1.0 - x * x - y * y, 0.0) ** 2


def clear_of_mouth(rgb: np.ndarray) -> np.ndarray:
    """Colours [3, ...] (0..1) that come within MOUTH_CLEAR of MOUTH_INTERIOR (max channel
    difference, 0..255) moved straight away from it until they are MOUTH_CLEAR away."""
    mi = MOUTH_INTERIOR.astype(F32)[(slice(None),) + (None,) * (rgb.ndim - 1)] / 255.0
    for _ in range(3):  # clipping to 0..1 can undo part of a step
        diff = rgb - mi
        dist = np.maximum(np.abs(diff).max(0) * 255.0, 0.5)
        k = np.maximum(MOUTH_CLEAR / dist - 1.0, 0.0)
        rgb = np.clip(rgb + diff * k[None], 0.0, 1.0).astype(F32)
    return rgb


class HeadSprite:
    """Static head layer of one (identity, scene, rig): `p` [3, H, W] premultiplied RGB and `a`
    [H, W] alpha over the sprite extent, plus the eye and mouth patches and the part colours."""

    def __init__(self, idn: Identity, scene: Scene, rig: Rig) -> None:
        a = rig.a
        self.u0, self.v0 = U0, V0
        self.w, self.h = int(math.ceil((U1 - U0) * a)), int(math.ceil((V1 - V0) * a))
        u = (U0 + (np.arange(self.w, dtype=F32) + 0.5) / a)[None, :]  # [1, W]
        v = (V0 + (np.arange(self.h, dtype=F32) + 0.5) / a)[:, None]  # [H, 1]
        uu, vv = np.broadcast_to(u, (self.h, self.w)), np.broadcast_to(v, (self.h, self.w))
        px = 1.0 / a
        self.lighting = lt = Lighting.of(scene)
        skin = np.array(idn.skin, F32)
        rng = np.random.default_rng([idn.seed & 0xFFFFFFFF, 0x7E])
        fd = face_sd(idn, uu, vv)
        hair = paint_hair(idn, fd, uu, vv, px, lt.light, lt.rgb, lt.ambient)
        p, al = hair.back_p.copy(), hair.back_a.copy()
        # neck (a cylinder, widening to the shoulders), shadowed under the jaw
        nw = idn.neck_width + 0.3 * smoothstep(1.7, 2.45, vv)
        neck = coverage(np.abs(uu) - nw, px) * smoothstep(0.5, 0.6, vv) * smoothstep(2.45, 2.3, vv)
        nx = np.clip(uu / (nw + 0.15), -0.95, 0.95)
        neck_lit = lt.shade(lambert(nx, 0.15, np.sqrt(1 - nx * nx), lt.light))
        jaw_shadow = 1.0 - 0.45 * smoothstep(idn.chin + 0.4, idn.chin - 0.05, vv) * smoothstep(0.6, 0.9, vv)
        over(p, al, skin[:, None, None] * neck_lit * 0.9 * jaw_shadow[None], neck)
        # ears
        for side in (-1.0, 1.0):
            eu, ev, es = side * 0.97, idn.eye_y + 0.14, idn.ear_size
            ear = coverage(sd_ellipse(uu - eu, vv - ev, 0.14 * es, 0.25 * es), px)
            inner = coverage(sd_ellipse(uu - eu + side * 0.01, vv - ev - 0.01, 0.07 * es, 0.15 * es), px)
            ear_rgb = (skin * lt.shade(lambert(side * 0.8, 0.0, 0.6, lt.light)))[:, None, None]
            over(p, al, ear_rgb * 0.95, ear)
            over(p, al, ear_rgb * 0.7, inner * 0.8)
        # face: height field -> normals -> light
        ht = self._height(idn, uu, vv, fd)
        nx, ny, nz = normals_from_height(ht, px)
        lam = lambert(nx, ny, nz, lt.light)
        col = skin[:, None, None] * lt.shade(lam)
        hv = lt.light + np.array([0, 0, 1], F32)
        hv = hv / np.linalg.norm(hv)
        spec = np.maximum(nx * hv[0] + ny * hv[1] + nz * hv[2], 0) ** 24 * 0.09
        col = col + spec[None] * lt.rgb[:, None, None]
        col = col * (1.0 + np.array([0.04, -0.02, -0.03], F32)[:, None, None] * (1 - lam[None]))  # warm shadows
        cheeks = sum(bump((uu - s * 0.5) / 0.22, (vv - 0.36) / 0.18) for s in (-1, 1))
        col = col + (np.array([0.9, 0.35, 0.4], F32)[:, None, None] * lt.shade(lam) - col) * (idn.blush * cheeks)[None]
        # the hair's shadow on the forehead
        shift = (int(round(-lt.light[1] * 0.08 * a)), int(round(-lt.light[0] * 0.08 * a)))
        sh = box_blur(np.roll(hair.front_a, shift, axis=(0, 1)), max(1, int(0.05 * a)))
        col = col * (1.0 - 0.35 * sh[None])
        face = coverage(fd, px)
        self._face_details(idn, uu, vv, px, col, lam)
        over(p, al, col, face)
        self._beard(idn, uu, vv, px, fd, p, al, rng)
        # the parts' boxes (before the front layer is added)
        under_p, under_a = p.copy(), al.copy()
        fp, fa = hair.front_p.copy(), hair.front_a.copy()
        self._glasses(idn, uu, vv, px, fp, fa)
        self._earrings(idn, uu, vv, px, fp, fa)
        over_layer(p, al, fp, fa)
        self._clear_mouth(idn, p, al)
        self._clear_mouth(idn, under_p, under_a)
        self.p, self.a = p, al
        ex, ey = idn.eye_x, idn.eye_y
        self.eyes = [self._patch(u, v, under_p, under_a, fp, fa, s * ex - 0.33, s * ex + 0.33, ey - 0.55, ey + 0.17)
                     for s in (-1, 1)]  # right eye (image left) first
        my = idn.mouth_y
        self.mouth = self._patch(u, v, under_p, under_a, fp, fa, -0.64, 0.64, my - 0.34, my + 0.64)
        self.eye_rgb = np.clip(lt.shade(np.float32(0.85)), 0.7, 1.15).astype(F32)  # [3] light on the eyes
        mlam = float(lam[min(self.h - 1, int((idn.mouth_y - V0) * a)), self.w // 2])
        self.mouth_rgb = lt.shade(np.float32(mlam)).astype(F32)  # [3] light on the lips

    def _height(self, idn: Identity, u: np.ndarray, v: np.ndarray, fd: np.ndarray) -> np.ndarray:
        """Face height field: rounded outline + dome + nose, sockets, brow ridge, cheeks, muzzle, chin."""
        r = 0.55
        t = np.clip(-fd, 0, r)
        ht = np.sqrt(t * (2 * r - t)) + 0.3 * (1 - u * u - (v / 1.3) ** 2)
        tip, nw, ex, ey = idn.nose_tip, idn.nose_width, idn.eye_x, idn.eye_y
        prog = smoothstep(ey - 0.05, tip, v)
        ridge_w = 0.07 + 0.07 * prog
        ht = ht + 0.1 * prog * smoothstep(tip + 0.06, tip - 0.02, v) * np.maximum(1 - (u / ridge_w) ** 2, 0)
        ht = ht + 0.11 * bump(u / (0.75 * nw), (v - tip + 0.06) / 0.11)
        for s in (-1, 1):
            ht = ht + 0.05 * bump((u - s * 0.72 * nw) / (0.45 * nw), (v - tip + 0.02) / 0.07)
            ht = ht - 0.07 * bump((u - s * ex) / 0.3, (v - ey) / 0.2)
            ht = ht + 0.05 * bump((u - s * 0.55) / 0.3, (v - 0.3) / 0.28)
        ht = ht + 0.04 * bump(u / 0.75, (v - ey + 0.3) / 0.14)
        ht = ht + 0.06 * bump(u / 0.48, (v - idn.mouth_y) / 0.3)
        ht = ht + 0.05 * bump(u / 0.3, (v - idn.chin + 0.18) / 0.18)
        return ht.astype(F32)

    def _face_details(self, idn: Identity, u: np.ndarray, v: np.ndarray, px: float, col: np.ndarray,
                      lam: np.ndarray) -> None:
        """Nostrils, eyelid creases and a soft line under the lower lip, painted into col [3, H, W]."""
        tip, nw = idn.nose_tip, idn.nose_width
        dark = col * 0.45
        for s in (-1, 1):
            n = coverage(sd_ellipse(u - s * 0.42 * nw, v - tip - 0.025, 0.036, 0.018), px, 1.5)
            col += (dark - col) * (0.6 * n)[None]
            ala = coverage(np.abs(sd_ellipse(u - s * 0.72 * nw, v - tip + 0.02, 0.42 * nw, 0.07)) - 0.006, px, 2)
            col += (col * 0.7 - col) * (0.5 * ala * smoothstep(tip - 0.04, tip + 0.02, v))[None]
            ex, ey, es = s * idn.eye_x, idn.eye_y, idn.eye_size
            t = (u - ex) / (0.21 * es)
            crease = coverage(np.abs(v - (ey - 0.15 * es) - 0.04 * t * t) - 0.006, px, 2) * np.clip(1 - t * t, 0, 1)
            col += (col * 0.72 - col) * (0.6 * crease)[None]
        chin_line = coverage(np.abs(v - idn.mouth_y - 0.24 - 0.1 * u * u) - 0.01, px, 3)
        chin_line = chin_line * np.clip(1 - (u / 0.2) ** 2, 0, 1)
        col += (col * 0.86 - col) * chin_line[None]

    def _beard(self, idn: Identity, u: np.ndarray, v: np.ndarray, px: float, fd: np.ndarray, p: np.ndarray,
               al: np.ndarray, rng: np.random.Generator) -> None:
        if idn.beard == "none":
            return
        my, mw = idn.mouth_y, idn.mouth_width
        lips = coverage(sd_ellipse(u, v - my - 0.03, mw + 0.03, 0.15), px, 2)
        must = coverage(sd_ellipse(u, v - my + 0.1, mw + 0.05, 0.065), px, 2)
        face = coverage(fd - 0.04, px, 2)
        top = my - 0.1 + (0.12 - my + 0.1) * smoothstep(0.38, 0.95, np.abs(u))  # cheek line of the beard
        jaw = face * smoothstep(top - 0.02, top + 0.08, v)
        chin = coverage(sd_ellipse(u, v - idn.chin + 0.17, 0.24, 0.2), px, 2) * face
        region = {"stubble": np.maximum(jaw, must), "moustache": must, "full": np.maximum(jaw, must),
                  "goatee": np.maximum(must, chin)}
        m = region[idn.beard] * (1 - lips)
        grain = 0.88 + 0.12 * value_noise(rng, *u.shape, max(u.shape) * px / 0.05)
        base = np.array(idn.hair_colour, F32) * 0.8
        lit = self.lighting.shade(np.float32(0.7), warm=False)
        colr = np.clip(base[:, None, None] * lit[:, None, None] * grain[None], 0, 1)
        over(p, al, colr, m * (0.38 if idn.beard == "stubble" else 0.92))

    def _glasses(self, idn: Identity, u: np.ndarray, v: np.ndarray, px: float, fp: np.ndarray,
                 fa: np.ndarray) -> None:
        if idn.glasses == "none":
            return
        c = (np.array(idn.glasses_colour, F32) * self.lighting.shade(np.float32(0.9), False))[:, None, None]
        ex, ey, th = idn.eye_x, idn.eye_y, 0.024
        rims = np.zeros_like(u)
        lens = np.zeros_like(u)
        for s in (-1, 1):
            x, y = u - s * ex, v - ey - 0.01
            if idn.glasses == "round":
                d = np.sqrt(x * x + y * y) - 0.25
            else:
                q = np.maximum(np.abs(x) - 0.18, 0), np.maximum(np.abs(y) - 0.09, 0)
                d = np.sqrt(q[0] ** 2 + q[1] ** 2) - 0.08
            ring = coverage(np.abs(d) - th * (1.6 if idn.glasses == "browline" else 1.0), px)
            if idn.glasses == "browline":
                ring = ring * smoothstep(0.03, -0.02, y) + coverage(np.abs(d) - th * 0.4, px) * 0.6
            rims = np.maximum(rims, ring)
            lens = np.maximum(lens, coverage(d, px))
            temple = coverage(sd_segment(u, v, s * (ex + 0.25), ey - 0.04, s * 0.99, ey - 0.02) - th * 0.8, px)
            rims = np.maximum(rims, temple)
        bridge = coverage(sd_segment(u, v, -ex + 0.22, ey - 0.05, ex - 0.22, ey - 0.05) - th * 0.8, px)
        rims = np.maximum(rims, bridge)
        glint = lens * smoothstep(0.02, 0.0, np.abs((u - v * 0.6) % 0.5 - 0.25) - 0.03) * 0.12
        over(fp, fa, np.full(3, 0.95, F32), lens * 0.06 + glint)
        over(fp, fa, c, rims)

    def _earrings(self, idn: Identity, u: np.ndarray, v: np.ndarray, px: float, fp: np.ndarray,
                  fa: np.ndarray) -> None:
        if idn.earrings is None:
            return
        metal = np.array(idn.earrings, F32)
        for s in (-1, 1):
            x, y = u - s * 0.99, v - (idn.eye_y + 0.36 * idn.ear_size)
            ring = coverage(np.abs(np.sqrt(x * x + (y - 0.07) ** 2) - 0.07) - 0.012, px)
            stud = coverage(np.sqrt(x * x + y * y) - 0.03, px)
            m = ring if idn.seed % 2 else stud
            lit = 0.7 + 0.5 * np.clip(0.5 - y * 8 - x * s * 4, 0, 1)
            over(fp, fa, metal[:, None, None] * lit[None], m)

    def _clear_mouth(self, idn: Identity, p: np.ndarray, al: np.ndarray) -> None:
        """Keep the area around the mouth (|u| < 0.7, v within -0.3..0.6 of the lips' line) clear of
        the interior colour (see `MOUTH_CLEAR`); p [3, H, W] premultiplied, edited in place."""
        a = self.w / (U1 - U0)
        j0, j1 = int((-0.7 - U0) * a), int(math.ceil((0.7 - U0) * a))
        i0, i1 = max(0, int((idn.mouth_y - 0.3 - V0) * a)), min(self.h, int(math.ceil((idn.mouth_y + 0.6 - V0) * a)))
        sl = (slice(None), slice(i0, i1), slice(j0, j1))
        alpha = al[i0:i1, j0:j1][None]
        p[sl] = clear_of_mouth(p[sl] / np.maximum(alpha, 1e-6)) * alpha

    def _patch(self, u: np.ndarray, v: np.ndarray, up: np.ndarray, ua: np.ndarray, fp: np.ndarray, fa: np.ndarray,
               lo_u: float, hi_u: float, lo_v: float, hi_v: float) -> Patch:
        a = 1.0 / float(u[0, 1] - u[0, 0])
        j0, j1 = max(0, int((lo_u - U0) * a)), min(self.w, int(math.ceil((hi_u - U0) * a)))
        i0, i1 = max(0, int((lo_v - V0) * a)), min(self.h, int(math.ceil((hi_v - V0) * a)))
        return Patch(i0, i1, j0, j1, u[:, j0:j1].copy(), v[i0:i1].copy(), up[:, i0:i1, j0:j1].copy(),
                     ua[i0:i1, j0:j1].copy(), fp[:, i0:i1, j0:j1].copy(), fa[i0:i1, j0:j1].copy())
