"""Procedural 2.5D head-and-shoulders avatar renderer (numpy + torch, CPU, deterministic).

Built once per renderer (lazily, on the first frame): the background, the shoulders/clothes layer
and the head sprite without its moving parts. Per frame (batched over a clip's frames): paint
eyes, brows and mouth into their small sprite patches, warp the head sprite by the pose (the
2.5D warp of `rig`: features shift by depth · sin(angle), roll turns the head about the neck,
the jaw drops with the mouth; computed on a coarse lattice fixed to the frame and upsampled
bilinearly, then one `grid_sample`), and composite background, head and clothes in the
head's box. `render(st)` is `render_many([st])[0]`, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from avatarstream.data.body import paint_body
from avatarstream.data.draw import F32
from avatarstream.data.features import FaceState
from avatarstream.data.head import U0, V0, HeadSprite, Patch
from avatarstream.data.identity import Identity
from avatarstream.data.parts import PartColours, paint_eye, paint_mouth
from avatarstream.data.rig import Pose, Rig, pose_terms, source_points
from avatarstream.data.scene import Scene, paint_background
from avatarstream.errors import InputError

CHUNK = 8  # frames warped together (small enough for the sprites to stay in cache)
POSE_LIMITS = (15.0, 12.0, 12.0)  # |yaw|, |pitch|, |roll| degrees the head box is sized for
STATE_FIELDS = tuple(f.name for f in fields(FaceState))


@dataclass
class _Layers:
    """Everything a renderer precomputes (see the module docstring)."""

    head: HeadSprite
    colours: PartColours
    sprite: np.ndarray  # [4, Hs, Ws] premultiplied RGBA
    static: np.ndarray  # [S, S, 3] uint8 frame without the head
    box: tuple[int, int, int, int]  # y0, y1, x0, x1 of the head's box in the frame
    base: torch.Tensor  # [3, h, w] clothes over background in the box
    keep: torch.Tensor  # [1, h, w] 1 - clothes alpha
    keep_bg: torch.Tensor  # [3, h, w] keep · background
    step: int  # lattice spacing g in pixels
    node_x: np.ndarray  # [1, Wc] pixel-centre x of the warp lattice nodes (x = k g + 0.5)
    node_y: np.ndarray  # [Hc, 1]
    lattice_x0: int  # first lattice column / row in pixels (k0 g)
    lattice_y0: int
    frac: np.ndarray  # [g] interpolation weights 0, 1/g, ...


class AvatarRenderer:
    """Renders one identity in one scene at `size` × `size` pixels."""

    def __init__(self, identity: Identity, scene: Scene, size: int = 256) -> None:
        if not 32 <= int(size) <= 2048:
            raise InputError(f"render size must be between 32 and 2048 pixels, got {size}")
        self.identity, self.scene, self.size = identity, scene, int(size)
        self.rig = Rig.build(identity, scene, self.size)

    def pose(self, st: FaceState) -> Pose:
        """The rig in the state's pose (and jaw opening)."""
        return Pose(self.rig, math.radians(st.yaw), math.radians(st.pitch), math.radians(st.roll),
                    self.rig.jaw_drop * min(max(st.open, 0.0), 1.0))

    def mouth_xy(self, st: FaceState) -> tuple[float, float]:
        """Pixel position of the centre of the lips' line in this state."""
        return self.pose(st).project(*self.rig.mouth)

    def render(self, st: FaceState) -> np.ndarray:
        """One frame [S, S, 3] uint8."""
        return self.render_many([st])[0]

    def render_many(self, states: Sequence[FaceState]) -> np.ndarray:
        """Frames [N, S, S, 3] uint8, identical to stacking `render` of each state."""
        out = np.empty((len(states), self.size, self.size, 3), np.uint8)
        for i in range(0, len(states), CHUNK):
            self._chunk(list(states[i:i + CHUNK]), out[i:i + CHUNK])
        return out

    # -- per frame --------------------------------------------------------------------------------
    def _chunk(self, states: list[FaceState], frames: np.ndarray) -> None:
        """Render states into frames [n, S, S, 3] uint8."""
        L, idn, rig = self._layers, self.identity, self.rig
        n = len(states)
        vals = np.array([[getattr(s, f) for f in STATE_FIELDS] for s in states], np.float64)  # [N, 12]
        if not np.isfinite(vals).all():
            raise InputError("face states must be finite numbers (got NaN or inf)")
        arr = lambda name: vals[:, STATE_FIELDS.index(name), None, None].astype(F32)  # noqa: E731  [N, 1, 1]
        spr = np.empty((n,) + L.sprite.shape, F32)  # [N, 4, Hs, Ws]
        spr[:] = L.sprite
        px = 1.0 / rig.a
        blink, gx, gy, brow = (np.clip(arr(k), lo, 1.0) for k, lo in
                               (("blink", 0.0), ("gaze_x", -1.0), ("gaze_y", -1.0), ("brow", 0.0)))
        for side, pt in zip((-1.0, 1.0), L.head.eyes):
            p = np.repeat(pt.under_p[None], n, 0)  # [N, 3, h, w]
            paint_eye(p, (pt.u - side * idn.eye_x) * side, pt.v - idn.eye_y, side, idn, L.colours, px,
                      blink, gx, gy, brow)
            self._put(spr, p, pt)
        pt = L.head.mouth
        p = np.repeat(pt.under_p[None], n, 0)
        paint_mouth(p, pt.u, pt.v - idn.mouth_y, idn, L.colours, px, np.clip(arr("open"), 0, 1),
                    np.clip(arr("width"), -1, 1), np.clip(arr("round"), 0, 1), np.clip(arr("teeth"), 0, 1),
                    np.clip(arr("smile"), -0.5, 1))
        self._put(spr, p, pt)
        grid = self._grid(pose_terms([self.pose(s) for s in states]))  # [N, h, w, 2]
        warped = F.grid_sample(torch.from_numpy(spr), torch.from_numpy(grid), mode="bilinear",
                               padding_mode="zeros", align_corners=False)  # [N, 4, h, w]
        rgb = warped[:, :3].mul_(L.keep).add_(L.base).sub_(warped[:, 3:] * L.keep_bg)
        u8 = rgb.mul_(255.0).add_(0.5).clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)  # [N, h, w, 3]
        frames[:] = L.static
        y0, y1, x0, x1 = L.box
        frames[:, y0:y1, x0:x1] = u8.numpy()

    @staticmethod
    def _put(spr: np.ndarray, p: np.ndarray, pt: Patch) -> None:
        """Patch p [N, 3, h, w] (under layer + parts) with the patch's over layer -> sprite."""
        p *= (1.0 - pt.over_a)[None, None]
        p += pt.over_p[None]
        spr[:, :3, pt.i0:pt.i1, pt.j0:pt.j1] = p

    def _grid(self, terms: tuple[np.ndarray, ...]) -> np.ndarray:
        """grid_sample grid [N, h, w, 2] for the head box: the backward warp on a lattice fixed to
        the frame (every g pixels), upsampled bilinearly; each pixel's value depends only on its
        own lattice cell, never on the batch."""
        L, rig, hd, g = self._layers, self.rig, self._layers.head, self._layers.step
        u, v = source_points(rig, terms, L.node_x, L.node_y)  # [N, Hc, Wc]
        n, hc, wc = u.shape
        q = np.empty((n, 2, hc, wc), F32)
        q[:, 0] = (u - U0) * np.float32(2.0 * rig.a / hd.w) - 1.0
        q[:, 1] = (v - V0) * np.float32(2.0 * rig.a / hd.h) - 1.0
        f = L.frac  # [g] 0, 1/g, ...
        row = q[..., :-1, None] * (1.0 - f) + q[..., 1:, None] * f  # [N, 2, Hc, Wc-1, g]
        row = row.reshape(n, 2, hc, (wc - 1) * g)
        fy = f[:, None]
        full = row[:, :, :-1, None] * (1.0 - fy) + row[:, :, 1:, None] * fy  # [N, 2, Hc-1, g, W]
        full = full.reshape(n, 2, (hc - 1) * g, (wc - 1) * g)
        y0, y1, x0, x1 = L.box
        oy, ox = y0 - L.lattice_y0, x0 - L.lattice_x0
        return full[:, :, oy:oy + y1 - y0, ox:ox + x1 - x0].transpose(0, 2, 3, 1)  # [N, h, w, 2] (a view)

    # -- built once -------------------------------------------------------------------------------
    @cached_property
    def _layers(self) -> _Layers:
        idn, rig, s = self.identity, self.rig, self.size
        head = HeadSprite(idn, self.scene, rig)
        colours = PartColours.build(idn, head.eye_rgb, head.mouth_rgb, float(head.lighting.light[0]))
        sprite = np.concatenate([head.p, head.a[None]], 0).astype(F32)
        bg = paint_background(self.scene, s)  # [3, S, S]
        bp, ba = paint_body(idn, rig, head.lighting)
        full = bp + (1.0 - ba)[None] * bg
        static = (np.clip(full, 0, 1) * 255.0 + 0.5).astype(np.uint8).transpose(1, 2, 0).copy()
        y0, y1, x0, x1 = self._box(head)
        k = (1.0 - ba[y0:y1, x0:x1])[None]
        g = max(2, int(round(4 * s / 256)))
        kx0, kx1 = x0 // g, (x1 - 1) // g + 2
        ky0, ky1 = y0 // g, (y1 - 1) // g + 2
        return _Layers(
            head=head, colours=colours, sprite=sprite, static=static, box=(y0, y1, x0, x1),
            base=torch.from_numpy(np.ascontiguousarray(full[:, y0:y1, x0:x1])),
            keep=torch.from_numpy(np.ascontiguousarray(k)),
            keep_bg=torch.from_numpy(np.ascontiguousarray(k * bg[:, y0:y1, x0:x1])),
            step=g, node_x=(np.arange(kx0, kx1, dtype=F32) * g + 0.5)[None, :],
            node_y=(np.arange(ky0, ky1, dtype=F32) * g + 0.5)[:, None],
            lattice_x0=kx0 * g, lattice_y0=ky0 * g,
            frac=(np.arange(g) / g).astype(F32))

    def _box(self, head: HeadSprite) -> tuple[int, int, int, int]:
        """Frame box holding the head sprite's visible pixels in any pose within POSE_LIMITS."""
        rig = self.rig
        ii, jj = np.nonzero(head.a[::2, ::2] > 0.002)
        u = (U0 + (jj * 2 + 0.5) / rig.a).astype(F32)
        v = (V0 + (ii * 2 + 0.5) / rig.a).astype(F32)
        z = rig.depth(u, v)
        xs, ys = [], []
        for yaw in (-1, 0, 1):
            for pitch in (-1, 0, 1):
                for roll in (-1, 0, 1):
                    p = Pose(rig, *(math.radians(k * lim) for k, lim in zip((yaw, pitch, roll), POSE_LIMITS)),
                             jaw=rig.jaw_drop)
                    x, y = _project_many(p, u, v + p.jaw * rig.jaw(u, v), z)
                    xs += [x.min(), x.max()]
                    ys += [y.min(), y.max()]
        m = 2 + int(rig.a * 0.03)
        s = self.size
        return (max(0, int(min(ys)) - m), min(s, int(max(ys)) + m + 1),
                max(0, int(min(xs)) - m), min(s, int(max(xs)) + m + 1))


