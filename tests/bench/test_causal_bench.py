"""The long-horizon and pipeline benchmarks: their windows, colour measure, streaming scorer and
JSON (the numbers themselves are meaningless with random weights; the machinery is not)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from avatarstream.bench.drift import WindowSink, drift_windows, looped, looped_slice, srgb_to_lab
from avatarstream.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_drift_windows_follow_table_7():
    assert drift_windows(10) == [(0.0, 10.0)]
    assert drift_windows(25) == [(0.0, 10.0), (15.0, 25.0)]
    assert drift_windows(1000) == [(0.0, 10.0), (100.0, 110.0), (990.0, 1000.0)]
    assert drift_windows(100, every=10) == [(10.0 * k, 10.0 * k + 10) for k in range(10)]
    assert drift_windows(35, every=15) == [(0.0, 10.0), (15.0, 25.0), (25.0, 35.0)]
    with pytest.raises(ConfigError, match="at least 10"):
        drift_windows(100, every=5)
    with pytest.raises(ConfigError, match="more than 20 windows"):
        drift_windows(1000, every=10)
    assert drift_windows(10010) == [(0.0, 10.0), (100.0, 110.0), (1000.0, 1010.0), (10000.0, 10010.0)]
    with pytest.raises(ConfigError):
        drift_windows(9)


def test_srgb_to_lab_reference_values():
    lab = srgb_to_lab(torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.5]]))
    want = torch.tensor([[100.0, 0.0, 0.0], [53.24, 80.09, 67.20], [53.39, 0.0, 0.0]])
    assert float((lab - want).abs().max()) < 0.1


def test_looped_speech_streams_in_pieces():
    speech = np.arange(10, dtype=np.float32)
    got = np.concatenate([p.numpy() for p in looped(speech, 25, piece=4)])
    assert np.array_equal(got, np.arange(25) % 10)
    assert np.array_equal(looped_slice(speech, 18, 23), np.array([8, 9, 0, 1, 2]))


def test_window_sink_keeps_only_window_frames():
    sink = WindowSink([(0.0, 0.4), (1.0, 1.4)], None, np.zeros((1, 8, 8, 3), np.uint8), None, fps=25)
    for start in range(0, 60, 7):  # chunks of 7 frames whose pixels say their frame index
        n = min(7, 60 - start)
        frames = np.arange(start, start + n, dtype=np.uint8)[:, None, None, None] * np.ones((1, 8, 8, 3), np.uint8)
        sink.write_video(SimpleNamespace(start_frame=start, frames=frames))
    assert [(lo, hi) for lo, hi, *_ in sink.done] == [(0, 10), (25, 35)]
    assert sink.done[0][2][:, 0, 0, 0].tolist() == list(range(10))
    assert sink.done[1][2][:, 0, 0, 0].tolist() == list(range(25, 35))
    assert sink.done[1][3] == [3]  # the chunk starting at frame 28 (35 is past the window)
    assert not sink._frames and sink.durable_frames == 60


def test_bench_drift_json(capsys):
    """`bench drift --seconds 10`: the rollout in its own process, windows with the issue's keys,
    the ablation rows (History Corrupt unavailable without a model trained without it)."""
    from avatarstream.cli import main

    assert main(["bench", "drift", "--model", "tiny-random", "--seconds", "10", "--speech-seconds", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [list(w) for w in r["windows"]] == [["start_s", "end_s", "face_sim", "sync_c", "color_shift"]]
    assert r["windows"][0]["color_shift"] == 0.0 and r["peak_rss_mb"] > 0
    assert set(r["ablations"]) == {"no_adaptive_sink", "no_rolling_rope", "no_history_corrupt"}
    assert r["ablations"]["no_history_corrupt"]["windows"] is None
    assert r["ablations"]["no_adaptive_sink"]["windows"][0]["face_sim"] != r["windows"][0]["face_sim"]
    assert r["detail"][0]["audio_phase_s"] == 0.0
    gt = r["ground_truth"]  # the speech clip's own render, scored the same way
    assert gt["seconds"] == 4.0 and gt["sync_c"] > r["windows"][0]["sync_c"] and 0 < gt["face_sim"] <= 1


def test_drift_windows_hear_the_same_speech():
    """With the default loop (one window long), every window of a 1000 s or 100 s rollout is
    given the same samples, so Sync-C changes between windows are not changes of speech."""
    from avatarstream.bench.drift import drift_windows, looped_slice
    from avatarstream.eval.metrics import DRIFT_LEN

    sr, fps = 16000, 25
    speech = np.random.default_rng(0).standard_normal(int(DRIFT_LEN * sr)).astype(np.float32)
    spf = sr // fps
    for seconds in (100.0, 1000.0):
        wins = drift_windows(seconds)
        assert wins[-1] == (seconds - DRIFT_LEN, seconds)
        first = looped_slice(speech, int(wins[0][0] * fps) * spf, int(wins[0][1] * fps) * spf)
        for a, b in wins[1:]:
            assert np.array_equal(looped_slice(speech, int(a * fps) * spf, int(b * fps) * spf), first)


def test_bench_tpp_json(capsys):
    from avatarstream.cli import main

    assert main(["bench", "tpp", "--workers", "2", "--model", "tiny-random", "--seconds", "1",
                 "--cores", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"fps_pipeline", "fps_sequential", "speedup"} <= r.keys()
    assert r["fps_pipeline"] > 0 and r["fps_sequential"] > 0 and r["cores"] == 1
    assert r["speedup"] == pytest.approx(r["fps_pipeline"] / r["fps_sequential"], rel=0.01)
    assert main(["bench", "tpp", "--workers", "9", "--model", "tiny-random"]) == 2


def test_bench_strategies_json_and_table(tmp_path, capsys):
    """`bench strategies`: one rollout per strategy, the summary keys, the Markdown table written
    (with hand-written notes below it kept) and the causal column's model named when it differs."""
    from avatarstream.bench.strategies import markdown
    from avatarstream.cli import main

    doc = tmp_path / "strategies.md"
    doc.write_text("old table\n\n## Notes\nkept\n")
    assert main(["bench", "strategies", "--model", "tiny-random", "--causal-model", "tiny-random",
                 "--seconds", "10", "--write", str(doc), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(r["strategies"]) == {"prefix", "interp", "causal"}
    assert r["models"] == {"prefix": "tiny-random", "interp": "tiny-random", "causal": "tiny-random"}
    for row in r["strategies"].values():
        assert row["fps"] > 0 and row["boundary_smoothness"] is not None and row["last_window"] == [0.0, 10.0]
    text = doc.read_text()
    assert "| prefix | interp | causal |" in text and text.endswith("## Notes\nkept\n")
    assert "old table" not in text and "--causal-model" not in text
    r["models"]["causal"] = "weights/causal-student"
    assert "| prefix | interp | causal (weights/causal-student) |" in markdown(r)
