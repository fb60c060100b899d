"""What a WebRTC viewer receives, with its timing, and the measures taken from it.

`Received` collects, per track, each frame's RTP track time and arrival time (and for video the
change from the previous frame, for audio the peak level), the first-packet arrival of every RTP
timestamp (before aiortc's jitter buffers), and the session's events. `summarize` turns that into
time-to-first-frame, fps, the audio/video offset and the interrupt latency; `Recorder` writes what
arrives to an MP4 on its own thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

VIDEO_CLOCK = 90000
LOUD = 0.02  # audio amplitude counted as speech


@dataclass
class Received:
    """What arrived, with arrival times (time.monotonic) and track times (s from track start)."""

    video_t: list[float] = field(default_factory=list)  # track time of each video frame
    video_w: list[float] = field(default_factory=list)  # arrival
    video_frames: list[np.ndarray] = field(default_factory=list)  # kept only when asked
    audio_t: list[float] = field(default_factory=list)  # track time of each audio frame's start
    audio_w: list[float] = field(default_factory=list)
    video_change: list[float] = field(default_factory=list)  # mean |frame - previous frame|
    audio_peak: list[float] = field(default_factory=list)  # max |x| of each audio frame
    audio_rate: int = 48000
    events: list[tuple[float, dict]] = field(default_factory=list)  # (arrival, event)
    rtp: dict[str, dict[int, float]] = field(  # RTP timestamp -> first packet's arrival
        default_factory=lambda: {"video": {}, "audio": {}})

    def event(self, kind: str) -> dict | None:
        return next((e for _, e in self.events if e.get("type") == kind), None)


class Recorder:
    """Writes received frames to an MP4 on its own thread (encoding off the event loop)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.q: queue.Queue = queue.Queue(maxsize=2000)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import av

        container = av.open(str(self.path), "w", format="mp4")
        video = audio = None
        early: list[tuple] = []  # audio before the first video frame (the streams need its size)
        try:
            while True:
                item = self.q.get()
                if item is None:
                    break
                kind, t, data, rate = item
                if video is None:
                    if kind != "video":
                        early.append(item)
                        continue
                    video = container.add_stream("libx264", rate=25)
                    video.height, video.width = data.shape[:2]
                    video.pix_fmt = "yuv420p"
                    video.options = {"preset": "veryfast", "tune": "zerolatency"}
                    audio_rate = early[0][3] if early else 48000
                    audio = container.add_stream("aac", rate=audio_rate)
                    audio.layout = "mono"
                for kind, t, data, rate in [*early, item]:
                    if kind == "video":
                        f = av.VideoFrame.from_ndarray(data, format="rgb24")
                        f.pts, f.time_base = round(t * 25), Fraction(1, 25)
                        container.mux(video.encode(f))
                    elif rate == audio.rate:
                        f = av.AudioFrame.from_ndarray(data[None].astype(np.float32),
                                                       format="fltp", layout="mono")
                        f.sample_rate, f.pts = rate, round(t * rate)
                        f.time_base = Fraction(1, rate)
                        container.mux(audio.encode(f))
                early = []
            for s in (video, audio):
                if s is not None:
                    container.mux(s.encode())
        finally:
            container.close()

    def put(self, item: tuple) -> None:
        try:
            self.q.put_nowait(item)
        except queue.Full:
            log.warning("recorder is behind: frame dropped from the recording")

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(60)


def _unwrap(ts: int, first: int) -> int:
    return (ts - first) % (1 << 32)


def watch_rtp(receiver: Any, kind: str, rec: Received) -> None:
    """Note when the first packet of every RTP timestamp arrives, before any jitter buffer.

    aiortc hands each packet to `receiver._handle_rtp_packet`; wrapping it on this receiver
    object only (not the class) lets the client measure the stream's own timing, without the
    latency aiortc's jitter buffers add after arrival (audio: 4 packets of prefetch; video: one
    frame, until the next frame's first packet)."""
    handle = getattr(receiver, "_handle_rtp_packet", None)
    if handle is None:
        return
    seen = rec.rtp[kind]

    async def wrapped(packet: Any, arrival_time_ms: int) -> None:
        seen.setdefault(packet.timestamp, time.monotonic())
        await handle(packet, arrival_time_ms=arrival_time_ms)

    receiver._handle_rtp_packet = wrapped


