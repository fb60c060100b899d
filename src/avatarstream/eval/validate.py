"""Validation of the experts on held-out identities and voices (numbers for the model card)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from avatarstream.data import AvatarRenderer, Clip, DatasetConfig, Identity, Scene, clip_specs, identity_seeds
from avatarstream.eval.experts import load_experts
from avatarstream.eval.metrics import face_track, sync_distances, sync_scores
from avatarstream.eval.face_states import random_state

SPF = 640  # audio samples per video frame


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


@torch.inference_mode()
def validate_experts(folder: str | Path | None = None, clips: int = 3, seconds: float = 8.0, ids: int = 40,
                     seed: int = 99) -> dict[str, Any]:
    """face_state on held-out-identity clips (correlation / error against the renderer's tracks),
    sync on held-out-voice clips (offset found for aligned audio and audio delayed by 10 frames),
    identity retrieval across scenes on `ids` held-out identities."""
    ex = load_experts(folder)
    out: dict[str, Any] = {}
    fs: dict[str, list[float]] = {k: [] for k in ("open_corr", "blink_corr", "mouth_xy_err_px", "yaw_mae",
                                                    "pitch_mae", "roll_mae")}
    for spec in clip_specs(DatasetConfig(identities=clips, clips_per_identity=1, seconds=seconds, seed=seed,
                                         split="heldout-identity")):
        c = Clip(spec)
        pf = c.annotations["per_frame"]
        tr = face_track(c.frames(), ex)
        s = tr.states
        fs["open_corr"].append(_corr(s[:, 7], np.array(pf["mouth_open"])))
        fs["blink_corr"].append(_corr(s[:, 6], np.array(pf["blink"])))
        fs["mouth_xy_err_px"].append(float(np.hypot(s[:, 0] - pf["mouth_x"], s[:, 1] - pf["mouth_y"]).mean()))
        for j, k in ((3, "yaw"), (4, "pitch"), (5, "roll")):
            fs[f"{k}_mae"].append(float(np.abs(s[:, j] - np.array(pf[k])).mean()))
    out["face_state"] = {k: round(float(np.mean(v)), 4) for k, v in fs.items()}
    sy: dict[str, list[float]] = {"sync_c": [], "sync_d": [], "offset_ok": [], "shifted_offset_ok": [],
                                  "shifted_sync_c": []}
    for spec in clip_specs(DatasetConfig(identities=clips, clips_per_identity=1, seconds=seconds, seed=seed,
                                         split="heldout-voice")):
        c = Clip(spec)
        tr = face_track(c.frames(), ex)
        r = sync_scores(sync_distances(ex, tr.mouths, c.audio))
        late = np.concatenate([np.zeros(10 * SPF, np.float32), c.audio])[:len(c.audio)]
        r2 = sync_scores(sync_distances(ex, tr.mouths, late))
        sy["sync_c"].append(r["sync_c"])
        sy["sync_d"].append(r["sync_d"])
        sy["offset_ok"].append(float(r["offset_frames"] == 0))
        sy["shifted_offset_ok"].append(float(abs(r2["offset_frames"] + 10) <= 1))
        sy["shifted_sync_c"].append(r2["sync_c"])
    out["sync"] = {k: round(float(np.mean(v)), 4) for k, v in sy.items()}
    rng = np.random.default_rng(seed)
    views = []
    for ident in identity_seeds(seed, ids, "heldout-identity"):
        idn = Identity.from_seed(ident)
        vs = []
        for _ in range(2):
            r = AvatarRenderer(idn, Scene.from_seed(int(rng.integers(1 << 30))))
            st = random_state(rng)
            vs.append(r.render(st))
        views.append(vs)
    a = np.stack([v[0] for v in views])
    b = np.stack([v[1] for v in views])
    ea, eb = face_track(a, ex, ident_idx=np.arange(ids)).ident, face_track(b, ex, ident_idx=np.arange(ids)).ident
    sim = (ea @ eb.T).numpy()
    pos = np.diag(sim)
    neg = sim[~np.eye(ids, dtype=bool)]
    out["identity"] = {"cross_scene_top1": round(float(np.mean(sim.argmax(1) == np.arange(ids))), 4),
                       "pos_cos": round(float(pos.mean()), 4), "neg_cos": round(float(neg.mean()), 4),
                       "identities": ids}
    return out
