"""Evaluation-only expert sets: the independent sync / identity experts were trained on draws that
share nothing with the bundled experts' (which a training reward may use), and load by name.

Also the benchmark's `mouth_track_r` end to end through the CLI (the unit checks of the metric on a
6 s clip are in test_eval.py).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from avatarstream.cli import main
from avatarstream.data import identity_seeds
from avatarstream.errors import ConfigError
from avatarstream.eval.experts import ASSET_DIR, INDEPENDENT_DIR, load_experts
from avatarstream.eval.train_experts import (MASTER, disjointness, draw_identities, recipe_draws,
                                             recipe_exclusion)

INDEPENDENT = {"base": 5151, "seed": 1}  # the recipe of assets/experts-independent (its README)


def test_independent_recipe_shares_no_identity_or_clip_with_the_bundled_one():
    bundled = recipe_draws(MASTER, 0)
    excl = recipe_exclusion(MASTER, 0)
    assert len(excl) == 700 + 1500 + 110  # the bundled pools: every identity once
    indep = recipe_draws(INDEPENDENT["base"], INDEPENDENT["seed"], excl)
    assert [len(indep[k]) for k in ("face_state", "identity", "sync")] == [700, 1500, 110]
    assert disjointness(indep, bundled) == {"identities": 0, "sync_clip_seeds": 0, "sync_scenes": 0}
    assert not (set(indep["identity"]) | set(indep["sync"])) & excl
    # the check can fail: a recipe against itself overlaps everywhere
    assert disjointness(bundled, bundled) == {"identities": 2310, "sync_clip_seeds": 110, "sync_scenes": 110}


def test_draws_skip_excluded_identities_in_order():
    first = identity_seeds(77, 8)
    assert draw_identities(77, 8) == first  # no exclusion: the plain draw (the bundled pools)
    excl = frozenset({first[0], first[3]})
    got = draw_identities(77, 8, excl)
    assert len(got) == 8 and not set(got) & excl
    assert got[:6] == [s for s in first if s not in excl]  # the same stream, collisions filtered out
    assert got[6:] == identity_seeds(77, 10)[8:]


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_independent_set_loads_by_name_with_the_bundled_face_state(tmp_path):
    assert (INDEPENDENT_DIR / "sync.safetensors").exists() and (INDEPENDENT_DIR / "identity.safetensors").exists()
    assert not (INDEPENDENT_DIR / "face_state.safetensors").exists()  # shared: it only places crops
    bundled, indep = load_experts(None), load_experts("independent")
    assert load_experts("bundled") is bundled and load_experts(ASSET_DIR) is bundled
    assert _same(indep.face, bundled.face)
    assert not _same(indep.sync, bundled.sync) and not _same(indep.identity, bundled.identity)
    # a folder path keeps working, and a folder without face_state takes the bundled one
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in ("sync", "identity"):
        shutil.copy(INDEPENDENT_DIR / f"{name}.safetensors", folder)
    mine = load_experts(str(folder))
    assert _same(mine.sync, indep.sync) and _same(mine.face, bundled.face)
    half = tmp_path / "half"  # (loaded sets are cached by folder: a new one)
    half.mkdir()
    shutil.copy(INDEPENDENT_DIR / "identity.safetensors", half)
    with pytest.raises(ConfigError, match="sync.safetensors"):
        load_experts(half)
    with pytest.raises(ConfigError, match="expert folder not found"):
        load_experts(tmp_path / "missing")


def test_independent_experts_score_pixels_like_the_bundled_ones():
    """Ground truth in sync at offset 0 and a still mouth far less sure, by the independent SyncNet."""
    from avatarstream.eval.benchmark import Bench
    from avatarstream.eval.metrics import face_track, sync_distances, sync_scores

    torch.set_num_threads(1)
    ex = load_experts("independent")
    case = Bench("heldout-identity", seconds=4.0, clips=1, seed=11, experts=ex).cases[0]
    gt = sync_scores(sync_distances(ex, face_track(case.gt, ex).mouths, case.clip.audio))
    still = np.repeat(case.gt[:1], len(case.gt), 0)
    st = sync_scores(sync_distances(ex, face_track(still, ex).mouths, case.clip.audio))
    assert gt["offset_frames"] == 0 and st["sync_c"] < 0.35 * gt["sync_c"], (gt, st)


def test_benchmark_reports_mouth_track_r_and_takes_the_independent_set(tmp_path, capsys):
    torch.set_num_threads(1)
    rc = main(["eval", "benchmark", "--model", "ground-truth", "--split", "heldout-identity", "--clips", "1",
               "--seconds", "3", "--experts", "independent", "--out", str(tmp_path / "b"), "--no-plots", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["mouth_track_r"] > 0.9 and r["cases"][0]["metrics"]["mouth_track_r"] == r["mouth_track_r"]
    assert json.loads((tmp_path / "b" / "report.json").read_text())["mouth_track_r"] == r["mouth_track_r"]
    assert main(["eval", "benchmark", "--model", "ground-truth", "--split", "heldout-identity",
                 "--experts", str(tmp_path / "nowhere")]) != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert len(err) == 1 and err[0].startswith("avatarstream: error: expert folder not found")