def _project_many(p: Pose, u: np.ndarray, v: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised `Pose.project` (without the jaw, which the caller applies)."""
    r = p.rig
    u1, z1 = u * math.cos(p.yaw) + z * math.sin(p.yaw), -u * math.sin(p.yaw) + z * math.cos(p.yaw)
    v1 = r.pivot + (v - r.pivot) * math.cos(p.pitch) + z1 * math.sin(p.pitch)
    dv = v1 - r.pivot
    u2 = u1 * math.cos(p.roll) - dv * math.sin(p.roll)
    v2 = u1 * math.sin(p.roll) + dv * math.cos(p.roll) + r.pivot
    return r.cx + r.a * u2, r.cy + r.a * v2


def contact_sheet(seeds: Sequence[int], size: int = 128, cols: int = 4) -> np.ndarray:
    """A grid [rows·size, cols·size, 3] uint8 of identities in neutral state, identity seed k in
    scene k + 1000."""
    rows = (len(seeds) + cols - 1) // cols
    sheet = np.zeros((rows * size, cols * size, 3), np.uint8)
    for i, sd in enumerate(seeds):
        img = AvatarRenderer(Identity.from_seed(int(sd)), Scene.from_seed(int(sd) + 1000), size).render(FaceState())
        r, c = divmod(i, cols)
        sheet[r * size:(r + 1) * size, c * size:(c + 1) * size] = img
    return sheet
