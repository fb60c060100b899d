"""Audio/video offset after 5 minutes of a live session over WebRTC (real server process,
aiortc client in this process, tiny-random): 60 utterances of 2.5 s streamed at real time, each
followed by 2.5 s of streamed silence (the avatar goes back to idle in between).

Two measures, both required to stay within 40 ms and not to grow:
- delivery: when the packets of the same media instant arrive, video vs audio (RTP level);
- content: where each utterance starts in the received audio vs where the received video starts
  talking (the model's frames replace the idle animation), in RTP track time.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from avatarstream.bench.inputs import face_image, write_png
from avatarstream.serve.client import ServerProcess, run_client
from avatarstream.serve.receive import LOUD, av_offset, rtp_times

SR = 16000
PERIOD_S, TALK_S, MINUTES = 5.0, 2.5, 5


def _speech() -> np.ndarray:
    t = np.arange(int(TALK_S * SR)) / SR
    burst = (0.3 * np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))).astype(np.float32)
    one = np.concatenate([burst, np.zeros(int((PERIOD_S - TALK_S) * SR), np.float32)])
    return np.tile(one, int(MINUTES * 60 / PERIOD_S))


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(900)
def test_av_offset_after_five_minutes(tmp_path):
    write_png(tmp_path / "ref.png", face_image(96))
    with ServerProcess(tmp_path / "data", args=("--max-sessions", "2", "--idle-timeout", "60")) as server:
        summary, rec = asyncio.run(run_client(
            server.url, api_key="key", avatar=tmp_path / "ref.png", audio=_speech(),
            tail_s=1.0, timeout=MINUTES * 60 + 120))
    duration = rec.video_t[-1]
    assert duration >= MINUTES * 60  # the whole 5 minutes of speech were received (seen: exactly 300.0)
    assert 24 < summary["fps"] < 26 and summary["frames"] > 25 * MINUTES * 60, summary

    # Delivery offset per 30 s window, from packet arrivals.
    vt, vw = rtp_times(rec.rtp["video"], 90000)
    at, aw = rtp_times(rec.rtp["audio"], rec.audio_rate)
    windows = [av_offset(vt, vw, at, aw, window=(s, s + 30.0)) for s in np.arange(0, duration - 30, 30)]
    assert all(w is not None and abs(w) <= 40 for w in windows), windows
    assert max(windows) - min(windows) <= 15, windows  # not drifting

    # Content offset per utterance: audio onset vs the first talking video frame.
    playout = rec.event("playout")["media_s"]
    starts = [e["media_s"] - playout for _, e in rec.events if e.get("type") == "speech_started"]
    assert len(starts) >= MINUTES * 60 / PERIOD_S - 2
    a_t, peak = np.array(rec.audio_t), np.array(rec.audio_peak)
    v_t, change = np.array(rec.video_t), np.array(rec.video_change)
    offsets = []
    for s in starts:
        loud = np.flatnonzero((a_t >= s - 0.2) & (peak > LOUD))
        # from one frame before the first speech frame: the frames before it are the dissolve
        # from the idle picture into the model's first frame (LiveSessionConfig.ease_s), silent
        talk = np.flatnonzero((v_t >= s - 0.04) & (change > 10.0))
        if loud.size and talk.size:
            offsets.append(v_t[talk[0]] - a_t[loud[0]])
    offsets_ms = np.array(offsets) * 1000
    assert offsets_ms.size >= len(starts) - 2
    first, last = np.median(offsets_ms[:10]), np.median(offsets_ms[-10:])
    # within one frame (40 ms, +1 ms of float): the dissolve ends on the first speech frame, so
    # the change detector sees talking from the frame after it (measured +40 in every utterance)
    assert abs(first) <= 41 and abs(last) <= 41, (first, last)
    assert abs(last - first) <= 20, (first, last)
    print(f"\nafter {duration:.0f} s: delivery offset {windows[0]:+.1f} .. {windows[-1]:+.1f} ms "
          f"(30 s windows, range {min(windows):+.1f}..{max(windows):+.1f}); content offset "
          f"first 10 utterances {first:+.0f} ms, last 10 {last:+.0f} ms; ttff {summary['ttff_s']} s")
