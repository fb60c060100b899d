"""Conditions for feedback alignment: synthetic train-split cases (`avatarstream.data`).

A condition is one person's reference clip (another scene than the speech's, the cross-scene
setup of the benchmark) and a few seconds of speech, with what the renderer knows for that
speech: the exact mouth opening per frame and the ground-truth render. Identities, voices, scenes
and sentences come from the train split only (`clip_specs`, split="train"), so the held-out
identities and voices the model card reports stay unseen.
"""

from __future__ import annotations

import numpy as np

from avatarstream.data import Clip, DatasetConfig, clip_specs
from avatarstream.train.rewards import Condition

REFERENCE_SECONDS = 2.4  # 60 frames: head-motion statistics need >= 2 s of reference


def synthetic_conditions(n: int, *, seconds: float, seed: int, size: int = 256,
                         split: str = "train") -> list[Condition]:
    """`n` conditions of `split` (seed draws identities, voices, scenes, sentences)."""
    specs = clip_specs(DatasetConfig(identities=n, clips_per_identity=2, seconds=max(seconds, REFERENCE_SECONDS),
                                     seed=seed, split=split, size=size))
    out = []
    for i in range(n):
        target, ref_spec = specs[2 * i], specs[2 * i + 1]
        clip, ref = Clip(target), Clip(ref_spec)
        frames = int(round(seconds * 25))
        audio = clip.audio[: int(round(seconds * 16000))].astype(np.float32)
        out.append(Condition(name=f"{split}-s{seed}-{i}", reference=ref.frames()[: int(REFERENCE_SECONDS * 25)],
                             audio=audio, mouth_track=np.asarray(clip.mouth.open[:frames], np.float32),
                             ground_truth=clip.frames()[:frames]))
    return out
