"""`curate` on hostile tiny videos (issue 38 item 5), built here with PyAV: one frame declaring a
frame rate of 1/10000 (one frame "lasting" 10000 s) and a clip with a 37-minute jump between two
timestamps. Before the bounds each became hundreds of thousands of 25 fps copies of one frame
(gigabytes, minutes); now no source frame is shown longer than `max_gap_s` and no input gives more
than `max_seconds`, each cut recorded in the manifest with its reason, in bounded time and memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from avatarstream.data.curate.normalise import read_audio
from avatarstream.data.shards import read_pcm, write_pcm

SIDE = 160


def _frame(value: int) -> av.VideoFrame:
    ramp = np.add.outer(np.arange(SIDE), np.arange(SIDE)) + 40 * value  # smooth: a file of a few KB
    x = np.repeat((ramp % 256).astype(np.uint8)[..., None], 3, axis=2)
    return av.VideoFrame.from_ndarray(x, format="rgb24")


def one_frame_at_1_per_10000_s(path: Path) -> Path:
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=Fraction(1, 10000))
        s.width = s.height = SIDE
        s.pix_fmt = "yuv420p"
        for p in [*s.encode(_frame(0)), *s.encode()]:
            c.mux(p)
    return path


def frames_with_a_gap(path: Path, times: list[float]) -> Path:
    """Frames at `times` (seconds) in a 25 fps stream (mp4: its declared rate follows the gap)."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=25)
        s.width = s.height = SIDE
        s.pix_fmt = "yuv420p"
        s.codec_context.time_base = Fraction(1, 25)
        for i, t in enumerate(times):
            f = _frame(i)
            f.pts, f.time_base = round(t * 25), Fraction(1, 25)
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


CHILD = """
import json, resource, sys, time
from pathlib import Path
from avatarstream.data.curate.normalise import Bounds, normalise_video
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
nv = normalise_video(sys.argv[1], "v", Path(sys.argv[2]), 640, 27.0, 15, Bounds(**json.loads(sys.argv[3])))
print(json.dumps({"frames": nv.frames, "shots": nv.shots, "trimmed": nv.trimmed, "wall_s": time.perf_counter() - t0,
                  "rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
"""


def _normalise(video: Path, work: Path, **bounds: float) -> dict:
    """normalise_video in a child process: its result, wall time and peak RSS growth."""
    work.mkdir(exist_ok=True)
    p = subprocess.run([sys.executable, "-c", CHILD, str(video), str(work), json.dumps(bounds)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_one_frame_declared_at_1_per_10000_s_is_shown_for_the_gap_bound_only(tmp_path):
    video = one_frame_at_1_per_10000_s(tmp_path / "one.mkv")
    assert video.stat().st_size < 20_000
    r = _normalise(video, tmp_path / "work")
    assert r["frames"] == 50 and r["shots"] == [[0, 50]]  # 2 s (the default bound), not 250,000 frames
    assert [t["reason"] for t in r["trimmed"]] == ["frame_gap"] and "10000.000 s" in r["trimmed"][0]["detail"]
    assert r["wall_s"] < 30 and r["rss_growth_mb"] < 200, r
    assert sum(f.stat().st_size for f in (tmp_path / "work").iterdir()) < 5_000_000


def test_a_37_minute_timestamp_gap_ends_the_input_before_it(tmp_path):
    video = frames_with_a_gap(tmp_path / "gap.mp4", [0.0, 0.04, 0.08, 0.12, 37 * 60.0, 37 * 60.0 + 0.04])
    r = _normalise(video, tmp_path / "work")
    assert r["frames"] == 4  # the frames before the gap, each for its own 1/25 s
    assert [(t["reason"], t["at_frame"]) for t in r["trimmed"]] == [("frame_gap", 4)]
    assert "2219.880 s between two frames at 0.120 s" in r["trimmed"][0]["detail"]
    assert r["wall_s"] < 30 and r["rss_growth_mb"] < 200, r
    # settable: a bound above the gap reads across it (a short gap here: 3 s)
    short = frames_with_a_gap(tmp_path / "short.mp4", [0.0, 0.04, 3.04, 3.08])
    assert _normalise(short, tmp_path / "w2")["trimmed"][0]["reason"] == "frame_gap"
    r = _normalise(short, tmp_path / "w3", max_gap_s=5.0)
    assert r["trimmed"] == [] and r["frames"] >= 78  # past the gap (the last frame lasts the declared interval)


def test_an_input_longer_than_the_duration_bound_is_cut_there(tmp_path):
    video = frames_with_a_gap(tmp_path / "long.mp4", [k / 25 for k in range(75)])  # 3 s
    r = _normalise(video, tmp_path / "work", max_seconds=1.0)
    assert r["frames"] == 25 and [(t["reason"], t["at_frame"]) for t in r["trimmed"]] == [("too_long", 25)]
    assert _normalise(video, tmp_path / "w2")["frames"] == 75


def test_a_windows_audio_is_read_alone_and_equals_the_whole_files_slice(tmp_path):
    x = np.random.default_rng(1).uniform(-0.9, 0.9, 640 * 60).astype(np.float32)
    write_pcm(tmp_path / "a.wav", x)
    whole, _ = read_pcm(tmp_path / "a.wav")
    for a, b in [(0, 10), (17, 44), (50, 60), (55, 70)]:
        assert np.array_equal(read_audio(str(tmp_path / "a.wav"), a, b), whole[a * 640:b * 640])


@pytest.mark.slow
def test_curate_skips_hostile_inputs_with_the_reason_shows_progress_and_keeps_ray_quiet(tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("dlib")
    pytest.importorskip("scenedetect")
    pytest.importorskip("imagehash")
    one = one_frame_at_1_per_10000_s(tmp_path / "one.mkv")
    gap = frames_with_a_gap(tmp_path / "gap.mp4", [0.0, 0.04, 0.08, 0.12, 37 * 60.0, 37 * 60.0 + 0.04])
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "avatarstream.cli", "curate", str(one), str(gap), "--out", str(out),
                        "--json"], capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    err = p.stderr.splitlines()
    assert err[0] == "avatarstream curate: starting Ray (local, 1 worker(s))"
    for line in ("read input 1/2 (v0000-one)", "read input 2/2 (v0001-gap)", "finding faces in 2 window(s)",
                 "window 2/2", "grouping 2 stretch(es)"):
        assert any(ln == f"avatarstream curate: {line}" or ln.startswith(f"avatarstream curate: {line}")
                   for ln in err), (line, err)
    # Ray's Python noise is off (its INFO on every dataset, token and progress-bar notices)
    assert not [ln for ln in err if "streaming_executor" in ln or "Progress bars" in ln or "Token auth" in ln], err
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["trimmed_inputs"] == {"frame_gap": 2} and summary["kept"] == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["config"]["bounds"] == {"max_seconds": 3600.0, "max_gap_s": 2.0}
    got = {i["video"]: (i["frames"], [t["reason"] for t in i["trimmed"]]) for i in m["inputs"]}
    assert got == {"v0000-one": (50, ["frame_gap"]), "v0001-gap": (4, ["frame_gap"])}
    assert not (out / ".curate-work").exists()


def test_bounds_must_be_positive(tmp_path, capsys):
    pytest.importorskip("ray")
    from avatarstream.cli import main

    video = one_frame_at_1_per_10000_s(tmp_path / "one.mkv")
    for flag in ("--max-frame-gap", "--max-input-seconds"):
        assert main(["curate", str(video), "--out", str(tmp_path / "o"), flag, "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["avatarstream: error: --max-input-seconds and --max-frame-gap must be positive"]
