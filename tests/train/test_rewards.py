"""Reward terms of the feedback-alignment stage rank a right video above a wrong one.

One held-out-identity case (3 s: the ground-truth render of a clip, a reference clip of the same
person in another scene, the same states rendered on another person) is rendered once per module;
the "wrong" videos are edits of the ground truth that break one thing each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from avatarstream.errors import ConfigError, InputError
from avatarstream.eval.benchmark import make_cases
from avatarstream.eval.metrics import face_track, silent_frames, sync_distances, sync_scores
from avatarstream.train.rewards import DEFAULT_WEIGHTS, TERMS, Condition, RewardModel, mouth_hf_energy


@pytest.fixture(scope="module")
def case():
    torch.set_num_threads(1)
    c = make_cases("heldout-identity", seconds=3.0, clips=1, seed=3)[0]
    pf = c.clip.annotations["per_frame"]
    track = np.asarray(pf["mouth_open"], np.float32)
    cond = Condition(c.name, c.reference, c.clip.audio, track, c.gt)
    rm = RewardModel()
    return {"gt": c.gt, "ref": c.reference, "wrong": c.wrong_identity_frames(), "audio": c.clip.audio,
            "track": track, "mx": np.asarray(pf["mouth_x"]), "my": np.asarray(pf["mouth_y"]), "cond": cond,
            "rm": rm, "gt_terms": rm(c.gt, cond)}


def still(case) -> np.ndarray:
    return np.repeat(case["gt"][:1], len(case["gt"]), 0)


def streaked(case, amp: int = 40) -> np.ndarray:
    """The ground truth with 4 one-pixel horizontal streaks (alternately dark and light) across the
    mouth of every frame where it is open: the decoder's artefact."""
    v = case["gt"].astype(np.int16)
    for i in np.flatnonzero(case["track"] > 0.2):
        x0, y0 = int(round(case["mx"][i])), int(round(case["my"][i]))
        for k, dy in enumerate((-4, -1, 2, 5)):
            v[i, y0 + dy, x0 - 14:x0 + 15] += amp if k % 2 else -amp
    return v.clip(0, 255).astype(np.uint8)


def test_ground_truth_scores_well_on_every_term(case):
    t = case["gt_terms"]
    assert set(t) == set(TERMS) | {"total"}
    assert t["sync"] > 0.15 and t["mouth_track"] > 0.9 and t["identity"] > 0.9, t
    assert t["cadence"] == 0.0 and t["mouth_hf"] == 0.0 and t["silence"] == 1.0, t  # its own hf level
    assert -0.5 < t["head_motion"] <= 0.0, t


def test_sync_rewards_offset_zero_not_the_best_offset(case):
    rm, gt, cond = case["rm"], case["gt"], case["cond"]
    lag = np.concatenate([np.repeat(gt[:1], 10, 0), gt[:-10]])  # the video 10 frames behind its audio
    s_lag, s_still = rm(lag, cond)["sync"], rm(still(case), cond)["sync"]
    assert case["gt_terms"]["sync"] > max(s_lag, s_still) + 0.1, (case["gt_terms"]["sync"], s_lag, s_still)
    # Sync-C (median - min) still finds the lagging lips at their own offset: it would reward them
    lag_c = sync_scores(sync_distances(rm.ex, face_track(lag, rm.ex).mouths, case["audio"]))
    assert lag_c["offset_frames"] != 0 and lag_c["sync_c"] > s_lag + 0.1, (lag_c, s_lag)


def test_mouth_track_correlation(case):
    rm, gt, cond = case["rm"], case["gt"], case["cond"]
    assert rm(gt[::-1].copy(), cond)["mouth_track"] < case["gt_terms"]["mouth_track"] - 0.5
    assert rm(gt[:-4], cond)["mouth_track"] > 0.9  # a render a few frames short: scored on the overlap
    assert rm(still(case), cond)["mouth_track"] is None  # a constant opening has no correlation
    real = Condition("no-track", case["ref"], case["audio"])
    assert rm.terms(gt, real)["mouth_track"] is None


