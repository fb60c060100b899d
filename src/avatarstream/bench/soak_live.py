"""`bench soak`'s live part: one session of a real `avatarstream serve` process on loopback,
received over WebRTC by an aiortc client in this process (as a browser would), for the whole track.

The client uploads the reference, opens a session, sends its WebRTC offer (receive-only audio
and video), and streams the track's PCM16 over the session's WebSocket at real time, 40 ms a
message, silence included (a microphone). Meanwhile it records every RTP timestamp's first
packet arrival and every decoded frame (serve/receive.py), and every few seconds the server
process's resident memory and the session's `late_frames` / `lag_s` (GET /v1/sessions/{id}).

Measures per minute of the received tracks (see `report`):
- `av_offset_ms`: median over the minute's video frames of (arrival of the frame's first RTP
  packet - its RTP track time) - (the same for the audio packet that holds the same instant);
  > 0: video late. The server stamps both tracks on one session timeline (RTP time 0 of each is
  the same media instant, serve/webrtc.py) and paces each packet out at its time, so on loopback
  this is the skew between what the two tracks deliver for one instant: what a player that plays
  packets as they come shows, and what a browser's lip sync sees too (aiortc's RTCP sender reports
  map each track's RTP clock to the wall time its last packet was sent, i.e. these arrivals).
- `av_offset_decoded_ms`: the same from when aiortc's decoders hand the frames out (its jitter
  buffers included: what a player without lip sync that shows frames as decoded would see).
- `onset_offset_ms`: per utterance, track time of the first talking video frame (the server's
  `speech_started` frame) minus track time of the first loud received audio frame after it; the
  content check that the voice and the talking face start on the same instant (median of the
  minute's utterances).
- `dropped` / `duplicated`: from the decoded frames' pts (one frame = 3600 at 90 kHz): a step of
  more than one frame counts the frames missing, a step of zero or back counts a duplicate.
- `repeated_late`: frames the server's playout repeated because the model's frame was not ready
  in time (the viewer sees the previous picture twice; pts stay continuous, so only the server
  can count them): the growth of the session's `late_frames` over the minute.
- `rss_mb` / `rss_min_mb` / `rss_max_mb`: the server process's VmRSS, median / floor / peak of
  the minute's samples (every 2 s); `rss_growth_pct_*` in soak_measure.growth_pct.
- `lag_max_s`: the largest scheduler lag behind the wall clock the session reported.
- `load_1m`: the machine's 1-minute load average (median of the samples): the other work a late
  minute competed with.
`repeated_late_pct` (all minutes) and `realtime` (at most 1 % repeated); `speech_received_pct`:
loud 20 ms audio frames received / sent (< 100: speech the session published after its playout
time, which the audio track, the master clock, replaced by silence).
`ttff_after_pause_s`: per utterance, from sending the packet that ends the pause (the first the
server counts as speech) to the arrival of the first decoded video frame at or after the media time
of the `speech_started` event it caused.
"""

from __future__ import annotations

import asyncio
import json
import mimetypes
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.bench.soak_measure import (PACKET, SpeechTrack, frame_steps, growth_keys,
                                            in_window, median_or_none, minute_windows,
                                            process_rss_mb, rss_per_window)
from avatarstream.errors import InputError
from avatarstream.serve.receive import (LOUD, VIDEO_CLOCK, Received, av_offset, consume,
                                        rtp_times, watch_rtp)

POLL_S = 2.0  # memory samples
STATS_EVERY = 5  # session stats every this many memory samples
REALTIME_LATE_PCT = 1.0


class _Log:
    """What the client saw besides the tracks: send times of each utterance's first voiced
    packet, memory samples, session stats, `slow_down` answers."""

    def __init__(self) -> None:
        self.voiced_sent: list[float] = []
        self.rss: list[tuple[float, float, float]] = []  # (wall, MB, 1-minute load average)
        self.stats: list[tuple[float, int, float]] = []  # (wall, late_frames, lag_s)
        self.slow_downs = 0
        self.loud_sent_s = 0.0
        self.session: dict = {}


async def _request(http: Any, method: str, url: str, **kw: Any) -> dict:
    async with http.request(method, url, **kw) as r:
        body = await r.json(content_type=None) if r.status != 204 else {}
        if r.status >= 400:
            raise InputError(f"{method} {url}: HTTP {r.status}: {(body or {}).get('error', r.reason)}")
        return body or {}


async def _poll(http: Any, url: str, pid: int, log: _Log) -> None:
    i = 0
    while True:
        mb = process_rss_mb(pid)
        if mb is not None:
            log.rss.append((time.monotonic(), mb, os.getloadavg()[0]))
        if i % STATS_EVERY == 0:
            await _stats(http, url, log)
        i += 1
        await asyncio.sleep(POLL_S)


