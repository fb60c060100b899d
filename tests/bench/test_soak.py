"""`bench soak`: a 12 s smoke run of both parts (real server, aiortc client, generate; tiny-random)
prints one JSON object with the keys it promises and sane values; and the measures it is made of,
on made-up data where the answer is known."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli

from avatarstream.bench.soak import verdict
from avatarstream.bench.soak_file import audio_shift_s
from avatarstream.bench.soak_live import ttff_after_pauses
from avatarstream.bench.soak_measure import (PACKET, frame_steps, growth_pct, minute_windows,
                                            speech_track)
from avatarstream.media.synthetic import speechlike

LIVE_MINUTE = {"minute", "seconds", "av_offset_ms", "av_offset_decoded_ms", "onset_offset_ms", "frames",
               "dropped", "duplicated", "repeated_late", "rss_mb", "rss_min_mb", "rss_max_mb", "lag_max_s",
               "load_1m"}
FILE_MINUTE = {"minute", "seconds", "av_offset_ms", "video_delay_ms", "audio_delay_ms", "audio_shift_ms",
               "frames", "expected_frames", "dropped", "duplicated", "rss_mb", "rss_min_mb", "rss_max_mb"}


@pytest.mark.soak  # alongside the rest in make test
@pytest.mark.timeout(240)
def test_soak_smoke_json():
    r = run_cli("bench", "soak", "--minutes", "0.2", "--talk", "4", "--pause", "2",
                "--model", "tiny-random", "--json", timeout=240)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["minutes"] == 0.2 and out["model"] == "tiny-random"
    live, file = out["live"], out["file"]
    [m] = live["per_minute"]
    assert set(m) == LIVE_MINUTE and m["minute"] == 1 and m["seconds"] == 12.0
    assert abs(m["av_offset_ms"]) <= 40 and m["rss_mb"] > 50
    assert 12 * 25 - 5 <= m["frames"] <= 12 * 25 + 1 and m["dropped"] == 0 and m["duplicated"] == 0
    # 12 s = pause 2, talk 4, pause 2, talk 4: two utterances, each after a pause
    assert live["utterances"] == 2 and len(live["ttff_after_pause_s"]) == 2
    assert all(t is not None and 0 < t < 10 for t in live["ttff_after_pause_s"])
    assert live["rss_growth_pct_5_to_end"] is None and live["slow_downs"] == 0
    [f] = file["per_minute"]
    assert set(f) == FILE_MINUTE and f["frames"] == f["expected_frames"] == 300
    assert abs(f["av_offset_ms"]) <= 40 and f["audio_shift_ms"] == 0.0 and f["rss_mb"] > 50
    assert file["frames"] == file["expected_frames"] == file["generate_frames"] == 300
    assert out["pass"] == {"live_av_offset": True, "live_rss_growth": None, "file_av_offset": True,
                           "file_rss_growth": None, "file_frames": True, "all": True}


def test_soak_refuses_bad_options():
    r = run_cli("bench", "soak", "--minutes", "0")
    assert r.returncode == 2 and "--minutes must be positive" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("bench", "soak", "--minutes", "1", "--speech", "no/such.wav")
    assert r.returncode != 0 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_speech_track_alternates_pause_and_talk():
    speech = speechlike(3.0, seed=1)
    tr = speech_track(0.5, 4.0, 2.0, speech, "x", silence_rms=0.003)  # 30 s: 5 x (2 s pause, 4 s talk)
    assert tr.samples.size == 30 * 16000
    assert len(tr.voiced) == 5
    for i, v in enumerate(tr.voiced):
        start = (i * 6 + 2) * 16000 // PACKET  # the packet where utterance i begins
        assert start <= v < start + 10
        pause = tr.samples[(start - 2 * 16000 // PACKET) * PACKET : start * PACKET]
        assert not pause.any()  # the pause before it is silent
    # utterances continue through the speech (cyclically), they are not copies of each other
    a, b = (tr.samples[(k * 6 + 2) * 16000 : (k * 6 + 3) * 16000] for k in (0, 1))
    assert not np.array_equal(a, b)


def test_frame_steps_count_gaps_and_repeats():
    missing, repeat = frame_steps(np.array([10, 11, 14, 14, 15, 13, 16]))
    assert missing.tolist() == [0, 0, 2, 0, 0, 0, 2]
    assert repeat.tolist() == [False, False, False, True, False, True, False]


def test_minute_windows_and_growth():
    assert minute_windows(150.0) == [(0.0, 60.0), (60.0, 120.0), (120.0, 150.0)]
    assert minute_windows(12.0) == [(0.0, 12.0)]
    rows = [{"rss_mb": v} for v in (100, 300, 300, 300, 400, 404, 410)]
    assert growth_pct(rows, 5, fit=False) == 2.5  # minute 5 (400) -> minute 7 (410)
    assert growth_pct(rows, 5) == pytest.approx(2.5, abs=0.01)  # a straight line: the same
    assert growth_pct(rows[:5], 5) is None  # nothing after minute 5
    # an hour whose memory steps between two levels (the allocator returning and taking memory
    # back) without a trend, ending on the high one; and a real leak of the same size
    start = [{"rss_mb": 500.0}] * 4
    steps = start + [{"rss_mb": 600.0 + 60.0 * (m % 2)} for m in range(56)]
    leak = start + [{"rss_mb": 600.0 + 60.0 * m / 55} for m in range(56)]
    assert growth_pct(steps, 5, fit=False) == 10.0 and abs(growth_pct(steps, 5)) < 1.0
    assert growth_pct(leak, 5) == pytest.approx(10.0, abs=0.01)
    assert type(growth_pct(leak, 5)) is float  # not numpy's: JSON writes its comparisons as 1.0


def test_ttff_after_pauses_pairs_each_voice_with_its_speech_start():
    # playout starts at media 1.0 s: track time = media - 1.0; frames every 40 ms arriving 0.5 s late
    vt = np.arange(0, 30, 0.04)
    vw = 100.0 + vt + 0.5
    events = [(100.0, {"type": "playout", "media_s": 1.0}),
              (103.1, {"type": "speech_started", "media_s": 4.0}),
              (110.2, {"type": "speech_started", "media_s": 11.2})]
    ttff = ttff_after_pauses([103.0, 110.0, 120.0], events, vt, vw)
    # voice sent at 103.0 -> first frame at track 3.0 arrives at 103.5; the third never started
    assert ttff == [pytest.approx(0.5, abs=1e-3), pytest.approx(0.7, abs=1e-3), None]


def test_audio_shift_finds_moved_samples():
    x = speechlike(4.0, seed=2)
    moved = np.concatenate([np.zeros(480, np.float32), x])[: x.size]  # 30 ms late
    assert audio_shift_s(x, moved, 16000, 48000, 16000) == pytest.approx(0.03, abs=1e-4)
    assert audio_shift_s(x, x, 16000, 48000, 16000) == 0.0
    assert audio_shift_s(np.zeros_like(x), x, 16000, 48000, 16000) is None  # silence: cannot tell


def _written(path, source: np.ndarray, *, video_start: int, audio_start: int = 0):  # noqa: ANN001
    """A 2 s file through the file sink generate uses: the source track from timeline sample
    `audio_start`, 50 frames from timeline frame `video_start` (25 fps)."""
    from avatarstream.media.frames import AudioChunk, VideoChunk
    from avatarstream.publish.file import FragmentedMP4Sink

    sink = FragmentedMP4Sink(path)
    sink.open(64, 64, 25, 16000)
    frames = np.repeat(np.arange(50, dtype=np.uint8)[:, None, None, None] * 5, 64 * 64 * 3).reshape(50, 64, 64, 3)
    sink.write_audio(AudioChunk(source, audio_start, 16000))
    for i in range(0, 50, 10):  # chunks of 10 frames, as the engine publishes
        sink.write_video(VideoChunk(frames[i : i + 10], video_start + i, 25))
    sink.close()
    return path


@pytest.mark.parametrize("video_start, audio_start, offset_ms", [(0, 0, 0.0), (5, 0, 200.0), (0, 1600, -100.0)],
                         ids=["in-sync", "video-200ms-late", "audio-100ms-late"])
def test_file_offset_measures_both_sides(tmp_path, video_start, audio_start, offset_ms):
    """A video track stamped 200 ms late as a whole (every frame there, no gap) shows as video
    200 ms late; audio written 100 ms late as video 100 ms early; a file in sync as 0 (within
    one AAC frame of rounding, 1 ms). Before the video side was measured, the first read 0."""
    from avatarstream.bench.soak_file import report

    source = speechlike(2.0, seed=3)
    out = _written(tmp_path / "f.mp4", source, video_start=video_start, audio_start=audio_start)
    summary = {"frames": 50, "duration_s": 2.0, "wall_s": 1.0, "peak_rss_mb": 0.0}
    got = report(summary, np.zeros(0), np.zeros(0), 1.0, out, source, 16000)
    [m] = got["per_minute"]
    assert m["av_offset_ms"] == pytest.approx(offset_ms, abs=1.0), m
    assert set(m) == FILE_MINUTE and got["frames"] == 50
    assert m["dropped"] == 0 and m["duplicated"] == 0  # a shift, not a gap
    assert m["video_delay_ms"] == pytest.approx(40.0 * video_start, abs=1.0), m
    assert m["audio_delay_ms"] == pytest.approx(audio_start / 16.0, abs=1.0), m


def test_verdict_applies_the_criteria():
    def part(offsets: list, growth: float | None) -> dict:
        return {"per_minute": [{"av_offset_ms": o} for o in offsets], "rss_growth_pct_5_to_end": growth,
                "frames": 10, "expected_frames": 10}

    ok = verdict(part([3.0, -39.0], np.float64(1.5)), part([0.0], None))
    assert ok == {"live_av_offset": True, "live_rss_growth": True, "file_av_offset": True,
                  "file_rss_growth": None, "file_frames": True, "all": True}
    # Python's own bools (numpy's print as 1.0 in the CLI's JSON)
    assert all(v is None or type(v) is bool for v in ok.values())
    bad = verdict(part([3.0, 41.0], 2.5), None)
    assert bad["live_av_offset"] is False and bad["live_rss_growth"] is False and bad["all"] is False
    assert bad["file_av_offset"] is None and "file_frames" not in bad
    assert verdict(part([None], None), None)["live_av_offset"] is False  # a minute not measured fails
