"""Synthetic talking-head data (avatarstream.data): determinism, identities, splits, visemes,
rendered mouth vs annotation, shards, and `avatarstream synth` end to end."""

from __future__ import annotations

import json

import av
import numpy as np
import pytest

from avatarstream.data import (Clip, ClipSpec, DatasetConfig, FaceState, ShardReader, ShardWriter, clip_specs,
                               identity_seeds, is_heldout_identity, render_reference, voices_for)
from avatarstream.data.features import MOUTH_INTERIOR
from avatarstream.media.speech import SpeechSynthesizer, voice_by_id
from avatarstream.data.visemes import VISEMES, mouth_track, viseme_of
from avatarstream.errors import InputError
from conftest import run_cli

SYNTH = SpeechSynthesizer()


def test_same_spec_same_frames_and_annotation_bytes():
    spec = ClipSpec(identity=11, scene=22, voice="espeak:de+m2", seed=33, seconds=1.2, size=96)
    a, b = Clip(spec, SYNTH), Clip(spec, SYNTH)
    assert a.annotations_json() == b.annotations_json()
    assert np.array_equal(a.frames(), b.frames())
    assert np.array_equal(a.audio, b.audio)


def test_different_seeds_are_different_people():
    refs = [render_reference(s, scene=5, size=96)[0].astype(np.int16) for s in (1, 2, 3)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert np.abs(refs[i] - refs[j]).mean() > 8.0  # same scene: only the person differs
    # the same identity in two scenes: a cross-scene pair, still the same face parameters
    assert not np.array_equal(render_reference(1, 5, 96), render_reference(1, 6, 96))


def test_reference_clip_shape_and_idle_motion():
    clip = render_reference(4, 9, size=64, frames=30)
    assert clip.shape == (30, 64, 64, 3) and clip.dtype == np.uint8
    assert np.abs(clip[0].astype(int) - clip[-1]).max() > 0  # it sways / blinks


def test_heldout_identities_never_in_train():
    for master in range(300):
        assert not any(is_heldout_identity(s) for s in identity_seeds(master, 4, "train"))
    held = identity_seeds(7, 5, "heldout-identity")
    assert all(is_heldout_identity(s) for s in held)
    # the reserved part is about a tenth of the space
    frac = np.mean([is_heldout_identity(s) for s in range(5000)])
    assert 0.07 < frac < 0.13


def test_heldout_voices_never_in_train():
    train = voices_for("train")
    assert train and not any(v.heldout for v in train)
    assert all(v.heldout for v in voices_for("heldout-voice"))
    assert {v.language for v in voices_for("heldout-voice")} >= {"pt", "nl"}
    assert not {"pt", "nl"} & {v.language for v in train}
    for master in range(40):
        for spec in clip_specs(DatasetConfig(identities=3, clips_per_identity=3, seconds=1, seed=master)):
            assert not voice_by_id(spec.voice).heldout
            assert not is_heldout_identity(spec.identity)
    with pytest.raises(InputError):
        voices_for("train", "flite:rms")


@pytest.mark.parametrize("voice", ["flite:slt", "espeak:fr+m1"])
def test_mouth_open_in_vowels_closed_in_silence(voice):
    u = SYNTH.speak("The farmer sold potatoes at the market." if "flite" in voice else
                    "Nous avons mangé une soupe délicieuse.", voice_by_id(voice))
    lead = 1.0
    phones = [type(p)(p.start + lead, p.end + lead, p.symbol, p.engine) for p in u.phones]
    frames = int((phones[-1].end + 1.0) * 25)
    m = mouth_track(phones, frames, 25, sharpness=0.5, amplitude=1.0)
    vowel_frames = [int((p.start + p.end) / 2 * 25) for p in phones
                    if VISEMES[viseme_of(p)].vowel and p.end - p.start >= 0.06]
    assert len(vowel_frames) >= 4
    assert m.open[vowel_frames].mean() > 0.3
    speech = [p for p in phones if viseme_of(p) != 0]
    t = (np.arange(frames) + 0.5) / 25
    far = np.array([min(abs(x - p.start) for p in speech) >= 0.2 and min(abs(x - p.end) for p in speech) >= 0.2
                    and not any(p.start <= x <= p.end for p in speech) for x in t])
    assert far.sum() >= 20  # the lead-in and the tail
    assert m.open[far].max() < 0.02
    assert not m.speaking[far].any()


def _dark_mouth_pixels(frame: np.ndarray, x: float, y: float) -> int:
    """Pixels of mouth-interior colour in a box around the annotated mouth centre (below the nose)."""
    S = frame.shape[0]
    w, up, down = int(0.1 * S), int(0.035 * S), int(0.07 * S)
    crop = frame[max(0, int(y) - up):int(y) + down, max(0, int(x) - w):int(x) + w].astype(np.int16)
    return int((np.abs(crop - MOUTH_INTERIOR.astype(np.int16)).max(-1) < 28).sum())


@pytest.mark.parametrize("identity", [3, 8])
def test_rendered_mouth_follows_opening_annotation(identity):
    clip = Clip(ClipSpec(identity=identity, scene=identity + 1, voice="espeak:en-us+m1", seed=5, seconds=3.0,
                         size=256), SYNTH)
    pf = clip.annotations["per_frame"]
    counts = [_dark_mouth_pixels(f, x, y) for f, x, y in zip(clip.iter_frames(), pf["mouth_x"], pf["mouth_y"])]
    opening = np.asarray(pf["mouth_open"])
    assert opening.max() > 0.3
    assert np.corrcoef(counts, opening)[0, 1] >= 0.9


def test_face_state_moves_pixels():
    from avatarstream.data import AvatarRenderer, Identity, Scene

    r = AvatarRenderer(Identity.from_seed(2), Scene.from_seed(3), 96)
    base = r.render(FaceState()).astype(int)
    for st in (FaceState(blink=1.0), FaceState(yaw=5.0), FaceState(roll=3.0), FaceState(open=0.8, teeth=1.0)):
        assert np.abs(r.render(st).astype(int) - base).sum() > 500, st


def test_shard_writer_reader_round_trip(tmp_path):
    specs = [ClipSpec(identity=s, scene=s, voice=v, seed=s, seconds=0.6, size=64)
             for s, v in ((1, "flite:kal16"), (2, "espeak:it+m2"), (3, "espeak:es+m3"))]
    clips = [Clip(s, SYNTH) for s in specs]
    with ShardWriter(tmp_path / "ds", shard_size=2) as w:
        for c in clips:
            w.write(c)
    reader = ShardReader(tmp_path / "ds")
    assert len(reader) == 3
    assert sorted({e["shard"] for e in reader.entries()}) == ["shard-00000", "shard-00001"]
    for c, rec in zip(clips, reader):
        assert rec.frames.shape == (15, 64, 64, 3)
        assert np.array_equal(rec.frames, c.frames())  # lossless video
        assert rec.sample_rate == 16000 and rec.audio.dtype == np.float32
        assert np.abs(rec.audio - c.audio).max() <= 1.5 / 32768
        assert rec.annotations["text"] == c.annotations["text"]
        np.testing.assert_allclose(rec.annotations["per_frame"]["mouth_open"], c.annotations["per_frame"]["mouth_open"])
    with pytest.raises(InputError):
        ShardReader(tmp_path)


def test_cli_synth_end_to_end(tmp_path):
    out = tmp_path / "synth"
    r = run_cli("synth", "--out", str(out), "--identities", "2", "--clips-per-identity", "1", "--seconds", "2",
                "--seed", "3", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["clips"] == 2 and summary["seconds"] == 4.0
    for key in ("wall_s", "x_realtime", "out"):
        assert key in summary
    index = json.loads((out / "index.json").read_text())
    assert len(index["clips"]) == 2
    for e in index["clips"]:
        assert not voice_by_id(e["voice"]).heldout and not is_heldout_identity(e["identity"])
        with av.open(str(out / e["shard"] / f"{e['key']}.mkv")) as c:
            frames = [f for f in c.decode(c.streams.video[0])]
        assert abs(len(frames) - 50) <= 1 and frames[0].width == 256
        with av.open(str(out / e["shard"] / f"{e['key']}.wav")) as c:
            a = c.streams.audio[0]
            n = sum(f.samples for f in c.decode(a))
            assert a.rate == 16000 and a.channels == 1 and abs(n - 32000) <= 1


def test_cli_synth_user_errors(tmp_path):
    r = run_cli("synth", "--out", str(tmp_path / "x"), "--voice", "flite:rms", "--split", "train")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "held out" in r.stderr
    r = run_cli("synth", "--out", str(tmp_path / "y"), "--voice", "nope:x")
    assert r.returncode == 2 and "unknown voice" in r.stderr


def test_render_many_equals_render_frame_by_frame():
    """The batched path (warp lattice over 8-frame chunks) is an optimisation: same bytes as one at a time."""
    from avatarstream.data import AvatarRenderer, Identity, Scene

    r = AvatarRenderer(Identity.from_seed(7), Scene.from_seed(8), 64)
    states = [FaceState(open=0.1 * i, yaw=i - 4.0, roll=0.5 * i, blink=i / 9, gaze_x=0.1 * i) for i in range(10)]
    many = r.render_many(states)
    assert many.shape == (10, 64, 64, 3)
    for st, frame in zip(states, many):
        assert np.array_equal(r.render(st), frame)


def test_clip_durations_and_cross_scene_pairs():
    specs = clip_specs(DatasetConfig(identities=2, clips_per_identity=3, seconds=1.3, seed=4, size=64))
    assert [s.identity for s in specs] == [specs[0].identity] * 3 + [specs[3].identity] * 3
    assert len({s.scene for s in specs[:3]}) == 3  # each clip of a person in its own scene
    assert len({s.voice for s in specs[:3]}) == 1  # one person, one voice
    c = Clip(specs[0], SYNTH)
    assert len(c.audio) == c.spec.frames * 640 and c.spec.frames == 32  # video and audio end together
    assert c.phones[0].start == 0 and abs(c.phones[-1].end - 32 / 25) < 1e-6
    assert all(a.end == pytest.approx(b.start) for a, b in zip(c.phones, c.phones[1:]))


def test_bench_synth_quick():
    import argparse

    from avatarstream.bench import synth

    p = argparse.ArgumentParser()
    synth.add_arguments(p)
    r = synth.run(p.parse_args(["--clips", "1", "--seconds", "1", "--size", "64"]))
    assert r["clips"] == 1 and r["seconds"] == 1.0 and r["x_realtime_per_core"] > 0 and r["render_fps"] > 0


def test_generate_with_workers_is_the_same_dataset(tmp_path):
    from avatarstream.data.generate import generate

    cfg = DatasetConfig(identities=2, clips_per_identity=2, seconds=0.6, size=64, seed=9)
    one = generate(cfg, tmp_path / "one", shard_size=3)
    two = generate(cfg, tmp_path / "two", shard_size=3, workers=2)
    assert one["clips"] == two["clips"] == 4 and two["workers"] == 2
    a, b = ShardReader(tmp_path / "one"), ShardReader(tmp_path / "two")
    assert a.entries() == b.entries()  # same order, same shards
    for ra, rb in zip(a, b):
        assert np.array_equal(ra.frames, rb.frames) and np.array_equal(ra.audio, rb.audio)
        assert ra.annotations == rb.annotations


def test_reference_clips_shorter_than_the_sway_smoothing_window_render():
    """The listening gain is smoothed over 0.4 s (10 frames): a shorter clip must keep its length."""
    for n in (2, 8, 9):
        assert render_reference(1, 5, 64, frames=n).shape == (n, 64, 64, 3)
