"""IdleAnimator: what a live avatar shows while it does not speak: idle, or listening to the user.

The reference's first usable frame, alive with natural small motion and the mouth as the
reference has it (closed), applied as one affine warp per frame (`grid_sample`, batched over the
frames asked for). Two layers of motion, each with a weight:
- sway: a slow sway (two incommensurate sines), a slight nod, breathing and a head tilt, all
  under 1.5% of the frame: a face that is merely alive;
- attention (while the user speaks): a slow nod every few seconds (a raised-cosine dip of the
  head, about twice the sway's nod), the head turned to the viewer (the sway damped) and leaning
  in slightly (1.2% larger), with a small tilt. No blinks: the inference path has no eye locator
  (the face-state expert is evaluation code), and a blink drawn blind would land off the eyes.
The mode (`idle`, `listening`, or `rest` = no warp at all, the reference itself: what the
model's first speech frames continue from) is set at a frame with `set_mode`; the weights then
move to the mode's over `blend_s` (a smoothstep from wherever they were), so every switch is as
continuous as the motion itself. Around the model's frames two dissolves hide what the model
changes in the face: the frames that ease into speech dissolve into its first frame (`into`), and
the first ones after it out of its last frame (`fade_from`). Deterministic in the frame index and the `set_mode` / `fade_from` calls, so
any frame can be rendered at any time and a resumed stretch continues smoothly. It runs no
model: about a millisecond per frame, whatever the model, so the model's time goes to sessions
that speak.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# (sway weight, attention weight) of each mode
MODES: dict[str, tuple[float, float]] = {"idle": (1.0, 0.0), "listening": (0.6, 1.0),
                                         "rest": (0.0, 0.0)}
NOD_PERIOD_S, NOD_S, NOD_DEPTH = 3.1, 0.9, 0.018  # a nod every 3.1 s, 0.9 s long, 0.9% of height
LEAN_IN, ATTENTIVE_TILT = 0.012, 0.015  # scale (1.2% larger) and tilt (radians) while listening


@dataclass(frozen=True)
class _Ramp:
    """From frame `frame` on, the weights go from `start` to `target` over `frames` frames."""

    frame: int
    start: tuple[float, float]
    target: tuple[float, float]
    frames: int


def _smoothstep(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, 0.0, 1.0)
    return x * x * (3.0 - 2.0 * x)


MAX_RAMPS = 256  # mode switches kept (each utterance and turn adds one or two)


class IdleAnimator:
    def __init__(self, reference: torch.Tensor, *, fps: int = 25, amplitude: float = 0.012,
                 seed: int = 0, blend_s: float = 0.4) -> None:
        """reference: [F, 3, H, W] uint8; the first frame that is not blank is animated."""
        ref = reference.float()
        std = ref.flatten(1).std(dim=1)  # [F]
        first = int(torch.nonzero(std > 1.0)[0]) if bool((std > 1.0).any()) else 0
        self.image = (ref[first : first + 1] / 127.5 - 1.0).contiguous()  # [1, 3, H, W]
        self.fps = fps
        self.amplitude = amplitude
        self.blend = max(1, round(blend_s * fps))  # frames of a mode switch
        rng = np.random.default_rng(seed)
        self._phase = rng.uniform(0, 2 * math.pi, 4)
        self._ramps: list[_Ramp] = [_Ramp(0, MODES["idle"], MODES["idle"], 1)]
        self._fades: list[tuple[int, int, torch.Tensor]] = []  # (frame, frames, image [3, H, W])
        self._lock = threading.Lock()  # set_mode may come from another thread than frames()

    # -- modes -----------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """The mode the weights are heading to (the last `set_mode`)."""
        target = self._ramps[-1].target
        return next(m for m, w in MODES.items() if w == target)

    def set_mode(self, mode: str, frame: int, *, frames: int | None = None) -> int:
        """From `frame` on, blend into `mode` over `frames` frames (default `blend_s`). Frames
        earlier than the last switch's are taken as that one's. Returns the frame from which
        the weights are the mode's (`frame` itself when they already are)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        target = MODES[mode]
        with self._lock:
            last = self._ramps[-1]
            frame = max(int(frame), last.frame)
            if last.target == target:
                return max(frame, last.frame + last.frames)
            start = tuple(float(x) for x in self._weights(np.array([frame]))[0])
            # a switch at the frame of the last one replaces it (nothing was shown in between)
            if frame == last.frame and len(self._ramps) > 1:
                self._ramps.pop()
            there = bool(np.allclose(start, target))
            n = 1 if there else max(1, self.blend if frames is None else int(frames))
            self._ramps.append(_Ramp(frame, start, target, n))  # type: ignore[arg-type]
            if len(self._ramps) > MAX_RAMPS:  # a session of days: frames that old are never asked for again
                del self._ramps[: len(self._ramps) - MAX_RAMPS]
            return frame if there else frame + n

    def fade_from(self, image: np.ndarray, frame: int, frames: int | None = None) -> None:
        """Frames `frame` .. + `frames` (default `blend_s`) dissolve from `image` [H, W, 3] uint8
        (the model's last frame) into the animation: speech ends without a jump."""
        n = self.blend if frames is None else max(1, int(frames))
        img = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float() / 127.5 - 1.0
        with self._lock:
            self._fades = [f for f in self._fades if f[0] + f[1] > frame][-1:]
            self._fades.append((int(frame), n, img))

    def weights(self, idx: np.ndarray) -> np.ndarray:
        """[N, 2] (sway, attention) weights of frames `idx` [N]."""
        with self._lock:
            return self._weights(np.asarray(idx))

    def _weights(self, idx: np.ndarray) -> np.ndarray:
        frames = np.array([r.frame for r in self._ramps])
        k = np.searchsorted(frames, idx, side="right") - 1  # the ramp each frame is under
        k = np.maximum(k, 0)
        out = np.empty((idx.size, 2))
        for j in np.unique(k):
            r, sel = self._ramps[j], k == j
            u = _smoothstep((idx[sel] - r.frame) / r.frames)[:, None]
            out[sel] = np.asarray(r.start) + (np.asarray(r.target) - np.asarray(r.start)) * u
        return out

    # -- motion ----------------------------------------------------------------------------------
    def _affine(self, t: np.ndarray, w: np.ndarray) -> torch.Tensor:
        """[N, 2, 3] affine matrices (normalised coordinates) for times t [N] in seconds and
        weights w [N, 2] (sway, attention)."""
        a, p = self.amplitude, self._phase
        sway, att = w[:, 0], w[:, 1]
        dx = sway * a * (0.6 * np.sin(2 * math.pi * 0.23 * t + p[0])
                         + 0.4 * np.sin(2 * math.pi * 0.37 * t + p[1]))
        dy = sway * a * 0.5 * np.sin(2 * math.pi * 0.31 * t + p[2])  # slight nod
        u = np.mod(t, NOD_PERIOD_S) / NOD_S  # the attentive nod: the head dips and comes back
        nod = np.where(u < 1.0, 0.5 * (1.0 - np.cos(2 * math.pi * np.minimum(u, 1.0))), 0.0)
        dy = dy - att * NOD_DEPTH * nod  # content moves down: the head nods
        s = 1.0 + sway * a * 0.4 * np.sin(2 * math.pi * 0.25 * t + p[3])  # breathing
        s = s * (1.0 + att * LEAN_IN)  # leaning in: the face a little larger
        rot = sway * a * 0.5 * np.sin(2 * math.pi * 0.17 * t + p[0] + p[2]) + att * ATTENTIVE_TILT
        cos, sin = np.cos(rot) / s, np.sin(rot) / s
        m = np.stack([np.stack([cos, -sin, dx], -1), np.stack([sin, cos, dy], -1)], 1)
        return torch.from_numpy(m.astype(np.float32))  # [N, 2, 3]

    def frames(self, start: int, count: int, *, into: np.ndarray | None = None) -> np.ndarray:
        """Frames start .. start + count - 1 as [count, H, W, 3] uint8; `into` [H, W, 3] uint8
        (the model's first frame): the frames dissolve into it, the last one almost there."""
        if count <= 0:
            h, w = self.image.shape[-2:]
            return np.zeros((0, h, w, 3), np.uint8)
        idx = start + np.arange(count)
        theta = self._affine(idx / self.fps, self.weights(idx))
        img = self.image.expand(count, -1, -1, -1)  # [N, 3, H, W]
        grid = F.affine_grid(theta, list(img.shape), align_corners=False)
        out = F.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=False)
        with self._lock:
            fades = list(self._fades)
        for f0, n, src in fades:  # dissolve from the model's last frame
            u = np.where(idx < f0, 1.0, (idx - f0 + 1) / (n + 1))
            beta = torch.from_numpy(_smoothstep(u).astype(np.float32))
            out = src + (out - src) * beta[:, None, None, None]
        if into is not None:
            dst = torch.from_numpy(np.ascontiguousarray(into)).permute(2, 0, 1).float() / 127.5 - 1.0
            alpha = torch.from_numpy(_smoothstep((np.arange(count) + 1) / (count + 1)).astype(np.float32))
            out = out + (dst - out) * alpha[:, None, None, None]
        u8 = ((out.clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)  # [N, 3, H, W]
        return u8.permute(0, 2, 3, 1).contiguous().numpy()
