"""Scenes: background, light and framing, drawn deterministically from one integer seed, and the
background painter (`paint_background`)."""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass

import numpy as np

from avatarstream.data.draw import F32, box_blur, smoothstep, value_noise
from avatarstream.data.identity import RGB, as_rgb

BACKGROUNDS = ("gradient", "bokeh", "studio", "stripes", "room", "wall")


@dataclass(frozen=True)
class Scene:
    """Background, lighting and framing of a shot."""

    seed: int
    background: str  # one of BACKGROUNDS
    colour_a: RGB
    colour_b: RGB
    accent: RGB
    light_azimuth: float  # degrees, negative = light from the left of the image
    light_elevation: float  # degrees above the horizon
    light_intensity: float
    light_tint: RGB  # multiplies the direct light
    ambient: float  # fraction of light that is not directional
    scale: float  # framing: > 1 close-up, < 1 medium shot (0.85..1.15)
    offset_x: float  # horizontal head offset, fraction of the frame width
    offset_y: float  # vertical head offset, fraction of the frame height

    @classmethod
    def from_seed(cls, seed: int) -> "Scene":
        """A deterministic scene from an integer seed."""
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x5C])
        u = lambda lo, hi: float(rng.uniform(lo, hi))  # noqa: E731
        hue = u(0, 1)
        sat, val = u(0.2, 0.75), u(0.3, 0.85)
        a = colorsys.hsv_to_rgb(hue, sat, val)
        b = colorsys.hsv_to_rgb((hue + u(-0.15, 0.15)) % 1, np.clip(sat + u(-0.2, 0.2), 0.05, 0.9),
                                np.clip(val * u(0.45, 0.9), 0.08, 0.9))
        acc = colorsys.hsv_to_rgb((hue + u(0.25, 0.75)) % 1, u(0.3, 0.8), u(0.6, 1.0))
        warm = u(-1, 1)
        tint = (1.0 + 0.08 * warm, 1.0 + 0.01 * warm, 1.0 - 0.1 * warm)
        return cls(seed=int(seed), background=BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))],
                   colour_a=as_rgb(a), colour_b=as_rgb(b), accent=as_rgb(acc), light_azimuth=u(-60, 60),
                   light_elevation=u(15, 45), light_intensity=u(0.85, 1.15), light_tint=as_rgb(tint),
                   ambient=u(0.38, 0.55), scale=u(0.85, 1.15), offset_x=u(-0.04, 0.04), offset_y=u(-0.015, 0.015))

    def light_vector(self) -> np.ndarray:
        """Unit vector towards the light [3] (x right, y down, z towards the camera)."""
        az, el = math.radians(self.light_azimuth), math.radians(self.light_elevation)
        return np.array([math.sin(az) * math.cos(el), -math.sin(el), math.cos(az) * math.cos(el)], F32)


def paint_background(scene: Scene, size: int) -> np.ndarray:
    """The scene's background [3, S, S] float32 RGB 0..1 (static; no person)."""
    rng = np.random.default_rng([scene.seed & 0xFFFFFFFF, 0xB6])
    s = size
    y = ((np.arange(s, dtype=F32) + 0.5) / s)[:, None]  # [S, 1] 0..1
    x = ((np.arange(s, dtype=F32) + 0.5) / s)[None, :]  # [1, S]
    ca, cb, acc = (np.array(c, F32)[:, None, None] for c in (scene.colour_a, scene.colour_b, scene.accent))
    kind = scene.background
    if kind == "gradient":
        ang = rng.uniform(0, 2 * np.pi)
        t = np.clip(0.5 + (x - 0.5) * np.cos(ang) + (y - 0.5) * np.sin(ang), 0, 1)
        img = ca * (1 - t) + cb * t
    elif kind == "bokeh":
        img = ca * (1 - y) + cb * y
        for _ in range(int(rng.integers(7, 15))):
            cx, cy, r = rng.uniform(-0.1, 1.1), rng.uniform(-0.1, 1.0), rng.uniform(0.05, 0.16)
            col = np.clip(acc * rng.uniform(0.6, 1.2) + rng.uniform(-0.15, 0.15, (3, 1, 1)), 0, 1)
            d = np.sqrt((x - cx) ** 2 + (y - cy) ** 2) - r
            cov = smoothstep(0.02, -0.02, d) * rng.uniform(0.2, 0.5)
            img = img + (col - img) * cov
    elif kind == "studio":
        cx, cy = 0.5 + rng.uniform(-0.15, 0.15), rng.uniform(0.3, 0.45)
        d = np.sqrt((x - cx) ** 2 + ((y - cy) * 0.8) ** 2)
        t = smoothstep(0.0, 0.85, d)
        img = (ca * 1.15) * (1 - t) + cb * 0.7 * t
    elif kind == "stripes":
        period, ang = rng.uniform(0.08, 0.25), rng.uniform(-0.5, 0.5)
        ph = (x * np.cos(ang) + y * np.sin(ang)) / period
        t = smoothstep(-0.15, 0.15, np.sin(2 * np.pi * ph))
        img = ca * (1 - t) + cb * t
        img = img * (1.0 - 0.25 * y)
    elif kind == "room":
        img = _room(rng, x, y, ca, cb, acc)
    else:  # plain wall with a soft light falloff and texture
        img = ca * (1.05 - 0.35 * np.sqrt((x - rng.uniform(0.2, 0.8)) ** 2 + (y - 0.3) ** 2))
    img = img + 0.025 * value_noise(rng, s, s, rng.uniform(3, 8))[None]
    return np.clip(img, 0, 1).astype(F32)


def _room(rng: np.random.Generator, x: np.ndarray, y: np.ndarray, wall: np.ndarray, floor: np.ndarray,
          acc: np.ndarray) -> np.ndarray:
    """A blurred interior: wall, a window or picture frame, a shelf, a lamp glow (depth of field)."""
    s = y.shape[0]
    img = np.broadcast_to(wall * (1.0 - 0.2 * y), (3, s, x.shape[1])).copy()
    horizon = rng.uniform(0.72, 0.9)
    img = np.where(y > horizon, floor * 0.8, img)
    for _ in range(int(rng.integers(1, 3))):
        x0, w = rng.uniform(-0.1, 0.8), rng.uniform(0.15, 0.35)
        y0, h = rng.uniform(0.05, 0.3), rng.uniform(0.2, 0.45)
        inside = (x > x0) & (x < x0 + w) & (y > y0) & (y < y0 + h)
        col = np.clip(acc * rng.uniform(0.6, 1.3), 0, 1) if rng.random() < 0.6 else np.full((3, 1, 1), 0.95, F32)
        img = np.where(inside, col, img)
        img = np.where(inside & (np.abs(x - (x0 + w / 2)) < 0.006), col * 0.6, img)
    ys = rng.uniform(0.45, 0.65)
    img = np.where((np.abs(y - ys) < 0.012) & (x < rng.uniform(0.3, 0.9)), floor * 0.6, img)
    lx, ly = rng.choice([0.1, 0.9]), rng.uniform(0.2, 0.5)
    glow = np.exp(-((x - lx) ** 2 + (y - ly) ** 2) / 0.02)
    img = img + glow * 0.35 * np.array([1.0, 0.85, 0.6], F32)[:, None, None]
    return box_blur(box_blur(img.astype(F32), max(1, s // 64)), max(1, s // 64))
