"""`avatarstream client`: talk to a server the way the web page does, and measure what arrives.

    avatarstream client --server http://127.0.0.1:8000 (--avatar FILE | --avatar-id ID)
        (--text TEXT | --audio FILE) [--token KEY] --out FILE [--json]

Uploads the avatar (or uses an existing one), opens a session, receives it over WebRTC (aiortc,
offer/answer, no STUN), opens the session's WebSocket, waits for the first frame, then speaks:
text through the server's TTS, or the audio file streamed as PCM16 at real time (as a microphone
would, honouring `slow_down`). It records what it receives to `--out` (H.264 + AAC MP4, timed as
received) and reports, as one JSON object on its last line:

- `ttff_s`: from the first audio packet (or the text) leaving the client to the arrival of the
  first video frame of the speech (the frame at the media time the server's `speech_started`
  event names, mapped onto the tracks by the `playout` event);
- `ttff_voice_s`: the same from the first audio packet the server counts as speech (louder than
  its pause threshold, -50 dBFS; the packets of silence a file or microphone starts with are not
  spoken yet); equal to `ttff_s` for text;
- `fps`: video frames received per second;
- `av_offset_ms`: arrival time of video minus arrival time of the audio of the same media
  instant (median over the last 10 s; > 0: video late);
- `frames`: video frames received; plus the interrupt latency when `--interrupt-after` is used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import mimetypes
import time
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.errors import ConfigError, InputError
from avatarstream.serve.receive import (LOUD, Received, Recorder, av_offset, consume,
                                        summarize, watch_rtp)

log = logging.getLogger(__name__)

__all__ = ["LOUD", "Received", "ServerProcess", "av_offset", "run_client"]


def _content_type(path: Path) -> str:
    ctype = mimetypes.guess_type(path.name)[0] or ""
    return {"audio/x-wav": "audio/wav", "video/x-matroska": "video/x-matroska"}.get(ctype, ctype)


def quiet_url(url: str) -> str:
    """`url` without its query: session URLs carry the session's token, never put in a message."""
    return url.split("?", 1)[0]


def prepare_ice(server: str) -> None:
    """The same rule as the server: loopback ICE candidates for a loopback server, else this
    machine's addresses."""
    from urllib.parse import urlsplit

    from avatarstream.serve.webrtc import is_loopback_host, use_host_addresses

    use_host_addresses(["127.0.0.1"] if is_loopback_host(urlsplit(server).hostname or "") else None)


async def api_call(http: Any, server: str, method: str, url: str, **kw: Any) -> dict:
    """One call of the server's API; its JSON answer, or InputError with the server's reason
    (the URL in the message without its query: no token)."""
    async with http.request(method, server + url, **kw) as r:
        body = await r.json(content_type=None) if r.status != 204 else {}
        if r.status >= 400:
            reason = body.get("error", r.reason) if isinstance(body, dict) else r.reason
            raise InputError(f"{method} {quiet_url(url)}: HTTP {r.status}: {reason}")
        return body or {}


async def open_session(http: Any, server: str, *, avatar: Path | None = None,
                       avatar_id: str | None = None, body: dict | None = None) -> tuple[str, dict]:
    """Upload the avatar (unless `avatar_id` names one) and open a session on it; returns
    (avatar id, the server's session answer: session_id, token, audio_url, offer_url, ...)."""
    if avatar is None and avatar_id is None:
        raise InputError("name the avatar: a file to upload or the id of one uploaded before")
    if avatar is not None:
        data = avatar.read_bytes()
        avatar_id = (await api_call(http, server, "POST", "/v1/avatars", data=data,
                                    headers={"Content-Type": _content_type(avatar)}))["id"]
    s = await api_call(http, server, "POST", "/v1/sessions",
                       json={"avatar_id": avatar_id, **(body or {})})
    return str(avatar_id), s


async def receive_webrtc(pc: Any, http: Any, server: str, offer_url: str) -> None:
    """Make `pc` receive the session's video and audio tracks (recvonly; offer/answer, the
    candidates in the SDP). Attach `pc.on("track")` and the receivers' watchers first."""
    from aiortc import RTCSessionDescription

    await pc.setLocalDescription(await pc.createOffer())
    answer = await api_call(http, server, "POST", offer_url, json={
        "sdp": pc.localDescription.sdp, "type": pc.localDescription.type})
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))


