"""Reward terms of the feedback-alignment stage (GRPO / DPO): score a rendered video of one
(reference, speech) condition from its pixels and audio only, with the frozen evaluation experts.

Every term is "higher = better" and is None where it cannot be computed:

- **sync**: SyncNet confidence *at offset 0*: median over offsets of d(o) minus d(0) (`sync_distances`).
  Sync-C (median − min) rewards the best offset, so a video lagging its audio would still score;
  this term pays only for lips in step with the audio as it is played.
- **mouth_track**: Pearson correlation of the generated mouth opening (face-state regressor) with
  the synthetic renderer's exact track over the common frames (None for real footage or a
  constant track).
- **identity**: FaceSim as `evaluate` computes it: trimmed mean cosine of the identity embeddings
  of the 2 fps samples to the reference's mean embedding.
- **cadence**: −max(0, latent_cadence − 1): the 4-frame beat of a causal-VAE picture that steps once
  a latent and holds between (1 = no beat).
- **head_motion**: −style_error of the generated face-state track against the reference's (mouth
  amplitude, head sway, blink rate); None when the reference is shorter than 2 s.
- **mouth_hf**: −max(0, log(hf_gen / hf_ref)), hf = mean squared vertical second difference of the
  grey mouth crop (centred like the sync crops, side 1 face scale: the lips and the opening), the
  reference level being the ground truth's (the reference video's when there is none). Thin
  horizontal streaks in open mouths, the decoder's typical artefact, raise it; a blurrier mouth
  is not rewarded for being smooth (clipped at 0). The sync crop's 2.2 face scales would let lip,
  chin and nostril edges drown the streaks (a sixth of the response, measured). A reference of
  another scene can hold more mouth detail than the speech clip, so without a ground truth the
  level is more lenient.
- **silence**: share of silent frames (`silent_frames`) whose generated mouth opening is below
  MOUTH_CLOSED; None without a silent frame.

`RewardModel(frames, cond)` adds "total" = Σ weight · term over the terms that are not None.
What depends on the condition only (reference embedding and style, the ground truth's mouth
energy, silent-frame masks) is read once per condition name (`reads`) and shared by every render
of a GRPO group (`batch`). Condition names must therefore be unique per (reference, speech).

Caveat: these are the experts `eval` measures Sync-C, FaceSim and style with; a policy optimised
against them can learn to please them. Keep a held-out judge (real footage, human review).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from avatarstream.errors import ConfigError, InputError
from avatarstream.eval.experts import FPS, Experts, crop, grey, load_experts, to_canvas
from avatarstream.eval.metrics import (MOUTH_CLOSED, VSHIFT, FaceTrack, face_track, frame_changes, latent_cadence,
                                       reference_embedding, silent_frames, style_error, style_stats,
                                       sync_distances, trimmed_mean)

TERMS = ("sync", "mouth_track", "identity", "cadence", "head_motion", "mouth_hf", "silence")
# Lip sync is the target and dominates; the other terms guard against what a policy chasing sync
# could break (identity, mouth shape, motion, artefacts, a mouth moving in silence). Measured on a
# 3 s held-out render: sync 0.25 for the ground truth vs 0.04-0.05 for a 10-frame lag or a still
# frame (so weight 5 makes it the largest swing); mouth_track 0.99 vs -0.45 reversed; identity
# 0.98 vs 0.18 for another person; head_motion -0.2 vs -1.0 still; mouth_hf 0 vs -0.9 with
# streaks; silence 1 vs 0 mouth open. cadence is 0 for smooth motion and unbounded below (a
# picture held exactly still between latent steps reads in the hundreds), hence its small weight.
DEFAULT_WEIGHTS: dict[str, float] = {"sync": 5.0, "mouth_track": 1.0, "identity": 1.0, "cadence": 0.25,
                                     "head_motion": 0.5, "mouth_hf": 0.5, "silence": 0.5}
STYLE_MIN_FRAMES = 2 * FPS  # a reference shorter than 2 s has no measurable talking style
HF_SIDE = 1.0  # mouth crop side of the high-frequency energy, in face scales (~48 px on the canvas)
HF_SIZE = 64  # its resolution: a little above the canvas', so a 1-pixel streak is kept
HF_EPS = 1e-6
CACHE_CONDITIONS = 256  # per-condition reads kept (least recently used dropped)


@dataclass
class Condition:
    """One (reference, speech) condition a policy renders. reference [Fr, S, S, 3] uint8 (a video or
    one frame of the person); audio [N] float32 16 kHz mono from frame 0; mouth_track [F] the
    synthetic renderer's exact mouth opening per 25 fps frame (0..1), None for real footage;
    ground_truth [F, S, S, 3] uint8 of a synthetic clip, None otherwise."""

    name: str
    reference: np.ndarray
    audio: np.ndarray
    mouth_track: np.ndarray | None = None
    ground_truth: np.ndarray | None = None


@dataclass
class ConditionReads:
    """What a condition gives every render of it: the reference's mean identity embedding [D] and
    face-state track, its talking style (None under 2 s), the mouth high-frequency energy a render
    is held to, and the silent-frame masks by video length (filled on demand)."""

    ref_emb: torch.Tensor
    ref_states: np.ndarray
    ref_style: dict[str, float] | None
    hf_ref: float
    silent: dict[int, np.ndarray] = field(default_factory=dict)

    def silent_mask(self, audio: np.ndarray, frames: int) -> np.ndarray:
        if frames not in self.silent:
            self.silent[frames] = silent_frames(audio, frames)
        return self.silent[frames]


def check_frames(frames: np.ndarray, what: str = "frames") -> np.ndarray:
    a = np.asarray(frames)
    if a.ndim != 4 or a.shape[-1] != 3 or len(a) == 0 or a.dtype != np.uint8:
        raise InputError(f"{what} must be a non-empty [F, S, S, 3] uint8 array, got {a.dtype} {tuple(a.shape)}")
    return a


@torch.no_grad()
def mouth_hf_energy(frames: np.ndarray, states: np.ndarray, batch: int = 32) -> float:
    """Mean squared vertical second difference (grey, 0..1) of the mouth crops (side HF_SIDE face
    scales, HF_SIZE pixels) at the face-state track's mouth centre and scale (states [F, 10])."""
    total, count = 0.0, 0
    for i in range(0, len(frames), batch):
        x = to_canvas(frames[i:i + batch])
        s = torch.from_numpy(np.ascontiguousarray(states[i:i + len(x), :3], np.float32))
        g = grey(crop(x, s[:, 0], s[:, 1], HF_SIDE * s[:, 2], HF_SIZE))  # [n, 1, H, W]
        d2 = g[:, :, 2:] - 2 * g[:, :, 1:-1] + g[:, :, :-2]
        total += float(d2.square().mean((1, 2, 3)).sum())
        count += len(x)
    return total / count


