"""Synthetic people: face, hair, accessories and clothing parameters, and a talking style, all
drawn deterministically from one integer seed (`Identity.from_seed`).

Lengths are head units (1 = face half-width `a`; u to image right, v down, origin at the face
centre); colours are RGB floats 0..1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RGB = tuple[float, float, float]

# light .. dark skin tones (interpolated; undertone jittered per person)
SKIN_TONES = np.array([(0.99, 0.87, 0.78), (0.96, 0.80, 0.68), (0.90, 0.70, 0.56), (0.80, 0.58, 0.42),
                       (0.67, 0.46, 0.31), (0.53, 0.35, 0.23), (0.41, 0.26, 0.17), (0.31, 0.20, 0.14)])
HAIR_COLOURS: dict[str, RGB] = {
    "black": (0.07, 0.06, 0.06), "dark brown": (0.19, 0.12, 0.08), "brown": (0.37, 0.23, 0.13),
    "auburn": (0.47, 0.19, 0.10), "red": (0.76, 0.38, 0.16), "blond": (0.84, 0.68, 0.40),
    "platinum": (0.93, 0.87, 0.70), "grey": (0.60, 0.60, 0.60), "white": (0.90, 0.89, 0.86),
    "blue": (0.18, 0.32, 0.66), "pink": (0.86, 0.44, 0.62)}
IRIS_COLOURS: tuple[RGB, ...] = ((0.33, 0.20, 0.11), (0.18, 0.11, 0.07), (0.47, 0.38, 0.18), (0.28, 0.46, 0.28),
                                 (0.27, 0.47, 0.72), (0.46, 0.52, 0.58))
HAIR_STYLES = ("short", "crop", "long", "bob", "bangs", "bun", "curly", "afro", "bald", "receding", "wavy")
BEARDS = ("none", "stubble", "moustache", "goatee", "full")
GLASSES = ("none", "round", "rect", "browline")
CLOTHING = ("crew", "vneck", "collar", "turtleneck", "hoodie", "scoop")
CLOTH_COLOURS: tuple[RGB, ...] = (
    (0.15, 0.22, 0.42), (0.55, 0.12, 0.14), (0.20, 0.45, 0.28), (0.85, 0.85, 0.82), (0.12, 0.12, 0.13),
    (0.45, 0.47, 0.50), (0.90, 0.62, 0.20), (0.35, 0.58, 0.78), (0.62, 0.35, 0.55), (0.80, 0.40, 0.35),
    (0.30, 0.24, 0.18), (0.18, 0.50, 0.52), (0.92, 0.80, 0.55), (0.50, 0.55, 0.25), (0.95, 0.95, 0.95),
    (0.40, 0.30, 0.65))
METALS: tuple[RGB, ...] = ((0.85, 0.70, 0.30), (0.78, 0.79, 0.80))
FRAME_COLOURS: tuple[RGB, ...] = ((0.08, 0.08, 0.09), (0.35, 0.20, 0.10), (0.80, 0.66, 0.30), (0.70, 0.72, 0.75),
                                  (0.60, 0.12, 0.15), (0.15, 0.25, 0.55))


@dataclass(frozen=True)
class TalkingStyle:
    """How a person moves while talking (read by the motion and viseme tracks)."""

    mouth_amplitude: float = 1.0  # scales mouth opening, ~0.6-1.2
    sharpness: float = 0.5  # coarticulation crispness 0 (lazy) .. 1 (crisp)
    sway_amplitude: float = 1.5  # head sway, degrees ~0.5-3
    sway_frequency: float = 0.25  # Hz ~0.1-0.5
    nod_amplitude: float = 1.0  # degrees ~0-3
    blink_rate: float = 15.0  # blinks per minute ~8-30
    smile_bias: float = 0.1  # resting smile ~-0.1..0.4


@dataclass(frozen=True)
class Identity:
    """One synthetic person (see the module docstring for units)."""

    seed: int
    style: TalkingStyle
    skin: RGB
    face_width: float  # scales the face half-width a (0.94..1.06)
    cranium: float  # half-height of the upper face ellipse
    jaw_width: float  # half-width of the jaw ellipse
    chin: float  # v of the chin
    eye_x: float  # |u| of the eye centres
    eye_y: float  # v of the eye centres
    eye_size: float
    eye_tilt: float  # outer corners up (> 0)
    iris: RGB
    brow_thickness: float
    brow_arch: float
    brow_colour: RGB
    nose_tip: float  # v of the nose tip
    nose_width: float
    mouth_y: float  # v of the line where the lips meet
    mouth_width: float  # half-width of the closed mouth
    lip_upper: float
    lip_lower: float
    lip_colour: RGB
    hair_style: str
    hair_colour_name: str
    hair_colour: RGB
    hair_volume: float
    beard: str
    glasses: str
    glasses_colour: RGB
    earrings: RGB | None
    ear_size: float
    neck_width: float
    shoulder_width: float
    clothing: str
    clothing_colour: RGB
    clothing_accent: RGB
    blush: float

    @classmethod
    def from_seed(cls, seed: int) -> "Identity":
        """A deterministic person from an integer seed (no global random state)."""
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x1D])
        u = lambda lo, hi: float(rng.uniform(lo, hi))  # noqa: E731
        pick = lambda seq, p=None: seq[int(rng.choice(len(seq), p=p))]  # noqa: E731
        tone = float(rng.beta(1.1, 1.3))
        i = min(int(tone * (len(SKIN_TONES) - 1)), len(SKIN_TONES) - 2)
        f = tone * (len(SKIN_TONES) - 1) - i
        skin = SKIN_TONES[i] * (1 - f) + SKIN_TONES[i + 1] * f
        skin = np.clip(skin * np.array([1 + u(-0.03, 0.04), 1.0, 1 + u(-0.06, 0.04)]), 0, 1)
        dark = tone > 0.55
        names = list(HAIR_COLOURS)
        w = np.array([5, 4, 3, 1, 1.2, 2.2, 0.8, 1.4, 0.8, 0.25, 0.25]) if not dark else \
            np.array([10, 4, 1.5, 0.3, 0.2, 0.6, 0.2, 1.6, 0.8, 0.25, 0.25])
        hair_name = pick(names, w / w.sum())
        hair = np.clip(np.array(HAIR_COLOURS[hair_name]) * u(0.88, 1.12), 0, 1)
        masc = rng.random() < 0.5  # only steers the style priors; every combination can occur
        sw = np.array([4, 2, 0.6, 0.6, 0.5, 0.3, 1.2, 0.8, 1.0, 1.6, 0.3]) if masc else \
            np.array([1, 0.4, 4, 2, 1.6, 1.6, 1.4, 0.9, 0.1, 0.1, 1.6])
        if dark:
            sw = sw * np.array([1, 1.2, 0.8, 1, 1, 1, 1.5, 2.5, 1, 1, 0.6])
        hair_style = pick(HAIR_STYLES, sw / sw.sum())
        natural = hair_name not in ("blue", "pink")
        beard = pick(BEARDS, np.array([0.5, 0.18, 0.1, 0.1, 0.12])) if masc and natural else "none"
        brow = np.clip(hair * 0.75 if hair_name not in ("platinum", "white", "pink", "blue", "blond")
                       else np.array(HAIR_COLOURS["brown"]) * u(0.8, 1.5), 0, 1)
        lip = skin * np.array([0.86, 0.58, 0.58]) + np.array([0.07, 0.0, 0.02])
        if not masc and rng.random() < 0.35:
            lip = lip * 0.5 + np.array(pick(((0.80, 0.16, 0.20), (0.86, 0.42, 0.50), (0.72, 0.30, 0.28)))) * 0.5
        style = TalkingStyle(mouth_amplitude=u(0.6, 1.2), sharpness=u(0, 1), sway_amplitude=u(0.5, 3.0),
                             sway_frequency=u(0.1, 0.5), nod_amplitude=u(0, 3), blink_rate=u(8, 30),
                             smile_bias=u(-0.1, 0.4))
        glasses = pick(GLASSES, np.array([0.68, 0.12, 0.14, 0.06]))
        earrings = pick(METALS) if rng.random() < (0.45 if not masc else 0.08) else None
        return cls(
            seed=int(seed), style=style, skin=as_rgb(skin), face_width=u(0.94, 1.06), cranium=u(1.16, 1.32),
            jaw_width=u(0.66, 0.86) if not masc else u(0.74, 0.9), chin=u(1.28, 1.42),
            eye_x=u(0.38, 0.45), eye_y=u(-0.1, 0.0), eye_size=u(0.85, 1.05), eye_tilt=u(-0.02, 0.05),
            iris=as_rgb(np.array(pick(IRIS_COLOURS if not dark else IRIS_COLOURS[:3])) * u(0.85, 1.15)),
            brow_thickness=u(0.045, 0.065) if not masc else u(0.06, 0.085), brow_arch=u(0.02, 0.08),
            brow_colour=as_rgb(brow), nose_tip=u(0.38, 0.48), nose_width=u(0.13, 0.19) * (1.15 if dark else 1.0),
            mouth_y=u(0.74, 0.82), mouth_width=u(0.34, 0.41), lip_upper=u(0.065, 0.095) * (1.15 if dark else 1),
            lip_lower=u(0.09, 0.13) * (1.15 if dark else 1), lip_colour=as_rgb(lip), hair_style=hair_style,
            hair_colour_name=hair_name, hair_colour=as_rgb(hair), hair_volume=u(0.9, 1.15), beard=beard,
            glasses=glasses, glasses_colour=pick(FRAME_COLOURS), earrings=earrings, ear_size=u(0.9, 1.12),
            neck_width=u(0.4, 0.5) if not masc else u(0.46, 0.56),
            shoulder_width=u(1.95, 2.25) if not masc else u(2.15, 2.45), clothing=pick(CLOTHING),
            clothing_colour=as_rgb(np.array(pick(CLOTH_COLOURS)) * u(0.85, 1.1)),
            clothing_accent=as_rgb(np.array(pick(CLOTH_COLOURS))), blush=u(0.0, 0.25))

    def describe(self) -> str:
        """A short text description (hair, glasses, beard, clothing)."""
        bits = [f"{self.hair_colour_name} {self.hair_style} hair" if self.hair_style != "bald" else "bald"]
        if self.glasses != "none":
            bits.append("glasses")
        if self.beard != "none":
            bits.append(self.beard if self.beard != "full" else "beard")
        bits.append(f"{self.clothing} top")
        return ", ".join(bits)


def as_rgb(x: np.ndarray | tuple) -> RGB:
    """An RGB tuple of floats 0..1 (rounded to 4 places) from an array-like."""
    a = np.clip(np.asarray(x, np.float64), 0.0, 1.0)
    return (round(float(a[0]), 4), round(float(a[1]), 4), round(float(a[2]), 4))
