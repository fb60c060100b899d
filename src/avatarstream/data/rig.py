"""Head geometry of a rendered avatar: the head-space frame, the depth field that makes the 2.5D
pose warp, the jaw, and the projection of head-space points to pixels.

Head space: u to image right, v down, z towards the camera, in head units (1 = the face
half-width `a` pixels); origin at the face centre. The right eye (image left) is at u < 0.
A pose moves a head-space point (u, v, z) as
  jaw:   v += jaw · w(u, v)                      (only below the lips)
  yaw:   u1 = u cos θ + z sin θ,  z1 = -u sin θ + z cos θ
  pitch: v1 = p + (v - p) cos φ + z1 sin φ       (p = pivot, the base of the neck)
  roll:  (u1, v1 - p) rotated by ψ about (0, p)  (clockwise on screen for ψ > 0)
  pixel: x = cx + a u2,  y = cy + a v2           (continuous coordinates, pixel k spans [k, k+1))
The image warp inverts this for points on the surface z = depth(u, v) (a smooth field: face
dome, nose bump, zero at the neck), so features shift with their depth and the outline stays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from avatarstream.data.draw import smax, smoothstep
from avatarstream.data.identity import Identity
from avatarstream.data.scene import Scene

FIXED_POINT_STEPS = 4


def surface_depth(u: np.ndarray, v: np.ndarray, nose: float) -> np.ndarray:
    """Depth z(u, v) of the head surface for the pose warp: polynomial and smooth (~0.85 at the
    face centre, ~0 at the outline, slightly negative at the back of the hair, a bump at the nose
    whose tip is at v = nose, fading to 0 down the neck)."""
    rho2 = u * u + ((v - 0.1) * (1.0 / 1.35)) ** 2
    dome = smax(0.85 * (1.0 - rho2), np.float32(-0.35), 0.3)
    nu, nv = u * (1.0 / 0.2), (v - (nose - 0.12)) * (1.0 / 0.3)
    bump = np.maximum(1.0 - nu * nu - nv * nv, 0.0)
    return (dome + 0.22 * bump * bump) * (1.0 - smoothstep(1.25, 1.9, v))


@dataclass(frozen=True)
class Rig:
    """Pixel placement and face landmarks of one (identity, scene, size)."""

    size: int
    a: float  # face half-width in pixels (≈ 50 at 256 px and scene.scale 1)
    cx: float  # pixel position of the head origin
    cy: float
    pivot: float  # v of the neck base (centre of roll and pitch)
    eye: tuple[float, float, float]  # right eye (u < 0); the left eye is (-u, v, z)
    mouth: tuple[float, float, float]  # centre of the line where the lips meet
    nose: float  # v of the nose tip
    chin: float  # v of the chin
    jaw_drop: float  # chin drop at open = 1, head units

    @classmethod
    def build(cls, identity: Identity, scene: Scene, size: int) -> "Rig":
        """Place the head in the frame (framing from the scene, proportions from the identity)."""
        a = 50.0 * size / 256.0 * scene.scale * identity.face_width
        eu, ev, mv = -identity.eye_x, identity.eye_y, identity.mouth_y
        z = lambda u, v: float(surface_depth(np.float32(u), np.float32(v), identity.nose_tip))  # noqa: E731
        return cls(size=size, a=a, cx=size * (0.5 + scene.offset_x), cy=size * (0.47 + scene.offset_y),
                   pivot=2.1, eye=(eu, ev, z(eu, ev)), mouth=(0.0, mv, z(0.0, mv)), nose=identity.nose_tip,
                   chin=identity.chin, jaw_drop=0.1)

    def depth(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Surface depth z(u, v) used by the pose warp (see `surface_depth`)."""
        return surface_depth(u, v, self.nose)

    def jaw(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Weight 0..1 of the jaw drop: 0 at and above the lips' line, 1 at the chin, 0 on the neck
        and beyond the cheeks."""
        m = self.mouth[1]
        return (smoothstep(m + 0.02, m + 0.45, v) * smoothstep(self.chin + 0.45, self.chin + 0.02, v)
                * smoothstep(0.95, 0.45, np.abs(u)))


@dataclass(frozen=True)
class Pose:
    """A rig in one pose (angles in radians) with `jaw` = rig.jaw_drop · open."""

    rig: Rig
    yaw: float
    pitch: float
    roll: float
    jaw: float = 0.0

    def project(self, u: float, v: float, z: float) -> tuple[float, float]:
        """Head-space point -> (x, y) pixels in the frame."""
        r = self.rig
        uu, vv = np.float32(u), np.float32(v)
        v = float(v + self.jaw * float(r.jaw(uu, vv)))
        cy_, sy_ = math.cos(self.yaw), math.sin(self.yaw)
        u1, z1 = u * cy_ + z * sy_, -u * sy_ + z * cy_
        v1 = r.pivot + (v - r.pivot) * math.cos(self.pitch) + z1 * math.sin(self.pitch)
        cr, sr = math.cos(self.roll), math.sin(self.roll)
        dv = v1 - r.pivot
        u2, v2 = u1 * cr - dv * sr, u1 * sr + dv * cr + r.pivot
        return (r.cx + r.a * u2, r.cy + r.a * v2)


def pose_terms(poses: list[Pose]) -> tuple[np.ndarray, ...]:
    """(cos yaw, sin yaw, cos pitch, sin pitch, cos roll, sin roll, jaw), each [N, 1, 1] float32,
    computed per pose with `math` (so a frame's numbers never depend on its batch)."""
    rows = [(math.cos(p.yaw), math.sin(p.yaw), math.cos(p.pitch), math.sin(p.pitch), math.cos(p.roll),
             math.sin(p.roll), p.jaw) for p in poses]
    return tuple(np.array(c, np.float32)[:, None, None] for c in zip(*rows))


def source_points(rig: Rig, terms: tuple[np.ndarray, ...], x: np.ndarray, y: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Backward warp: frame pixel positions (x, y) [H, W] -> head-space (u, v) [N, H, W] of the
    surface point seen there (fixed-point iteration); `terms` from `pose_terms`. Only + - * / min
    max on arrays (bit-stable for any batch layout)."""
    cy_, sy_, cp, sp, cr, sr, jaw = terms
    p = np.float32(rig.pivot)
    u2 = (x - np.float32(rig.cx)) * np.float32(1.0 / rig.a)
    dv = (y - np.float32(rig.cy)) * np.float32(1.0 / rig.a) - p
    u1 = u2 * cr + dv * sr  # undo roll
    v1 = dv * cr - u2 * sr  # relative to the pivot
    u, v = u1, v1 + p
    for _ in range(FIXED_POINT_STEPS):
        z = rig.depth(u, v)
        u = (u1 - z * sy_) / cy_
        z1 = z * cy_ - u * sy_
        vj = p + (v1 - z1 * sp) / cp
        v = vj - jaw * rig.jaw(u, v)
    return u, v