async def _stats(http: Any, url: str, log: _Log) -> None:
    try:
        st = await _request(http, "GET", url)
    except (InputError, OSError):  # one missed sample is not a failure of the run
        return
    log.stats.append((time.monotonic(), int(st.get("late_frames", 0)), float(st.get("lag_s", 0.0))))


async def _stream(ws: Any, track: SpeechTrack, rec: Received, log: _Log) -> None:
    """The track as PCM16 packets at real time; notes when each utterance's voice is sent."""
    pcm = (np.clip(track.samples, -1, 1) * 32767).astype("<i2")
    blocks = track.samples[: track.samples.size // 320 * 320].reshape(-1, 320)  # [N, 20 ms]
    log.loud_sent_s = 0.02 * int((np.abs(blocks).max(axis=1) > LOUD).sum())
    voiced = set(track.voiced)
    seen = 0
    t0 = time.monotonic()
    for i in range(pcm.size // PACKET):
        if i in voiced:
            log.voiced_sent.append(time.monotonic())
        await ws.send_bytes(pcm[i * PACKET : (i + 1) * PACKET].tobytes())
        events = rec.events[seen:]
        seen += len(events)
        log.slow_downs += sum(1 for _, e in events if e.get("type") == "slow_down")
        if any(e.get("type") == "session_ended" for _, e in events):
            raise InputError(f"the server ended the session: {[e for _, e in events]}")
        await asyncio.sleep(max(0.0, t0 + (i + 1) * PACKET / track.sample_rate - time.monotonic()))
    await ws.send_json({"type": "end_of_speech"})


async def drive(server_url: str, pid: int, reference: Path, track: SpeechTrack, *,
                tail_s: float = 3.0, timeout: float = 300.0) -> tuple[Received, _Log]:
    """One session as described in the module docstring; returns what arrived and the log."""
    import aiohttp
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    from avatarstream.serve.webrtc import use_host_addresses

    use_host_addresses(["127.0.0.1"])  # the server is on loopback
    rec, log = Received(), _Log()
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    tasks: list[asyncio.Task] = []
    base = server_url.rstrip("/")
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer soak"}) as http:
        kind = mimetypes.guess_type(reference.name)[0] or "image/png"
        avatar = await _request(http, "POST", base + "/v1/avatars", data=reference.read_bytes(),
                                headers={"Content-Type": kind})
        log.session = s = await _request(http, "POST", base + "/v1/sessions", json={"avatar_id": avatar["id"]})
        session_url = f"{base}/v1/sessions/{s['session_id']}"
        ws = await http.ws_connect(base + s["audio_url"])

        async def events() -> None:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    rec.events.append((time.monotonic(), json.loads(msg.data)))

        pc.on("track", lambda t: tasks.append(asyncio.ensure_future(consume(t, rec, None, False))))
        for kind in ("video", "audio"):
            watch_rtp(pc.addTransceiver(kind, direction="recvonly").receiver, kind, rec)
        tasks += [asyncio.ensure_future(events()), asyncio.ensure_future(_poll(http, session_url, pid, log))]
        await pc.setLocalDescription(await pc.createOffer())
        answer = await _request(http, "POST", base + s["offer_url"],
                                json={"sdp": pc.localDescription.sdp, "type": pc.localDescription.type})
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
        try:
            deadline = time.monotonic() + timeout
            while not rec.video_t:  # the avatar idles on screen before anyone speaks
                if time.monotonic() > deadline:
                    raise InputError("no video arrived from the server")
                await asyncio.sleep(0.05)
            await _stream(ws, track, rec, log)
            await asyncio.sleep(tail_s)
            await _stats(http, session_url, log)
        finally:
            for t in tasks:
                t.cancel()
            await pc.close()
            await ws.close()
            try:
                await _request(http, "DELETE", session_url)
            except InputError:
                pass
    return rec, log


def ttff_after_pauses(voiced_sent: list[float], events: list[tuple[float, dict]],
                      video_t: np.ndarray, video_w: np.ndarray) -> list[float | None]:
    """Per utterance: first decoded frame at or after its `speech_started` media time (mapped
    onto the track by the `playout` event) minus the send time of its voice; None where the
    server never started it."""
    playout = next((e for _, e in events if e.get("type") == "playout"), None)
    started = [(w, e) for w, e in events if e.get("type") == "speech_started"]
    out: list[float | None] = []
    for sent in voiced_sent:
        ev = next((e for w, e in started if w >= sent), None)
        hit = np.empty(0, np.int64)
        if ev is not None and playout is not None:
            hit = np.flatnonzero(video_t >= ev["media_s"] - playout["media_s"] - 1e-6)
        out.append(round(float(video_w[hit[0]] - sent), 3) if hit.size else None)
    return out


def _onsets(rec: Received, vt_end: float) -> tuple[np.ndarray, np.ndarray]:
    """(track time, offset ms) of each utterance: first talking frame - first loud audio."""
    playout = rec.event("playout")
    if playout is None:
        return np.zeros(0), np.zeros(0)
    a_t, peak = np.array(rec.audio_t), np.array(rec.audio_peak)
    times, offs = [], []
    for _, e in rec.events:
        if e.get("type") != "speech_started":
            continue
        tau = e["media_s"] - playout["media_s"]
        loud = np.flatnonzero((a_t >= tau - 0.2) & (a_t < tau + 1.0) & (peak > LOUD))
        if 0 <= tau < vt_end and loud.size:
            times.append(tau)
            offs.append(1000.0 * (tau - a_t[loud[0]]))
    return np.array(times), np.array(offs)


def _loud_received_s(rec: Received) -> float:
    """Seconds of received audio frames louder than LOUD (each frame's length from the next's
    track time; aiortc hands out 20 ms frames)."""
    t, peak = np.array(rec.audio_t), np.array(rec.audio_peak)
    if t.size < 2:
        return 0.0
    length = np.diff(t, append=t[-1] + np.median(np.diff(t)))  # [N] s
    return float(length[peak > LOUD].sum())


def _cumulative_at(stats: list[tuple[float, int, float]], wall: float) -> int:
    before = [late for w, late, _ in stats if w <= wall]
    return before[-1] if before else 0


def report(rec: Received, log: _Log, seconds: float) -> dict:
    """The live part's JSON (module docstring): per minute, and over the whole run."""
    vt, vw = np.array(rec.video_t), np.array(rec.video_w)
    at, aw = np.array(rec.audio_t), np.array(rec.audio_w)
    rvt, rvw = rtp_times(rec.rtp["video"], VIDEO_CLOCK)
    rat, raw = rtp_times(rec.rtp["audio"], rec.audio_rate)
    if vt.size < 2:
        raise InputError("no video arrived from the server")
    lag = float(np.median(vw - vt))  # wall = track time + lag
    fps = int(log.session.get("fps", 25))
    missing, repeat = frame_steps(np.round(vt * fps).astype(np.int64))  # frame index from pts
    onset_t, onset_ms = _onsets(rec, float(vt.max()))
    rss_w, rss_mb, load = (np.array(x) for x in zip(*log.rss)) if log.rss else (np.zeros(0),) * 3
    rss_w = rss_w - lag
    per_minute = []
    for m, win in enumerate(minute_windows(min(seconds, float(vt.max())))):
        ok = in_window(vt, win)
        lags = [lg for w, _, lg in log.stats if win[0] <= w - lag < win[1]]
        per_minute.append({
            "minute": m + 1, "seconds": round(win[1] - win[0], 1),
            "av_offset_ms": av_offset(rvt, rvw, rat, raw, window=win),
            "av_offset_decoded_ms": av_offset(vt, vw, at, aw, window=win),
            "onset_offset_ms": median_or_none(onset_ms[in_window(onset_t, win)]),
            "frames": int(ok.sum()), "dropped": int(missing[ok].sum()), "duplicated": int(repeat[ok].sum()),
            "repeated_late": _cumulative_at(log.stats, win[1] + lag) - _cumulative_at(log.stats, win[0] + lag),
            **rss_per_window(rss_w, rss_mb, win),
            "lag_max_s": round(max(lags), 3) if lags else None,
            "load_1m": median_or_none(load[in_window(rss_w, win)], 2),
        })
    ttff = ttff_after_pauses(log.voiced_sent, rec.events, vt, vw)
    done = [t for t in ttff if t is not None]
    late = sum(m["repeated_late"] for m in per_minute)
    late_pct = round(100.0 * late / max(1, sum(m["frames"] for m in per_minute)), 2)
    return {
        "per_minute": per_minute, "ttff_after_pause_s": ttff,
        "ttff_median_s": median_or_none(done, 3), "ttff_max_s": max(done) if done else None,
        **growth_keys(per_minute),
        "frames": int(vt.size), "fps": round(float((vt.size - 1) / (vw[-1] - vw[0])), 2),
        "utterances": len(log.voiced_sent), "slow_downs": log.slow_downs,
        "late_frames": log.stats[-1][1] if log.stats else None,
        # real time: at most 1 % of the frames repeated because the model's was not ready
        "repeated_late_pct": late_pct, "realtime": late_pct <= REALTIME_LATE_PCT,
        "speech_received_pct": round(100.0 * _loud_received_s(rec) / log.loud_sent_s, 1) if log.loud_sent_s else None,
        "playout_delay_s": log.session.get("playout_delay_s"),
    }
