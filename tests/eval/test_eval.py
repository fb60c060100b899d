"""The evaluation harness discriminates (issue 4, item 6 'Done when'), on held-out renders.

One held-out-identity clip (6 s) with a reference clip of the same identity in another scene, and
one other identity, are rendered once per module; the experts score pixels and audio only (the
annotations are read here, by the test, to check the face-state regressor against them).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from avatarstream.bench.inputs import write_wav
from avatarstream.cli import main
from avatarstream.data import Clip, DatasetConfig, clip_specs
from avatarstream.data.shards import write_video
from avatarstream.eval.experts import load_experts
from avatarstream.eval.metrics import (boundary_smoothness, face_track, latent_cadence, reference_embedding,
                                       seam_vs_cadence, silent_frames, sync_distances, sync_scores, trimmed_mean)
from avatarstream.eval.report import write_png

SPF = 640  # audio samples per video frame (16 kHz / 25 fps)
STABLE = ("sync_c", "sync_d", "offset_frames", "face_sim", "style_error", "silence_mouth_closed",
          "boundary_smoothness", "psnr", "fps", "ttff_s", "model", "split", "seed", "clips")


@pytest.fixture(scope="module")
def case():
    torch.set_num_threads(1)
    specs = clip_specs(DatasetConfig(identities=2, clips_per_identity=2, seconds=6.0, seed=11,
                                     split="heldout-identity"))
    target, ref = Clip(specs[0]), Clip(specs[1])
    other = Clip(specs[2])
    ex = load_experts()
    frames = target.frames()
    return {"ex": ex, "clip": target, "frames": frames, "track": face_track(frames, ex),
            "ref_frames": ref.frames(), "other_frames": other.frames()[:50]}


def test_ground_truth_in_sync_and_shift_detected(case):
    ex, tr, audio = case["ex"], case["track"], case["clip"].audio
    gt = sync_scores(sync_distances(ex, tr.mouths, audio))
    assert gt["offset_frames"] == 0
    assert gt["sync_c"] > 0.3, gt
    late = np.concatenate([np.zeros(int(0.4 * 16000), np.float32), audio])[:len(audio)]  # audio 0.4 s late
    sh = sync_scores(sync_distances(ex, tr.mouths, late))
    assert abs(sh["offset_frames"] - (-10)) <= 1, sh  # syncnet_python sign: late audio -> negative
    assert sh["sync_c"] < gt["sync_c"], (gt, sh)
    assert sh["sync_d"] > gt["sync_d"] + 0.01, (gt, sh)  # the best alignment is worse: frames pushed out


def test_static_frame_scores_clearly_worse_on_sync(case):
    ex, tr, audio = case["ex"], case["track"], case["clip"].audio
    gt = sync_scores(sync_distances(ex, tr.mouths, audio))
    still = np.repeat(case["frames"][:1], len(case["frames"]), 0)
    st = sync_scores(sync_distances(ex, face_track(still, ex).mouths, audio))
    assert st["sync_c"] < 0.35 * gt["sync_c"], (gt, st)  # a still mouth gives a flat distance curve


def test_other_identity_scores_clearly_worse_on_face_sim(case):
    ex, tr = case["ex"], case["track"]
    ref_emb, _ = reference_embedding(ex, case["ref_frames"])
    same = trimmed_mean((tr.ident @ ref_emb).numpy())
    other = trimmed_mean((face_track(case["other_frames"], ex).ident @ ref_emb).numpy())
    assert same > 0.7, same
    assert same - other > 0.3, (same, other)


def test_mouth_opening_track_matches_renderer(case):
    pred = case["track"].states[:, 7]
    truth = np.asarray(case["clip"].annotations["per_frame"]["mouth_open"])
    assert np.corrcoef(pred, truth)[0, 1] >= 0.9


def test_silence_and_metric_helpers(case):
    clip, tr = case["clip"], case["track"]
    silent = silent_frames(clip.audio, len(case["frames"]))
    assert silent.any()
    # the regressor reads closed / open in silence as the renderer drew it (the generator blends
    # neighbouring visemes across short pauses between sentences, so not every silent frame is shut)
    truth = np.asarray(clip.annotations["per_frame"]["mouth_open"])[silent] < 0.15
    assert np.mean((tr.states[silent, 7] < 0.15) == truth) >= 0.9
    assert trimmed_mean([0, 1, 1, 1, 1, 1, 1, 1, 1, 100]) == 1.0
    assert boundary_smoothness(np.array([0, 1, 1, 1, 5, 1, 1, 1.0]), [0, 4]) == pytest.approx(5.001 / 1.001)
    # a picture that steps once a latent (4 frames) and holds between: cadence 4 / 1; the chunk
    # seam (frame 9) no jumpier than the other latent starts (5, 13): seam_vs_cadence 1
    steps = np.array([0, 1, 1, 1, 1, 4, 1, 1, 1, 4, 1, 1, 1, 4, 1, 1, 1.0])
    assert latent_cadence(steps) == pytest.approx(4.001 / 1.001)
    assert seam_vs_cadence(steps, [0, 9]) == pytest.approx(1.0)
    steps[9] = 8.0  # a seam twice the cadence's step
    assert seam_vs_cadence(steps, [0, 9]) == pytest.approx(8.001 / 4.001)
    assert latent_cadence(np.ones(20)) == pytest.approx(1.0)  # smooth motion: no cadence
    # a window starting at stream frame 2 (a later drift window): latent starts at window frames 3, 7, ...
    assert latent_cadence(steps[2:], first=2) == pytest.approx(latent_cadence(steps[:15]))
    assert latent_cadence(steps[2:]) == pytest.approx(1.0, abs=0.01)  # read at the wrong places: no cadence seen
    d = np.full(31, 2.0)
    d[12] = 1.0  # best audio window at o = -3
    assert sync_scores(d) == {"sync_c": 1.0, "sync_d": 1.0, "offset_frames": 3}


def test_eval_video_cli_on_ground_truth(case, tmp_path, capsys):
    clip = case["clip"]
    n = 75  # 3 s keeps the CLI run short
    gt = tmp_path / "gt.mkv"
    write_video(gt, iter(case["frames"][:n]), 256)
    wav = write_wav(tmp_path / "a.wav", clip.audio[:n * SPF])
    ref = tmp_path / "ref.png"
    write_png(ref, case["ref_frames"][0])
    rc = main(["eval", str(gt), "--reference", str(ref), "--audio", str(wav), "--ground-truth", str(gt),
               "--chunk-frames", "25", "--out", str(tmp_path / "rep"), "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(STABLE) <= set(r)
    assert r["psnr"] == 100.0 and r["offset_frames"] == 0 and r["mouth_open_corr_gt"] > 0.999
    assert r["style_error"] is None  # an image reference has no talking style
    assert (tmp_path / "rep" / "report.md").exists() and (tmp_path / "rep" / "video_sync.png").exists()


def test_eval_user_mistakes_are_one_line_errors(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "missing.mp4"), "--reference", "x.png"]) != 0
    assert main(["eval", "benchmark", "--model", "tiny-random", "--split", "heldout-voice",
                 "--reference", "x.png"]) != 0
    assert main(["eval", "benchmark", "--model", "no-such-model", "--split", "heldout-voice"]) != 0
    assert main(["eval", "benchmark", "--model", "ground-truth", "--split", "heldout-voice",
                 "--strategy", "causal"]) != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert len(err) == 4 and all(ln.startswith("avatarstream: error: ") for ln in err)


def test_benchmark_tiny_random_end_to_end(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "bench"
    rc = main(["eval", "benchmark", "--model", "tiny-random", "--split", "heldout-voice", "--clips", "1",
               "--seconds", "2", "--strategy", "causal", "--out", str(out), "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(STABLE) <= set(r)
    assert r["model"] == "tiny-random" and r["clips"] == 1 and r["fps"] > 0 and r["ttff_s"] > 0
    assert r["strategy"] == "causal"  # the model's own is prefix
    assert json.loads((out / "report.json").read_text())["model"] == "tiny-random"
    assert (out / "report.md").exists() and (out / "case0_mouth.png").read_bytes()[:4] == b"\x89PNG"


def test_vae_roundtrip_baseline_is_the_vae_of_the_named_model(tmp_path, capsys):
    """`vae-roundtrip:NAME` scores the ground truth through NAME's VAE: an image of the right size
    and length that differs from the ground truth (a random tiny VAE loses most of it)."""
    import numpy as np

    from avatarstream.eval.benchmark import Bench, load_subject, run_model

    torch.set_num_threads(1)
    models = load_subject("vae-roundtrip:tiny-random")
    bench = Bench("heldout-voice", seconds=1.0, clips=1, seed=0)
    case = bench.cases[0]
    gen = run_model("vae-roundtrip:tiny-random", models, case)
    assert gen.frames.shape == case.gt.shape[:1] + (64, 64, 3) and gen.frames.dtype == np.uint8
    rc = main(["eval", "benchmark", "--model", "vae-roundtrip:tiny-random", "--split", "heldout-voice",
               "--clips", "1", "--seconds", "1", "--out", str(tmp_path / "rt"), "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["model"] == "vae-roundtrip:tiny-random" and r["fps"] is None and r["psnr"] < 40
    assert main(["eval", "benchmark", "--model", "vae-roundtrip:no-such", "--split", "heldout-voice"]) != 0
    # --latent-noise: the decode moves away from the noise-free one with the noise's size, and the
    # same seed draws the same noise; it applies to the round-trip baseline only
    off = lambda a, seed=0: float(np.abs(run_model("vae-roundtrip:tiny-random", models, case, latent_noise=a,
                                                   seed=seed).frames.astype(np.float32) - gen.frames).mean())
    assert off(0.0) == 0.0 and 0 < off(0.1) < off(1.0)
    assert off(0.5) == off(0.5) and off(0.5, seed=1) != off(0.5)
    assert main(["eval", "benchmark", "--model", "tiny-random", "--split", "heldout-voice",
                 "--latent-noise", "0.3"]) != 0
    assert "--latent-noise applies to the vae-roundtrip" in capsys.readouterr().err



def test_showcase_writes_a_contact_sheet_and_gif_named_after_the_model_folder(tmp_path, capsys):
    """`eval showcase` on a weights folder given as a path (how a candidate is evaluated before it
    is bundled): the files take the folder's name, the sheet holds 3 rows (generated, ground truth,
    reference) of 4 moments, and the GIF moves."""
    import shutil

    from PIL import Image

    from avatarstream.registry import BUNDLED, WEIGHTS_DIR

    torch.set_num_threads(2)
    cand = tmp_path / "cand"
    shutil.copytree(WEIGHTS_DIR / BUNDLED, cand, ignore=shutil.ignore_patterns("card", "training", "*.md"))
    out = tmp_path / "sheets"
    assert main(["eval", "showcase", "--model", str(cand), "--seconds", "4", "--out", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["contact_sheet"] == str(out / "showcase_cand.png") and r["gif"] == str(out / "showcase_cand.gif")
    assert len(r["frames"]) == 4 and r["open_frames"] and r["closed_frames"]
    sheet = Image.open(out / "showcase_cand.png")
    assert sheet.height > 2.5 * sheet.width / 4  # three rows of square-ish panels, four columns
    gif = Image.open(out / "showcase_cand.gif")
    assert gif.n_frames == r["gif_frames"] > 10
    first = np.asarray(gif.convert("RGB"))
    gif.seek(gif.n_frames // 2)
    assert np.abs(np.asarray(gif.convert("RGB")).astype(int) - first).mean() > 0.5


def test_mouth_track_r_follows_the_renderer_and_not_a_still_mouth(case):
    """`mouth_track_r` (benchmark): the ground truth's read opening against the renderer's exact one
    is near 1, a static frame's has no correlation (None), a wrong track (another clip's) is low."""
    from avatarstream.eval.benchmark import mouth_track_r

    truth = np.array([s.open for s in case["clip"].states])
    assert mouth_track_r(case["track"].states[:, 7], truth) > 0.95
    still = face_track(np.repeat(case["frames"][:1], 40, 0), case["ex"]).states[:, 7]
    assert mouth_track_r(still, truth) is None
    assert abs(mouth_track_r(case["track"].states[::-1, 7], truth)) < 0.4  # the same mouth, time reversed (0.24)
