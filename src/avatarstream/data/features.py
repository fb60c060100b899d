"""The per-frame face state of a synthetic avatar (what the motion/viseme tracks animate and the
renderer draws), and the reserved colour of the open mouth.

Sign conventions (image coordinates: x to the right, y down):
- `yaw` > 0 turns the face towards image right (features shift to +x), `pitch` > 0 looks down
  (features shift to +y), `roll` > 0 tilts the top of the head towards image right (clockwise on
  screen, about the base of the neck). All three in degrees.
- `gaze_x` > 0 moves the irises to image right, `gaze_y` > 0 moves them down.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The open mouth's interior is drawn flat in exactly this colour (teeth and tongue in others), and
# nothing else near the mouth (skin, lips, beards, shadows) comes within 36 of it in any channel
# (the renderer pushes the rare exceptions away): a dark violet, bluer than any skin, lip or hair
# tone. Evaluation counts these pixels.
MOUTH_INTERIOR = np.array([60, 10, 80], np.uint8)  # [3] RGB


@dataclass(frozen=True)
class FaceState:
    """One frame's face parameters (all floats, neutral at 0; signs in the module docstring)."""

    open: float = 0.0  # 0..1: lips apart
    width: float = 0.0  # -1..1: narrow..wide
    round: float = 0.0  # 0..1: puckered
    teeth: float = 0.0  # 0..1: upper teeth shown
    smile: float = 0.0  # -0.4..0.8
    yaw: float = 0.0  # degrees, typically ±10
    pitch: float = 0.0  # degrees, typically ±8
    roll: float = 0.0  # degrees, typically ±6
    blink: float = 0.0  # 0 open..1 shut
    brow: float = 0.0  # 0..1: raised
    gaze_x: float = 0.0  # -1..1
    gaze_y: float = 0.0  # -1..1
