"""Head motion, blinks, brows, gaze and smile from an identity's talking style (dynamic identity).

Everything here is a function of (style, speech timing, seed): the same inputs give the same
tracks. Mouth shapes come from `visemes.mouth_track`; this module adds the rest of the face:

- head sway: a sum of three slow sinusoids per axis around the style's sway frequency, damped to
  60% while listening (not speaking);
- nods on stressed syllables: long vowels (≥ 0.1 s) get a pitch-down bump of the style's nod
  amplitude and a brow raise, at most one every 0.5 s;
- blinks: a Poisson process at the style's blink rate, each blink closing in 70 ms and opening in
  130 ms;
- gaze: small saccades every 0.8–3 s, eased over three frames;
- smile: the style's smile bias plus a slow wander, a little lower while speaking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from avatarstream.data.identity import TalkingStyle
from avatarstream.media.speech import Phone
from avatarstream.data.visemes import VISEMES, viseme_of

PITCH_REST = 1.0  # degrees: a slight downward look at rest


@dataclass
class MotionTrack:
    """Per-frame float32 arrays [F] (FaceState units)."""

    yaw: np.ndarray
    pitch: np.ndarray
    roll: np.ndarray
    blink: np.ndarray
    brow: np.ndarray
    gaze_x: np.ndarray
    gaze_y: np.ndarray
    smile: np.ndarray


def _bump(t: np.ndarray, centre: float, width: float) -> np.ndarray:
    return np.exp(-0.5 * ((t - centre) / width) ** 2)


def _sway(t: np.ndarray, freq: float, amp: float, rng: np.random.Generator) -> np.ndarray:
    """Sum of three sinusoids at freq × (0.55, 1, 1.7) with random phases; peak about `amp`."""
    out = np.zeros_like(t)
    for mult, w in ((0.55, 0.5), (1.0, 0.35), (1.7, 0.15)):
        out += w * np.sin(2 * np.pi * freq * mult * t + rng.uniform(0, 2 * np.pi))
    return amp * out


def stressed_times(phones: Sequence[Phone], min_gap: float = 0.5) -> list[float]:
    """Centres of long vowels (≥ 0.1 s), at least `min_gap` apart: where nods land."""
    out: list[float] = []
    for p in phones:
        if p.end - p.start >= 0.1 and VISEMES[viseme_of(p)].vowel:
            c = 0.5 * (p.start + p.end)
            if not out or c - out[-1] >= min_gap:
                out.append(c)
    return out


def blink_track(t: np.ndarray, rate_per_min: float, rng: np.random.Generator) -> np.ndarray:
    """0 open .. 1 shut; blink onsets from a Poisson process (refractory 0.4 s)."""
    out = np.zeros_like(t)
    s = float(rng.exponential(60.0 / rate_per_min)) * 0.5
    end = float(t[-1]) if len(t) else 0.0
    while s < end:
        close, open_ = 0.07, 0.13
        rising = (t >= s) & (t < s + close)
        out[rising] = np.maximum(out[rising], (t[rising] - s) / close)
        falling = (t >= s + close) & (t < s + close + open_)
        out[falling] = np.maximum(out[falling], 1.0 - (t[falling] - s - close) / open_)
        s += 0.4 + float(rng.exponential(60.0 / rate_per_min))
    return np.clip(out, 0.0, 1.0)


def gaze_track(t: np.ndarray, fps: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    gx, gy = np.zeros_like(t), np.zeros_like(t)
    s, x, y = 0.0, 0.0, 0.0
    end = float(t[-1]) if len(t) else 0.0
    while s <= end:
        x = float(np.clip(rng.normal(0, 0.25), -0.6, 0.6))
        y = float(np.clip(rng.normal(0, 0.08), -0.25, 0.25))
        sel = t >= s
        gx[sel], gy[sel] = x, y
        s += float(rng.uniform(0.8, 3.0))
    k = np.ones(3) / 3  # eased saccades (three frames)
    return (np.convolve(np.pad(gx, 1, mode="edge"), k, "valid"), np.convolve(np.pad(gy, 1, mode="edge"), k, "valid"))


def motion_track(style: TalkingStyle, frames: int, fps: int, speaking: np.ndarray, phones: Sequence[Phone],
                 seed: int) -> MotionTrack:
    """All non-mouth face tracks for `frames` frames; `speaking` [F] bool from the mouth track."""
    rng = np.random.default_rng(seed)
    t = (np.arange(frames) + 0.5) / fps  # frame centres, seconds
    # listening damps the sway (eased over 0.4 s so it never jumps)
    w = max(1, min(frames, int(0.4 * fps)))  # a kernel longer than the track would lengthen it
    act = np.convolve(speaking.astype(np.float64), np.ones(w) / w, "same")
    gain = 0.6 + 0.4 * act
    yaw = _sway(t, style.sway_frequency, style.sway_amplitude, rng) * gain
    roll = _sway(t, style.sway_frequency * 0.8, style.sway_amplitude * 0.45, rng) * gain
    pitch = PITCH_REST + _sway(t, style.sway_frequency * 1.3, style.sway_amplitude * 0.35, rng) * gain
    brow = np.full_like(t, 0.25)
    for c in stressed_times(phones):
        b = _bump(t, c + 0.04, 0.09)
        pitch += style.nod_amplitude * b
        brow += 0.35 * _bump(t, c, 0.12) * min(1.0, style.nod_amplitude / 1.5)
    blink = blink_track(t, style.blink_rate, rng)
    gaze_x, gaze_y = gaze_track(t, fps, rng)
    smile = style.smile_bias + _sway(t, 0.07, 0.08, rng) - 0.05 * act
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return MotionTrack(f32(yaw), f32(pitch), f32(roll), f32(blink), f32(np.clip(brow, 0, 1)), f32(gaze_x),
                       f32(gaze_y), f32(np.clip(smile, -0.4, 0.8)))