# --- the terms, each usable alone ---------------------------------------------------------------

def sync_reward(ex: Experts, track: FaceTrack, audio: np.ndarray) -> float:
    """median_o d(o) − d(0): SyncNet confidence at offset 0 (negative when another offset fits better
    than the typical one does)."""
    d = sync_distances(ex, track.mouths, audio)
    return float(np.median(d) - d[VSHIFT])


def mouth_track_reward(states: np.ndarray, track: np.ndarray | None) -> float | None:
    """Pearson correlation of the generated opening with the renderer's over the common frames."""
    if track is None:
        return None
    n = min(len(states), len(track))
    a, b = states[:n, 7].astype(np.float64), np.asarray(track[:n], np.float64)
    if n < 2 or a.std() < 1e-8 or b.std() < 1e-8:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def identity_reward(track: FaceTrack, ref_emb: torch.Tensor) -> float | None:
    """FaceSim: trimmed mean cosine of the sampled frames' identity embeddings to the reference's."""
    return trimmed_mean((track.ident @ ref_emb).numpy())


CADENCE_FLOOR = 3.0  # a picture held still between latent steps reads in the hundreds: bounded


def cadence_reward(frames: np.ndarray) -> float | None:
    """−min(CADENCE_FLOOR, max(0, latent_cadence − 1)) of the frame-to-frame changes (None when
    too short to tell). Bounded so one frozen sample cannot swamp a group's normalisation."""
    c = latent_cadence(frame_changes(frames))
    return None if c is None else -min(CADENCE_FLOOR, max(0.0, c - 1.0))


def head_motion_reward(states: np.ndarray, ref_style: dict[str, float] | None) -> float | None:
    """−style_error of the generated track's style against the reference's (None without one)."""
    return None if ref_style is None else -style_error(style_stats(states), ref_style)