async def run_client(server: str, *, api_key: str, avatar: Path | None = None,
                     avatar_id: str | None = None, text: str | None = None,
                     audio: Path | np.ndarray | None = None, voice: str | None = None,
                     out: Path | None = None, interrupt_after: float | None = None,
                     tail_s: float = 1.0, timeout: float = 120.0, keep_frames: bool = False,
                     session_body: dict | None = None) -> tuple[dict, Received]:
    """One session as the web page runs it; returns (summary, everything received)."""
    import aiohttp
    from aiortc import RTCConfiguration, RTCPeerConnection

    server = server.rstrip("/")
    prepare_ice(server)
    headers = {"Authorization": f"Bearer {api_key}"}
    rec, marks = Received(), {}
    recorder = Recorder(out) if out is not None else None
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(headers=headers) as http:

        async def call(method: str, url: str, **kw: Any) -> dict:
            return await api_call(http, server, method, url, **kw)

        avatar_id, s = await open_session(http, server, avatar=avatar, avatar_id=avatar_id,
                                          body=session_body)
        ws = await http.ws_connect(server + s["audio_url"])

        async def events() -> None:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    rec.events.append((time.monotonic(), json.loads(msg.data)))

        tasks.append(asyncio.ensure_future(events()))

        @pc.on("track")
        def on_track(track: Any) -> None:
            tasks.append(asyncio.ensure_future(consume(track, rec, recorder, keep_frames)))

        for kind in ("video", "audio"):
            watch_rtp(pc.addTransceiver(kind, direction="recvonly").receiver, kind, rec)
        await receive_webrtc(pc, http, server, s["offer_url"])
        deadline = time.monotonic() + timeout
        try:
            while not rec.video_t:  # the avatar is idling on screen
                if time.monotonic() > deadline:
                    raise InputError("no video arrived from the server")
                await asyncio.sleep(0.02)
            await _speak(ws, rec, marks, text, voice, audio, interrupt_after, deadline)
            await _wait_played(rec, tail_s, deadline)
        finally:
            for t in tasks:
                t.cancel()
            await pc.close()
            try:
                await call("DELETE", f"/v1/sessions/{s['session_id']}")
            except InputError:
                pass
            await ws.close()
            if recorder is not None:
                await asyncio.to_thread(recorder.close)
    summary = summarize(rec, marks)
    summary["session_id"] = s["session_id"]
    summary["avatar_id"] = avatar_id
    return summary, rec


async def _speak(ws: Any, rec: Received, marks: dict, text: str | None, voice: str | None,
                 audio: Path | np.ndarray | None, interrupt_after: float | None,
                 deadline: float) -> None:
    if text is not None:
        marks["speech_sent"] = time.monotonic()
        await ws.send_json({"type": "text", "text": text, **({"voice": voice} if voice else {})})
        if interrupt_after is not None:
            await asyncio.sleep(interrupt_after)
            marks["clear_sent"] = time.monotonic()
            await ws.send_json({"type": "clear_buffer"})
        return
    from avatarstream.media.audio import read_all
    from avatarstream.live.session import LiveSessionConfig

    silence_rms = LiveSessionConfig.silence_rms  # what the server counts as a pause

    x = read_all(audio) if isinstance(audio, Path) else np.asarray(audio, np.float32)
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    packet = 640  # 40 ms, sent at real time like a microphone
    t0 = time.monotonic()
    marks["speech_sent"] = t0
    n_slow = len([e for _, e in rec.events if e.get("type") == "slow_down"])
    for i, pos in enumerate(range(0, pcm.size, packet)):
        if interrupt_after is not None and time.monotonic() - t0 >= interrupt_after:
            marks["clear_sent"] = time.monotonic()
            await ws.send_json({"type": "clear_buffer"})
            break
        if "voice_sent" not in marks and _rms(x[pos : pos + packet]) >= silence_rms:
            marks["voice_sent"] = time.monotonic()  # the server's speech starts with this packet
        await ws.send_bytes(pcm[pos : pos + packet].tobytes())
        await asyncio.sleep(max(0.0, t0 + (i + 1) * packet / 16000 - time.monotonic()))
        slow = len([e for _, e in rec.events if e.get("type") == "slow_down"])
        if slow > n_slow:  # not expected at real time; resend after a pause
            n_slow = slow
            await asyncio.sleep(0.2)
            await ws.send_bytes(pcm[pos : pos + packet].tobytes())
        if time.monotonic() > deadline:
            raise InputError("the server did not take the audio in time")
    await ws.send_json({"type": "end_of_speech"})


