"""Random face states for the experts: what training draws its samples from and validation its
held-out cases (`eval/train_experts.py`, `eval/validate.py`)."""

from __future__ import annotations

import numpy as np

from avatarstream.data import FaceState


def random_state(rng: np.random.Generator) -> FaceState:
    """A face state spread over (and a bit beyond) what the motion/viseme tracks produce."""
    op = 0.0 if rng.random() < 0.25 else float(rng.uniform(0, 1.0))
    return FaceState(open=op, width=float(rng.uniform(-0.8, 0.8)), round=float(rng.uniform(0, 1) ** 2),
                     teeth=float(rng.uniform(0, 1)), smile=float(rng.uniform(-0.4, 0.8)),
                     yaw=float(rng.uniform(-10, 10)), pitch=float(rng.uniform(-8, 8)), roll=float(rng.uniform(-6, 6)),
                     blink=0.0 if rng.random() < 0.5 else float(rng.uniform(0, 1)), brow=float(rng.uniform(0, 1)),
                     gaze_x=float(rng.uniform(-1, 1)), gaze_y=float(rng.uniform(-1, 1)))