def _lag(t: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted track times and arrival-minus-track-time (the delivery lag) of a stream."""
    order = np.argsort(t)
    return t[order], (w - t)[order]


def av_offset(vt: np.ndarray, vw: np.ndarray, at: np.ndarray, aw: np.ndarray,
              window: tuple[float, float] | None = None) -> float | None:
    """Median over video frames of (video delivery lag - lag of the audio packet holding the
    same instant), in ms; > 0: video arrives late relative to its audio."""
    if vt.size == 0 or at.size < 2:
        return None
    vt, vl = _lag(vt, vw)
    at, al = _lag(at, aw)
    ok = (vt >= at[0]) & (vt <= at[-1] + 0.02)
    if window is not None:
        ok &= (vt >= window[0]) & (vt <= window[1])
    if not ok.any():
        return None
    idx = np.clip(np.searchsorted(at, vt[ok], side="right") - 1, 0, at.size - 1)
    return round(float(np.median(vl[ok] - al[idx])) * 1000, 1)


def rtp_times(seen: dict[int, float], clock: int) -> tuple[np.ndarray, np.ndarray]:
    if not seen:
        return np.zeros(0), np.zeros(0)
    ts = np.array(list(seen.keys()), dtype=np.int64)
    w = np.array(list(seen.values()))
    first = ts[np.argmin(w)]
    return ((ts - first) % (1 << 32)) / clock, w


async def consume(track: Any, rec: Received, recorder: Recorder | None, keep_frames: bool) -> None:
    from aiortc.mediastreams import MediaStreamError

    first: int | None = None
    prev: np.ndarray | None = None
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        w = time.monotonic()
        first = frame.pts if first is None else first
        if track.kind == "video":
            t = _unwrap(frame.pts, first) / VIDEO_CLOCK
            rgb = frame.to_ndarray(format="rgb24")
            rec.video_t.append(t)
            rec.video_w.append(w)
            cur = rgb.astype(np.int16)
            rec.video_change.append(0.0 if prev is None else float(np.abs(cur - prev).mean()))
            prev = cur
            if keep_frames:
                rec.video_frames.append(rgb)
            if recorder is not None:
                recorder.put(("video", t, rgb, 0))
        else:
            rate = frame.sample_rate
            x = frame.to_ndarray().astype(np.float32).reshape(-1)
            channels = len(frame.layout.channels)
            x = x.reshape(-1, channels).mean(1) / 32768.0  # packed s16 -> mono float
            t = _unwrap(frame.pts, first) / rate
            rec.audio_rate = rate
            rec.audio_t.append(t)
            rec.audio_w.append(w)
            rec.audio_peak.append(float(np.abs(x).max()) if x.size else 0.0)
            if recorder is not None:
                recorder.put(("audio", t, x, rate))


def summarize(rec: Received, marks: dict[str, float]) -> dict:
    """The client's measurements (see the module docstring)."""
    vt, vw = np.array(rec.video_t), np.array(rec.video_w)
    at, aw = np.array(rec.audio_t), np.array(rec.audio_w)
    out: dict[str, Any] = {"frames": int(vt.size), "ttff_s": None, "fps": 0.0,
                           "av_offset_ms": None}
    if vt.size > 1:
        out["fps"] = round(float((vt.size - 1) / (vw[-1] - vw[0])), 2)
    playout, started = rec.event("playout"), rec.event("speech_started")
    if playout is not None and started is not None and "speech_sent" in marks and vt.size:
        tau = started["media_s"] - playout["media_s"]
        hit = np.flatnonzero(vt >= tau - 1e-6)
        if hit.size:
            out["ttff_s"] = round(float(vw[hit[0]] - marks["speech_sent"]), 3)
            out["ttff_voice_s"] = round(float(vw[hit[0]] - marks.get("voice_sent", marks["speech_sent"])), 3)
            out["speech_track_s"] = round(tau, 3)
    # A/V offset from packet arrivals (the stream itself), and from decoded frames (what a
    # player that shows frames as aiortc decodes them would see, its jitter buffers included).
    rvt, rvw = rtp_times(rec.rtp["video"], VIDEO_CLOCK)
    rat, raw = rtp_times(rec.rtp["audio"], rec.audio_rate)
    src = (rvt, rvw, rat, raw) if rvt.size and rat.size else (vt, vw, at, aw)
    if src[0].size:
        end = float(src[0].max())
        out["av_offset_ms"] = av_offset(*src, window=(end - 10.0, end))
        out["av_offset_first10s_ms"] = av_offset(*src, window=(0.0, 10.0))
    out["av_offset_decoded_ms"] = av_offset(vt, vw, at, aw)
    if "clear_sent" in marks and at.size:
        loud = np.flatnonzero(np.array(rec.audio_peak) > LOUD)
        if loud.size:
            out["interrupt_latency_s"] = round(float(aw[loud[-1]] - marks["clear_sent"]), 3)
        cleared, ended = rec.event("cleared"), rec.event("speech_ended")
        if cleared is not None and ended is not None:
            out["interrupt_media_s"] = round(ended["media_s"] - cleared["media_s"], 3)
    return out
