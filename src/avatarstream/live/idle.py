"""IdleAnimator: what a live avatar shows while nobody speaks through it (it listens).

The reference's first usable frame, alive with natural small motion and the mouth as the
reference has it (closed): a slow sway (two incommensurate sines), a slight nod and a breathing
scale, all under 1.5% of the frame, applied as one affine warp per frame (`grid_sample`, batched
over the frames asked for). Deterministic in the frame index, so any frame can be rendered at any
time and a resumed idle stretch continues smoothly. It runs no model: an idle session costs about
a millisecond per frame, whatever the model, so the model's time goes to sessions that speak.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


class IdleAnimator:
    def __init__(self, reference: torch.Tensor, *, fps: int = 25, amplitude: float = 0.012,
                 seed: int = 0) -> None:
        """reference: [F, 3, H, W] uint8; the first frame that is not blank is animated."""
        ref = reference.float()
        std = ref.flatten(1).std(dim=1)  # [F]
        first = int(torch.nonzero(std > 1.0)[0]) if bool((std > 1.0).any()) else 0
        self.image = (ref[first : first + 1] / 127.5 - 1.0).contiguous()  # [1, 3, H, W]
        self.fps = fps
        self.amplitude = amplitude
        rng = np.random.default_rng(seed)
        self._phase = rng.uniform(0, 2 * math.pi, 4)

    def _affine(self, t: np.ndarray) -> torch.Tensor:
        """[N, 2, 3] affine matrices (normalised coordinates) for times t [N] in seconds."""
        a, p = self.amplitude, self._phase
        dx = a * (0.6 * np.sin(2 * math.pi * 0.23 * t + p[0]) + 0.4 * np.sin(2 * math.pi * 0.37 * t + p[1]))
        dy = a * 0.5 * np.sin(2 * math.pi * 0.31 * t + p[2])  # slight nod
        s = 1.0 + a * 0.4 * np.sin(2 * math.pi * 0.25 * t + p[3])  # breathing
        rot = a * 0.5 * np.sin(2 * math.pi * 0.17 * t + p[0] + p[2])  # head tilt (radians)
        cos, sin = np.cos(rot) / s, np.sin(rot) / s
        m = np.stack([np.stack([cos, -sin, dx], -1), np.stack([sin, cos, dy], -1)], 1)
        return torch.from_numpy(m.astype(np.float32))  # [N, 2, 3]

    def frames(self, start: int, count: int) -> np.ndarray:
        """Frames start .. start + count - 1 as [count, H, W, 3] uint8."""
        if count <= 0:
            h, w = self.image.shape[-2:]
            return np.zeros((0, h, w, 3), np.uint8)
        t = (start + np.arange(count)) / self.fps
        theta = self._affine(t)
        img = self.image.expand(count, -1, -1, -1)  # [N, 3, H, W]
        grid = F.affine_grid(theta, list(img.shape), align_corners=False)
        out = F.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=False)
        u8 = ((out.clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)  # [N, 3, H, W]
        return u8.permute(0, 2, 3, 1).contiguous().numpy()
