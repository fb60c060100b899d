"""`avatarstream bench server-soak`: does the server's memory level off under rounds of clients?

A real `avatarstream serve` process on loopback (tiny-random by default) and, per round,
`--clients` clients at once, each as a user of the web page or the API would be: open a session
(every fourth with HLS), open its WebSocket, every other one watch it over WebRTC (aiortc in this
process, receive-only) until the first frame, speak (TTS text or streamed PCM16), interrupt, then
either end the session (DELETE) or drop it: close everything and leave the server to reap it after
its idle timeout. After each round, once the server says no session is live, the server process's
resident memory (VmRSS) is read, a few seconds later (the server gives the memory of ended
sessions back at most every 5 s): `server_rss_mb_per_round`.

`levelled_off`: the median RSS of the last third of the rounds is within `--level-mb` of the
median of the middle third (the memory a server needs for its peak number of sessions is taken
in the first rounds; a leak keeps growing by about the same amount every round).
`growth_mb_per_round_second_half`: the least-squares slope of the second half of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.bench.soak_measure import PACKET, process_rss_mb
from avatarstream.errors import ConfigError, InputError

HELP = ("rounds of concurrent clients (open, watch, speak, interrupt, end or drop) against a "
        "server process: its RSS after each round, and whether it levels off")
KEY = "server-soak"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=6, help="rounds of clients (default 6)")
    p.add_argument("--clients", type=int, default=8, help="clients at once per round (default 8)")
    p.add_argument("--model", default="tiny-random", help="the server's model (default tiny-random)")
    p.add_argument("--idle-timeout", type=float, default=3.0,
                   help="the server's idle timeout: how soon a dropped session is reaped (default 3)")
    p.add_argument("--level-mb", type=float, default=24.0,
                   help="largest RSS growth from the middle third of the rounds to the last "
                        "third (medians) that counts as levelled off (default 24 MB)")
    p.add_argument("--server-args", default="", metavar="ARGS",
                   help="more `avatarstream serve` options, one string (e.g. \"--threads 2\")")


def _check(args: argparse.Namespace) -> None:
    if args.rounds < 3:
        raise ConfigError("--rounds must be at least 3 (levelling off compares the middle and "
                          "the last third of the rounds)")
    if args.clients < 1:
        raise ConfigError("--clients must be at least 1")
    if not args.idle_timeout > 0:
        raise ConfigError("--idle-timeout must be positive (seconds)")
    try:
        shlex.split(args.server_args)
    except ValueError as e:
        raise ConfigError(f"--server-args: {e}") from e
    from avatarstream.serve.webrtc import require_aiortc

    require_aiortc()


async def _request(http: Any, method: str, url: str, **kw: Any) -> dict:
    async with http.request(method, url, **kw) as r:
        body = await r.json(content_type=None) if r.status not in (204,) else {}
        if r.status >= 400:
            raise InputError(f"{method} {url}: HTTP {r.status}: {(body or {}).get('error', r.reason)}")
        return body or {}


async def _watch(http: Any, url: str, s: dict, timeout: float) -> int:
    """A receive-only WebRTC viewer of session `s` until its first video frame; returns the
    frames received (the connection is closed by the caller's cancel)."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.mediastreams import MediaStreamError

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    first = asyncio.get_running_loop().create_future()
    frames = [0]

    @pc.on("track")
    def on_track(track: Any) -> None:
        async def pull() -> None:
            while True:
                try:
                    await track.recv()
                except MediaStreamError:  # the connection was closed
                    return
                if track.kind == "video":
                    frames[0] += 1
                    if not first.done():
                        first.set_result(None)

        asyncio.ensure_future(pull())

    try:
        for kind in ("video", "audio"):
            pc.addTransceiver(kind, direction="recvonly")
        await pc.setLocalDescription(await pc.createOffer())
        answer = await _request(http, "POST", url + s["offer_url"],
                                json={"sdp": pc.localDescription.sdp, "type": "offer"})
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
        await asyncio.wait_for(first, timeout)
        await asyncio.sleep(0.5)
    finally:
        await pc.close()
    return frames[0]


async def _client(http: Any, url: str, avatar: str, i: int, speech: bytes, timeout: float) -> dict:
    """One client: open, (watch), speak, interrupt, then end (DELETE) or drop the session."""
    import aiohttp

    s = await _request(http, "POST", url + "/v1/sessions",
                       json={"avatar_id": avatar, "hls": i % 4 == 0})
    ws = await http.ws_connect(url + s["audio_url"])
    frames, ended = 0, []

    async def events() -> None:  # a session that ends on its own says why
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT and '"session_ended"' in msg.data:
                ended.append(json.loads(msg.data))

    async def keep_alive() -> None:  # a slow first frame is not an idle session
        while True:
            await ws.send_json({"type": "keep_alive"})
            await asyncio.sleep(1.0)

    reader, alive = asyncio.ensure_future(events()), asyncio.ensure_future(keep_alive())
    try:
        if i % 2 == 0:
            frames = await _watch(http, url, s, timeout)
        if i % 3 == 1:
            await ws.send_json({"type": "text", "text": "Hello, this is a round of the soak."})
        else:
            for pos in range(0, len(speech), 2 * PACKET):
                await ws.send_bytes(speech[pos : pos + 2 * PACKET])
                await asyncio.sleep(PACKET / 16000)
        await asyncio.sleep(0.3)
        await ws.send_json({"type": "clear_buffer"})
        await asyncio.sleep(0.2)
    finally:
        alive.cancel()
        await ws.close()
        reader.cancel()
    if ended:
        raise InputError(f"the session ended early: {ended[0]}")
    dropped = i % 3 == 2
    if not dropped:
        await _request(http, "DELETE", f"{url}/v1/sessions/{s['session_id']}")
    return {"frames": frames, "dropped": dropped}


async def _live(http: Any, url: str) -> int:
    return int((await _request(http, "GET", url + "/v1/server"))["live_sessions"])


async def _rounds(url: str, pid: int, args: argparse.Namespace) -> dict:
    import aiohttp

    from avatarstream.bench.inputs import face_image, speechlike, write_png
    from avatarstream.serve.sessions import TRIM_EVERY_S
    from avatarstream.serve.webrtc import use_host_addresses

    use_host_addresses(["127.0.0.1"])
    settle_s = TRIM_EVERY_S + 2.0  # once no session is live, before the RSS is read
    speech = (np.clip(speechlike(1.0, seed=5), -1, 1) * 32767).astype("<i2").tobytes()
    per_round, live_left, errors, frames = [], [], [], []
    timeout = 60.0
    with tempfile.TemporaryDirectory(prefix="avatarstream-server-soak-") as d:
        png = write_png(Path(d) / "face.png", face_image(96)).read_bytes()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
        avatar = (await _request(http, "POST", url + "/v1/avatars", data=png,
                                 headers={"Content-Type": "image/png"}))["id"]
        start = process_rss_mb(pid)
        for _ in range(args.rounds):
            got = await asyncio.gather(*(_client(http, url, avatar, i, speech, timeout)
                                         for i in range(args.clients)), return_exceptions=True)
            errors += [f"{type(g).__name__}: {g}" for g in got if isinstance(g, BaseException)]
            frames.append(sum(g["frames"] for g in got if isinstance(g, dict)))
            deadline = time.monotonic() + args.idle_timeout + 15.0
            while (live := await _live(http, url)) and time.monotonic() < deadline:
                await asyncio.sleep(0.25)  # dropped sessions: reaped after the idle timeout
            await asyncio.sleep(settle_s)  # the reaper's last closes and the memory it frees
            live_left.append(live)
            per_round.append(process_rss_mb(pid))
    return {"server_rss_mb_start": _r(start), "server_rss_mb_per_round": [_r(m) for m in per_round],
            "sessions_live_after_round": live_left, "video_frames_per_round": frames,
            "client_errors": errors[:10], "client_error_count": len(errors)}


def _r(mb: float | None) -> float | None:
    return None if mb is None else round(mb, 1)


def verdict(rss: list[float | None], level_mb: float) -> dict:
    """`levelled_off` and the growth figures from the RSS after each round (None: not read).

    The rounds in thirds: the growth from the median of the middle third to the median of the
    last (medians: one round that ends with more memory in use does not decide it), and the
    least-squares slope over the second half in MB per round."""
    if len(rss) < 3 or any(m is None for m in rss):
        return {"levelled_off": None, "growth_mb_middle_to_last_third": None,
                "growth_mb_per_round_second_half": None}
    x = np.asarray(rss, np.float64)
    third = len(x) // 3
    growth = float(np.median(x[-third:]) - np.median(x[third : len(x) - third]))
    half = x[len(x) // 2 :]
    slope = float(np.polyfit(np.arange(half.size), half, 1)[0]) if half.size > 1 else 0.0
    return {"levelled_off": bool(growth <= level_mb),
            "growth_mb_middle_to_last_third": round(growth, 1),
            "growth_mb_per_round_second_half": round(slope, 2)}


def run(args: argparse.Namespace) -> dict:
    from avatarstream.serve.client import ServerProcess

    _check(args)
    extra = tuple(shlex.split(args.server_args))
    serve_args = ("--api-key", KEY, "--max-sessions", str(args.clients), "--idle-timeout",
                  str(args.idle_timeout), "--playout-delay", "0.3", *extra)
    with tempfile.TemporaryDirectory(prefix="avatarstream-server-soak-") as d:
        t0 = time.monotonic()
        with ServerProcess(Path(d) / "serve", model=args.model, args=serve_args,
                           timeout=600) as server:
            try:
                out = asyncio.run(_rounds(server.url, server.proc.pid, args))
            except (InputError, OSError) as e:
                tail = server.log.read_text(errors="replace").strip().splitlines()[-5:]
                raise InputError(f"the soak failed: {e}\nserver log:\n" + "\n".join(tail)) from e
        wall = time.monotonic() - t0
    return {"model": args.model, "rounds": args.rounds, "clients": args.clients,
            "idle_timeout_s": args.idle_timeout, "server_args": list(extra), **out,
            **verdict(out["server_rss_mb_per_round"], args.level_mb), "level_mb": args.level_mb,
            "wall_s": round(wall, 1)}