async def _wait_played(rec: Received, tail_s: float, deadline: float) -> None:
    """Until the utterance has ended and `tail_s` past its end has arrived (or the deadline)."""
    while time.monotonic() < deadline:
        ended, playout = rec.event("speech_ended"), rec.event("playout")
        if ended is not None and playout is not None and rec.video_t:
            if rec.video_t[-1] >= ended["media_s"] - playout["media_s"] + tail_s:
                return
        await asyncio.sleep(0.05)
    raise InputError("the speech did not finish playing before the timeout")


class ServerProcess:
    """`avatarstream serve` in a child process on a free loopback port, for scripts and tests.

        with ServerProcess(tmp / "data", model="tiny-random") as server:
            summary, received = asyncio.run(run_client(server.url, ...))
    """

    def __init__(self, data_dir: Path, *, model: str = "tiny-random", args: tuple[str, ...] = (),
                 threads: int = 1, timeout: float = 180.0, log: Path | None = None) -> None:
        """log: where the server's stderr goes (default: server.log in the data folder)."""
        self.data_dir, self.model, self.args = Path(data_dir), model, args
        self.threads, self.timeout = threads, timeout
        self.log = Path(log) if log is not None else self.data_dir / "server.log"
        self.port = 0
        self.proc: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        import socket
        import subprocess
        import sys
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "avatarstream.cli", "serve", "--port", str(self.port),
               "--data-dir", str(self.data_dir), "--model", self.model,
               "--threads", str(self.threads), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                     stderr=self.log.open("w"))
        deadline = time.monotonic() + self.timeout
        # a server with --api-key answers /v1/server to one of its keys only
        keys = [v for k, v in zip(self.args, self.args[1:]) if k == "--api-key"]
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        while True:
            try:
                req = urllib.request.Request(self.url + "/v1/server", headers=headers)
                with urllib.request.urlopen(req, timeout=2) as r:
                    self.info = json.loads(r.read())
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError("the server did not start:\n" + self.log.read_text()[-2000:])
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        import signal
        import subprocess

        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # aiohttp closes its sessions cleanly on SIGINT
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


# -- command line -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--avatar", help="reference image or video to upload")
    g.add_argument("--avatar-id", help="an avatar already uploaded with the same key")
    g2 = p.add_mutually_exclusive_group(required=True)
    g2.add_argument("--text", help="text for the server's TTS to speak")
    g2.add_argument("--audio", help="speech file, streamed at real time as PCM16")
    p.add_argument("--token", default="avatarstream-client", help="API key (bearer)")
    p.add_argument("--voice", default=None, help="TTS voice (see GET /v1/voices)")
    p.add_argument("--out", required=True, help="MP4 file to record what arrives into")
    p.add_argument("--interrupt-after", type=float, default=None, metavar="S",
                   help="send clear_buffer S seconds after the speech starts")
    p.add_argument("--tail", type=float, default=1.0, help="seconds to keep watching after speech")
    p.add_argument("--timeout", type=float, default=120.0)


def run(args: argparse.Namespace) -> dict:
    from avatarstream.serve.webrtc import require_aiortc

    require_aiortc()
    out = Path(args.out)
    if out.is_dir() or not (out.parent if str(out.parent) else Path(".")).is_dir():
        raise ConfigError(f"cannot write {out}: give a file in an existing folder")
    avatar = Path(args.avatar) if args.avatar else None
    if avatar is not None and not avatar.is_file():
        raise InputError(f"avatar {avatar} not found")
    audio = Path(args.audio) if args.audio else None
    if audio is not None and not audio.is_file():
        raise InputError(f"audio {audio} not found")
    import aiohttp

    try:
        summary, _ = asyncio.run(run_client(
            args.server, api_key=args.token, avatar=avatar, avatar_id=args.avatar_id,
            text=args.text, audio=audio, voice=args.voice, out=out,
            interrupt_after=args.interrupt_after, tail_s=args.tail, timeout=args.timeout))
    except aiohttp.ClientError as e:
        raise InputError(f"cannot talk to the server at {args.server}: {e}") from e
    summary["out"] = str(out)
    return summary


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if x.size else 0.0