def test_identity_other_person_scores_lower(case):
    wrong = case["rm"](case["wrong"], case["cond"])
    assert case["gt_terms"]["identity"] > wrong["identity"] + 0.5, wrong
    assert wrong["sync"] > 0.15  # the same mouth on the other face: the identity term tells them apart


def test_mouth_hf_penalises_horizontal_streaks(case):
    rm, cond = case["rm"], case["cond"]
    hf = rm(streaked(case), cond)["mouth_hf"]
    assert hf < -0.5, hf
    assert rm(streaked(case, 80), cond)["mouth_hf"] < hf - 0.3  # stronger streaks, stronger penalty
    # without a ground truth the reference video sets the level
    no_gt = Condition("no-gt", case["ref"], case["audio"], case["track"])
    ref_states = face_track(case["ref"], rm.ex).states
    assert rm.reads(no_gt).hf_ref == pytest.approx(mouth_hf_energy(case["ref"], ref_states), rel=1e-5)
    assert rm(streaked(case, 80), no_gt)["mouth_hf"] < rm(case["gt"], no_gt)["mouth_hf"] - 0.3


def test_silence_mouth_held_open_scores_lower(case):
    rm, gt, cond = case["rm"], case["gt"], case["cond"]
    silent = silent_frames(case["audio"], len(gt))
    assert silent.sum() >= 5
    opened = gt.copy()
    opened[silent] = gt[int(np.argmax(case["track"]))]  # the widest-open frame wherever it is silent
    assert rm(opened, cond)["silence"] < 0.3
    noise = np.random.default_rng(0).normal(0, 0.1, len(case["audio"])).astype(np.float32)
    assert rm.terms(gt, Condition("all-speech", case["ref"], noise))["silence"] is None


def test_cadence_four_frame_beat_scores_lower(case):
    gt = case["gt"]
    hold = np.array([0] + [1 + 4 * ((i - 1) // 4) for i in range(1, len(gt))])  # steps at 4k + 1, holds between
    assert case["rm"](gt[hold], case["cond"])["cadence"] < -1.0


def test_head_motion_still_frame_scores_lower_and_needs_a_2s_reference(case):
    rm = case["rm"]
    assert case["gt_terms"]["head_motion"] > rm(still(case), case["cond"])["head_motion"] + 0.5
    one = Condition("one-frame", case["ref"][:1], case["audio"], case["track"], case["gt"])
    assert rm.terms(case["gt"], one)["head_motion"] is None


def test_total_is_the_weighted_sum_and_unknown_weights_are_config_errors(case):
    rm = RewardModel({"sync": 2.0, "identity": 0.0}, experts=case["rm"].ex)
    assert rm.weights == {**DEFAULT_WEIGHTS, "sync": 2.0, "identity": 0.0}
    r = rm(case["gt"], case["cond"])
    assert r["identity"] == case["gt_terms"]["identity"]  # a 0-weight term is still reported
    want = sum(rm.weights[k] * r[k] for k in TERMS if r[k] is not None)
    assert r["total"] == pytest.approx(want, rel=1e-9)
    assert r["total"] == pytest.approx(case["gt_terms"]["total"] - 3.0 * r["sync"] - r["identity"], rel=1e-6)
    assert max(DEFAULT_WEIGHTS, key=DEFAULT_WEIGHTS.get) == "sync"
    with pytest.raises(ConfigError, match="unknown reward term 'lipsync'"):
        RewardModel({"lipsync": 1.0}, experts=rm.ex)
    with pytest.raises(ConfigError, match=">= 0"):
        RewardModel({"sync": -1.0}, experts=rm.ex)
    with pytest.raises(InputError, match="uint8"):
        rm(case["gt"].astype(np.float32), case["cond"])


def test_batch_equals_one_by_one_and_reads_once(case):
    rm = RewardModel(experts=case["rm"].ex)
    gt, cond = case["gt"], case["cond"]
    videos = [gt, still(case), gt[::-1].copy()]
    got = rm.batch(videos, cond)
    assert len(rm._reads) == 1 and rm.reads(cond) is rm.reads(cond)
    assert got == [rm(v, cond) for v in videos]
    assert got[0] == case["gt_terms"]
