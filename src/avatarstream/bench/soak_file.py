"""`bench soak`'s file part: `avatarstream generate` on the whole track, in its own process as a
user runs it (`--events`: one line per chunk), then the written MP4 read back.

Measures per minute of media:
- `rss_mb` / `rss_min_mb` / `rss_max_mb`: the generate process's VmRSS, sampled at each chunk it
  publishes, median / floor / peak over the chunks of that minute of media.
- `av_offset_ms` = `video_delay_ms` - `audio_delay_ms`: when the file presents the video frame
  made for media time T minus when it presents the input audio of T; > 0: video late. Both sides
  are read from the file:
  - `video_delay_ms`: when the frame made for T is presented, minus T. generate publishes every
    frame from timeline frame 0 on, so the frame whose index (pts * fps, rounded) is the first
    frame's + k was made for k / fps: its delay is its pts - k / fps. A video track stamped late
    or early as a whole (its first frame not at 0) shows here; a frame missing inside the file
    counts under `dropped`, not here.
  - `audio_delay_ms`: the audio of T is presented at T + (audio frame pts - samples decoded
    before it / rate) + the decoded audio's content shift against the input track
    (`audio_shift_ms`: cross-correlation within +-0.2 s: an audio stream whose timestamps are
    right but whose samples moved counts too).
  Medians over the minute.
- `dropped` / `duplicated`: gaps in / repeats of the video frame indices (pts * fps).
- `frames` / `expected_frames`: video frames in the file vs the input's length at the model's fps.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from avatarstream.bench.soak_measure import (frame_steps, growth_keys, in_window, median_or_none,
                                            minute_windows, process_rss_mb, rss_per_window)
from avatarstream.errors import InputError

SHIFT_S = 0.2  # audio content shift searched, each way


def render(model: str, reference: Path, audio: Path, out: Path, *, seconds: float,
           threads: int | None, fps: int) -> tuple[dict, np.ndarray, np.ndarray, float]:
    """Run generate; returns (its JSON summary, media time and RSS MB at each chunk, wall s)."""
    cmd = [sys.executable, "-m", "avatarstream.cli", "generate", "--reference", str(reference),
           "--audio", str(audio), "--out", str(out), "--model", model, "--json", "--no-progress",
           "--events", "--max-audio-seconds", str(math.ceil(seconds) + 1)]
    if threads:
        cmd += ["--threads", str(threads)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    media, rss = [], []
    other: deque[str] = deque(maxlen=20)
    assert proc.stderr is not None and proc.stdout is not None
    for line in proc.stderr:  # one event per chunk, flushed as it is published
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            other.append(line.rstrip())
            continue
        mb = process_rss_mb(proc.pid)
        if isinstance(event, dict) and event.get("event") == "chunk" and mb is not None:
            media.append(event["frames_published"] / fps)
            rss.append(mb)
    stdout = proc.stdout.read()
    proc.wait()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise InputError(f"generate failed ({proc.returncode}): " + " | ".join(list(other)[-3:]))
    return json.loads(stdout.strip().splitlines()[-1]), np.array(media), np.array(rss), wall


def audio_shift_s(source: np.ndarray, decoded: np.ndarray, a: int, b: int, rate: int) -> float | None:
    """Where source[a:b] sits in `decoded`, relative to the same position (s; > 0: later); None
    for a window without enough signal to tell."""
    lag = round(SHIFT_S * rate)
    x = source[a:b].astype(np.float64)
    y = np.zeros(b - a + 2 * lag)
    lo, hi = max(0, a - lag), min(decoded.size, b + lag)
    if hi <= lo or np.sqrt(np.mean(x**2)) < 1e-3:
        return None
    y[lo - (a - lag) : hi - (a - lag)] = decoded[lo:hi]
    n = 1 << int(np.ceil(np.log2(y.size + x.size)))
    cc = np.fft.irfft(np.fft.rfft(y, n) * np.conj(np.fft.rfft(x, n)), n)[: 2 * lag + 1]  # [2*lag+1]
    return (int(np.argmax(cc)) - lag) / rate


def read_back(path: Path) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray, int]:
    """(video pts in s, the video's fps, audio frame pts in s, samples decoded before each audio
    frame, the decoded audio [N] mono, its rate) of an MP4."""
    import av

    with av.open(str(path)) as c:
        v = c.streams.video[0]
        fps = int(round(float(v.average_rate or v.guessed_rate or 25)))
        vpts = np.sort(np.array([p.pts for p in c.demux(v) if p.pts is not None], np.float64)) * float(v.time_base)
    with av.open(str(path)) as c:
        a = c.streams.audio[0]
        rate = a.rate
        pts, count, pieces = [], [], []
        for f in c.decode(a):
            pts.append(f.pts * float(f.time_base))
            count.append(f.samples)
            pieces.append(f.to_ndarray().reshape(len(f.layout.channels), -1).mean(0))  # mono
    before = np.cumsum([0, *count[:-1]])
    return vpts, fps, np.array(pts), before, np.concatenate(pieces).astype(np.float32), rate


def report(summary: dict, media: np.ndarray, rss: np.ndarray, wall: float, out: Path,
           source: np.ndarray, source_rate: int) -> dict:
    """The file part's JSON (module docstring)."""
    vpts, fps, apts, before, decoded, rate = read_back(out)
    if rate != source_rate:
        raise InputError(f"the file's audio is {rate} Hz, the input {source_rate} Hz")
    seconds = source.size / source_rate
    index = np.round(vpts * fps).astype(np.int64)  # [frames] timeline frame of each video frame
    missing, repeat = frame_steps(index)
    d_a = apts - before / rate  # [audio frames] presentation time - position in the samples
    a_t = before / rate
    d_v = vpts - (index - index[:1]) / fps  # [frames] presentation time - the media time it was made for
    per_minute = []
    for m, win in enumerate(minute_windows(seconds)):
        ok = in_window(vpts, win)
        shift = audio_shift_s(source, decoded, round(win[0] * rate), round(win[1] * rate), rate)
        da = median_or_none(d_a[in_window(a_t, win)] * 1000)
        dv = median_or_none(d_v[ok] * 1000)
        audio = None if da is None or shift is None else da + 1000 * shift
        per_minute.append({
            "minute": m + 1, "seconds": round(win[1] - win[0], 1),
            "av_offset_ms": None if dv is None or audio is None else round(dv - audio, 1) + 0.0,  # no -0.0
            "video_delay_ms": None if dv is None else dv + 0.0,
            "audio_delay_ms": None if audio is None else round(audio, 1) + 0.0,
            "audio_shift_ms": None if shift is None else round(1000 * shift, 1),
            "frames": int(ok.sum()), "expected_frames": int(round((win[1] - win[0]) * fps)),
            "dropped": int(missing[ok].sum()), "duplicated": int(repeat[ok].sum()),
            # a chunk's event comes when its last frame is out: that frame's time names its minute
            **rss_per_window(media - 0.5 / fps, rss, win),
        })
    return {
        "per_minute": per_minute, **growth_keys(per_minute),
        "frames": int(vpts.size), "expected_frames": int(round(seconds * fps)),
        "generate_frames": summary.get("frames"), "process_s": round(wall, 1),
        "rtf": round(summary["duration_s"] / summary["wall_s"], 3) if summary.get("wall_s") else None,
        "peak_rss_mb": round(summary.get("peak_rss_mb", 0.0), 1),
    }
