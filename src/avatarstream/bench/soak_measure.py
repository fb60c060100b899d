"""Measures shared by `bench soak`'s live and file parts: the speech-and-pause track, a process's
resident memory, minute windows, frame continuity and memory growth. Pure functions of arrays
(besides `process_rss_mb`), so each is tested without a server."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PACKET = 640  # 40 ms of 16 kHz audio: what the client streams per WebSocket message


@dataclass
class SpeechTrack:
    """`minutes` of speech and pauses: `pause_s` of silence, then `talk_s` of speech, repeated.

    `samples` float32 [N] at 16 kHz; `voiced` the index of each utterance's first packet (of
    PACKET samples, counted from the track's start) loud enough for the server to take as speech
    (its pause threshold), i.e. the packet that ends the pause before it."""

    samples: np.ndarray
    voiced: list[int]
    source: str
    sample_rate: int = 16000


def speech_track(minutes: float, talk_s: float, pause_s: float, speech: np.ndarray, source: str,
                 *, silence_rms: float, sample_rate: int = 16000) -> SpeechTrack:
    """Pause, talk, pause, talk, ... for `minutes`; each talk is the next `talk_s` of `speech`
    (taken cyclically, so utterances differ). Lengths are whole packets, so every utterance
    starts on the client's packet grid."""
    total = int(round(minutes * 60 * sample_rate / PACKET)) * PACKET
    talk = max(1, round(talk_s * sample_rate / PACKET)) * PACKET
    pause = max(1, round(pause_s * sample_rate / PACKET)) * PACKET
    out = np.zeros(total, np.float32)
    voiced, pos, src = [], pause, 0
    while pos < total:
        n = min(talk, total - pos)
        piece = np.take(speech, np.arange(src, src + n), mode="wrap")  # [n]
        out[pos : pos + n] = piece
        src = (src + n) % speech.size
        loud = _first_loud_packet(piece, silence_rms)
        if loud is not None:
            voiced.append(pos // PACKET + loud)
        pos += talk + pause
    return SpeechTrack(out, voiced, source, sample_rate)


def _first_loud_packet(x: np.ndarray, silence_rms: float) -> int | None:
    n = x.size // PACKET
    if n == 0:
        return None
    rms = np.sqrt(np.mean(np.square(x[: n * PACKET].reshape(n, PACKET), dtype=np.float64), axis=1))
    hit = np.flatnonzero(rms >= silence_rms)
    return int(hit[0]) if hit.size else None


def process_rss_mb(pid: int) -> float | None:
    """Resident memory (VmRSS) of process `pid` in MB, None once it is gone (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def minute_windows(duration_s: float) -> list[tuple[float, float]]:
    """[start, end) in seconds of each minute of `duration_s` (the last one may be partial)."""
    n = max(1, int(np.ceil(duration_s / 60.0 - 1e-9)))
    return [(60.0 * m, min(60.0 * (m + 1), duration_s)) for m in range(n)]


def frame_steps(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per frame (in arrival order) of a stream of frame indices (pts / frame duration): frames
    missing just before it (a jump of more than one) and whether it repeats or goes back (a step
    of zero or less). The first frame has neither."""
    step = np.diff(index.astype(np.int64), prepend=index[:1].astype(np.int64) - 1)  # [N]
    return np.maximum(step - 1, 0), step <= 0


def in_window(t: np.ndarray, window: tuple[float, float]) -> np.ndarray:
    return (t >= window[0]) & (t < window[1])


def median_or_none(x: np.ndarray | list, digits: int = 1) -> float | None:
    x = np.asarray(x, dtype=np.float64)
    return round(float(np.median(x)), digits) if x.size else None


def rss_per_window(t: np.ndarray, mb: np.ndarray, window: tuple[float, float]) -> dict:
    """`rss_mb` / `rss_min_mb` / `rss_max_mb`: median, floor and peak of the memory samples taken
    in `window` (None without samples)."""
    ok = in_window(t, window)
    if not ok.any():
        return {"rss_mb": None, "rss_min_mb": None, "rss_max_mb": None}
    x = mb[ok]
    return {"rss_mb": round(float(np.median(x)), 1), "rss_min_mb": round(float(x.min()), 1),
            "rss_max_mb": round(float(x.max()), 1)}


def growth_pct(per_minute: list[dict], from_minute: int, *, fit: bool = True) -> float | None:
    """Growth of the per-minute `rss_mb` from minute `from_minute` (1-based) to the last, in
    percent; None without a minute after it. `fit`: between the values a least-squares line
    through all those minutes takes at both ends, so the level the allocator happens to hold in
    one minute (RSS moves in steps of tens of MB as memory is returned to the system and taken
    again) does not decide it; else the two minutes' own values."""
    y = np.array([m["rss_mb"] for m in per_minute[from_minute - 1 :]], dtype=np.float64)
    if y.size < 2 or np.isnan(y).any() or not y[0] > 0:
        return None
    if fit:
        x = np.arange(y.size, dtype=np.float64)
        slope, intercept = np.polyfit(x, y, 1)
        y = np.array([intercept, intercept + slope * x[-1]])
    return round(float(100.0 * (y[-1] - y[0]) / y[0]), 2)


def growth_keys(per_minute: list[dict]) -> dict:
    """The memory-growth keys of a part: from minute 5 (the issue's criterion: the allocator and
    caches have settled), fitted and raw, and for short runs from minute 1 (fitted)."""
    return {"rss_growth_pct_5_to_end": growth_pct(per_minute, 5),
            "rss_growth_pct_5_to_end_raw": growth_pct(per_minute, 5, fit=False),
            "rss_growth_pct_1_to_end": growth_pct(per_minute, 1)}