def mouth_hf_reward(hf_gen: float, hf_ref: float) -> float:
    """−max(0, log(hf_gen / hf_ref)): excess mouth high-frequency energy, 0 at or below the reference."""
    return -max(0.0, math.log((hf_gen + HF_EPS) / (hf_ref + HF_EPS)))


def silence_reward(states: np.ndarray, silent: np.ndarray) -> float | None:
    """Share of silent frames with the mouth read as closed (None without a silent frame)."""
    n = min(len(states), len(silent))
    s = silent[:n]
    if not s.any():
        return None
    return float(np.mean(states[:n, 7][s] < MOUTH_CLOSED))


def check_weights(weights: dict[str, float] | None) -> dict[str, float]:
    """DEFAULT_WEIGHTS with `weights` laid over them; unknown names or a negative / non-finite
    weight are a ConfigError."""
    out = dict(DEFAULT_WEIGHTS)
    for k, v in (weights or {}).items():
        if k not in TERMS:
            raise ConfigError(f"unknown reward term {k!r}; terms: {', '.join(TERMS)}")
        try:
            w = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"reward weight {k} must be a number, got {v!r}") from None
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"reward weight {k} must be a finite number >= 0, got {v!r}")
        out[k] = w
    return out


class RewardModel:
    """Scores renders of a Condition with the reward terms and their weighted total (module doc).

    weights: laid over DEFAULT_WEIGHTS (a term left out keeps its default; 0 switches it off the
    total, it is still reported); experts: the bundled evaluation experts by default."""

    def __init__(self, weights: dict[str, float] | None = None, experts: Experts | None = None) -> None:
        self.weights = check_weights(weights)
        self.ex = experts or load_experts()
        self._reads: OrderedDict[str, ConditionReads] = OrderedDict()

    @torch.no_grad()
    def reads(self, cond: Condition) -> ConditionReads:
        """The condition's reads, computed on first use and cached by cond.name."""
        if cond.name in self._reads:
            self._reads.move_to_end(cond.name)
            return self._reads[cond.name]
        ref = check_frames(cond.reference, "reference")
        ref_emb, ref_states = reference_embedding(self.ex, ref)
        ref_style = style_stats(ref_states) if len(ref) >= STYLE_MIN_FRAMES else None
        if cond.ground_truth is not None:
            gt = check_frames(cond.ground_truth, "ground_truth")
            hf_ref = mouth_hf_energy(gt, face_track(gt, self.ex, ident_idx=np.zeros(1, int)).states)
        else:
            hf_ref = mouth_hf_energy(ref, ref_states)
        r = ConditionReads(ref_emb, ref_states, ref_style, hf_ref)
        self._reads[cond.name] = r
        while len(self._reads) > CACHE_CONDITIONS:
            self._reads.popitem(last=False)
        return r

    @torch.no_grad()
    def terms(self, frames: np.ndarray, cond: Condition) -> dict[str, float | None]:
        """One value per term (TERMS order) of frames [F, S, S, 3] uint8 at 25 fps; higher = better."""
        frames = check_frames(frames)
        r = self.reads(cond)
        tr = face_track(frames, self.ex)
        audio = np.asarray(cond.audio, np.float32)
        return {"sync": sync_reward(self.ex, tr, audio),
                "mouth_track": mouth_track_reward(tr.states, cond.mouth_track),
                "identity": identity_reward(tr, r.ref_emb),
                "cadence": cadence_reward(frames),
                "head_motion": head_motion_reward(tr.states, r.ref_style),
                "mouth_hf": mouth_hf_reward(mouth_hf_energy(frames, tr.states), r.hf_ref),
                "silence": silence_reward(tr.states, r.silent_mask(audio, len(frames)))}

    def total(self, terms: dict[str, float | None]) -> float:
        """Σ weight · term over the terms that are not None."""
        return float(sum(self.weights[k] * v for k, v in terms.items() if v is not None))

    def __call__(self, frames: np.ndarray, cond: Condition) -> dict[str, float | None]:
        t = self.terms(frames, cond)
        return {**t, "total": self.total(t)}

    def batch(self, videos: list[np.ndarray], cond: Condition) -> list[dict[str, float | None]]:
        """Several renders of one condition (a GRPO group), scored against its reads computed once."""
        self.reads(cond)
        return [self(v, cond) for v in videos]
