"""Session routes: create, status, WebRTC offer/answer, the audio WebSocket, TTS, control, HLS.

The WebSocket carries binary PCM16 mono 16 kHz speech and JSON text messages both ways:
client -> server `{"type": "end_of_speech" | "clear_buffer" | "keep_alive"}`,
`{"type": "text", "text": ..., "voice": ...}` and `{"type": "listening", "on": true | false}`
(the user started / stopped speaking: the avatar listens, closed mouth and idle motion, and the
session does not time out meanwhile; speech already queued still plays, `clear_buffer` cuts it);
server -> client `slow_down` (a packet did not fit the speech buffer: send it again later),
`cleared`, `queued`, `error`, and the session's events (`playout`, `speech_started`,
`speech_ended`, `listening`, `session_ended`). An audio packet of up to
`Limits.max_packet_bytes` is taken; a larger one closes the socket with 1009 (message too big) and
a reason that says the limit.
"""

from __future__ import annotations

import asyncio
import re
import secrets

from aiohttp import WSCloseCode, WSMsgType, web

from avatarstream.errors import AvatarStreamError, InputError
from avatarstream.serve.common import AVATARS, CONFIG, SESSIONS, TTS, api_key, error, read_json
from avatarstream.serve.avatars import key_fingerprint
from avatarstream.serve.guards import caller_key, resolved
from avatarstream.serve.hls import NAME as HLS_NAME
from avatarstream.serve.hls import PLAYLIST
from avatarstream.serve.limits import parse_json
from avatarstream.serve.rtmp_gate import RTMPGate, RTMPRefused
from avatarstream.serve.sessions import AdmissionError, Entry

_SESSION_ID = re.compile(r"^[0-9a-f]{24}$")
# A message up to this many times its limit is read and refused with a reason; beyond, aiohttp
# closes with 1009 before reading it (the memory a socket can hold stays bounded).
_READ_OVER_LIMIT = 4
ROUTES = web.RouteTableDef()  # each handler's method and path stand above it
RTMP_GATE: web.AppKey[RTMPGate] = web.AppKey("rtmp_gate", RTMPGate)


async def _entry(request: web.Request) -> Entry | web.Response:
    """The session named in the path, if the caller holds its token or its owner's key."""
    sid = request.match_info["id"]
    manager = request.app[SESSIONS]
    entry = manager.entries.get(sid) if _SESSION_ID.match(sid) else None
    key = api_key(request)
    token = request.query.get("token")
    if key is None and token is None:
        return error(401, "send `Authorization: Bearer KEY` or the session's ?token=")
    if entry is None:
        return error(404, "no such session")
    if not ((token is not None and secrets.compare_digest(token.encode(), entry.token.encode()))
            or (key is not None and key_fingerprint(key) == entry.owner)):
        return error(404, "no such session")
    return entry


async def _json(request: web.Request) -> dict | web.Response:
    body = await read_json(request)
    if isinstance(body, web.Response):
        return body
    if not isinstance(body, dict):
        return error(400, "send a JSON object as the body")
    return body


async def _entry_json(request: web.Request) -> tuple[Entry, dict] | web.Response:
    """The session (as `_entry`) and the JSON object body of a session POST."""
    entry = await _entry(request)
    if isinstance(entry, web.Response):
        return entry
    body = await _json(request)
    return body if isinstance(body, web.Response) else (entry, body)


@ROUTES.post("/v1/sessions")
@resolved(caller_key)
async def post_session(request: web.Request, key: str) -> web.Response:
    body = await _json(request)
    if isinstance(body, web.Response):
        return body
    avatar_id = body.get("avatar_id")
    if not isinstance(avatar_id, str):
        return error(400, 'send a JSON body {"avatar_id": "..."}')
    store = request.app[AVATARS]
    avatar = store.get(key, avatar_id)
    if avatar is None:
        return error(404, "no such avatar")
    manager = request.app[SESSIONS]
    reason = manager.scheduler.admit()  # before any work, and before any RTMP connection
    if reason is not None:
        manager.refused += 1
        return error(503, reason, **{"Retry-After": "10"})
    rtmp = None
    if body.get("rtmp_url") is not None:  # checked (rtmp_gate.py) before it is reserved
        try:
            rtmp = await request.app[RTMP_GATE].sink(key_fingerprint(key), body["rtmp_url"],
                                                      request.app[CONFIG].rtmp_allow)
        except RTMPRefused as e:
            retry = {"Retry-After": str(e.retry_after)} if e.retry_after else {}
            return error(e.status, e.message, **retry)
    frames = await asyncio.to_thread(store.frames, avatar)
    prepared = await asyncio.to_thread(store.prepared, avatar, manager.models)
    try:
        sid, entry = manager.open(key_fingerprint(key), frames, prepared, hls=bool(body.get("hls")),
                                  rtmp=rtmp)
    except AdmissionError as e:
        return error(503, str(e), **{"Retry-After": "10"})
    t = entry.token
    out = {
        "session_id": sid, "token": t,
        "audio_url": f"/v1/sessions/{sid}/audio?token={t}",
        "offer_url": f"/v1/sessions/{sid}/offer?token={t}",
        "say_url": f"/v1/sessions/{sid}/say?token={t}",
        "hls_url": f"/v1/sessions/{sid}/hls/{PLAYLIST}?token={t}" if entry.hls else None,
        "rtmp": entry.rtmp.stats()["url"] if entry.rtmp else None,
        "sample_rate": manager.models.config.sample_rate,
        "fps": manager.models.config.fps,
        "playout_delay_s": round(manager.playout_delay_s, 3),
    }
    return web.json_response(out, status=201)


@ROUTES.get("/v1/sessions/{id}")
@resolved(_entry)
async def get_session(request: web.Request, entry: Entry) -> web.Response:
    s = entry.session
    sched = request.app[SESSIONS].scheduler
    return web.json_response({
        "state": ("ended" if not s.running else "talking" if s.talking else
                  "listening" if s.listening else "idle"),
        "media_s": round(s.frame / s.fps, 3), "lag_s": round(sched.lag_s(s), 3),
        "buffered_s": round(s.buffered_seconds, 3), "utterances": s.segments,
        "viewer": entry.peer is not None, "playout_start_s": entry.playout_start_s,
        "late_frames": entry.playout.late_frames if entry.playout else 0,
        "rtmp": entry.rtmp.stats() if entry.rtmp else None,
        "events": list(s.events)[-20:],
    })


@ROUTES.delete("/v1/sessions/{id}")
@resolved(_entry)
async def delete_session(request: web.Request, entry: Entry) -> web.Response:
    manager = request.app[SESSIONS]
    sid = next(k for k, v in manager.entries.items() if v is entry)
    await manager.close(sid)
    return web.Response(status=204)


@ROUTES.post("/v1/sessions/{id}/offer")
@resolved(_entry_json)
async def post_offer(request: web.Request, found: tuple[Entry, dict]) -> web.Response:
    entry, body = found
    sdp, kind = body.get("sdp"), body.get("type", "offer")
    if not isinstance(sdp, str) or kind != "offer" or len(sdp) > 64 * 1024:
        return error(400, 'send the WebRTC offer as {"sdp": "...", "type": "offer"}')
    from avatarstream.serve.webrtc import require_aiortc

    try:
        require_aiortc()
    except AvatarStreamError as e:
        return error(501, str(e))
    try:
        answer = await request.app[SESSIONS].attach_viewer(entry, sdp, kind)
    except ValueError as e:
        return error(400, f"cannot use this offer: {e}")
    return web.json_response(answer)


async def _say(request: web.Request, entry: Entry, text: object, voice: object) -> dict:
    """Speak `text` in the session (TTS off the event loop); raises AvatarStreamError."""
    if not isinstance(text, str) or (voice is not None and not isinstance(voice, str)):
        raise AvatarStreamError('send {"text": "...", "voice": "..."} (voice optional)')
    samples = await asyncio.to_thread(request.app[TTS].speak, text, voice)
    if not entry.session.say(samples):
        raise AvatarStreamError("too much speech is queued in this session; wait or interrupt")
    return {"type": "queued", "seconds": round(samples.size / 16000, 3)}


@ROUTES.post("/v1/sessions/{id}/say")
@resolved(_entry_json)
async def post_say(request: web.Request, found: tuple[Entry, dict]) -> web.Response:
    entry, body = found
    try:
        out = await _say(request, entry, body.get("text"), body.get("voice"))
    except AvatarStreamError as e:
        return error(400, str(e))
    return web.json_response(out, status=202)


@ROUTES.post("/v1/sessions/{id}/{action:interrupt|end_of_speech|keep_alive}")
@resolved(_entry)
async def post_control(request: web.Request, entry: Entry) -> web.Response:
    action = request.match_info["action"]
    s = entry.session
    if action == "interrupt":
        return web.json_response({"type": "cleared", "dropped_s": round(s.clear_buffer(), 3)})
    if action == "end_of_speech":
        s.end_of_speech()
    else:
        s.keep_alive()
    return web.Response(status=204)


@ROUTES.get("/v1/sessions/{id}/audio")
@resolved(_entry)
async def session_audio(request: web.Request, entry: Entry) -> web.StreamResponse:
    session = entry.session
    limits = request.app[CONFIG].limits
    largest = max(limits.max_packet_bytes, limits.max_json_bytes)
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=_READ_OVER_LIMIT * largest + 1)
    await ws.prepare(request)
    entry.sockets.add(ws)
    if entry.playout_start_s is not None:
        await ws.send_json({"type": "playout", "media_s": entry.playout_start_s})
    try:
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                if len(msg.data) > limits.max_packet_bytes:
                    await ws.close(code=WSCloseCode.MESSAGE_TOO_BIG, message=(
                        f"audio packets are at most {limits.max_packet_bytes} bytes; this one "
                        f"was {len(msg.data)}").encode())
                    break
                try:
                    ok = session.offer_audio(msg.data)
                except AvatarStreamError as e:
                    await ws.send_json({"type": "error", "error": str(e)})
                    continue
                if not ok:
                    await ws.send_json({"type": "slow_down",
                                        "buffered_s": round(session.buffered_seconds, 3)})
            elif msg.type == WSMsgType.TEXT:
                await _control(request, ws, entry, msg.data)
            elif msg.type == WSMsgType.ERROR:
                break
    finally:
        entry.sockets.discard(ws)
    return ws


async def _control(request: web.Request, ws: web.WebSocketResponse, entry: Entry, text: str) -> None:
    session = entry.session
    try:
        msg = parse_json(text.encode(), request.app[CONFIG].limits)
    except InputError as e:
        await ws.send_json({"type": "error", "error": str(e)})
        return
    kind = msg.get("type") if isinstance(msg, dict) else None
    if kind == "end_of_speech":
        session.end_of_speech()
    elif kind == "clear_buffer":
        session.clear_buffer()  # every socket of the session gets the `cleared` event
    elif kind == "keep_alive":
        session.keep_alive()
    elif kind == "listening":  # every socket of the session gets the `listening` event
        on = msg.get("on", True) if isinstance(msg, dict) else True
        if not isinstance(on, bool):
            await ws.send_json({"type": "error", "error": 'send {"type": "listening", "on": true '
                                '| false} (on: whether the user is speaking)'})
            return
        session.listen(on)
    elif kind == "text":
        assert isinstance(msg, dict)
        try:
            await ws.send_json(await _say(request, entry, msg.get("text"), msg.get("voice")))
        except AvatarStreamError as e:
            await ws.send_json({"type": "error", "error": str(e)})
    else:
        await ws.send_json({"type": "error", "error": 'control messages are JSON {"type": '
                            '"end_of_speech" | "clear_buffer" | "keep_alive" | "listening" | '
                            '"text"}'})


@ROUTES.get("/v1/sessions/{id}/hls/{name}")
@resolved(_entry)
async def session_hls(request: web.Request, entry: Entry) -> web.StreamResponse:
    if not entry.hls:
        return error(404, 'this session has no HLS output (create it with {"hls": true})')
    name = request.match_info["name"]
    if not HLS_NAME.match(name):
        return error(404, "no such file")
    path = entry.dir / "hls" / name
    if not path.is_file():
        return error(404, "not published yet")
    if name == PLAYLIST:
        text = path.read_text()
        token = request.query.get("token")
        if token:  # players do not carry the query over to segment URIs: add it
            text = re.sub(r"^(segment_\d{5}\.m4s)$", rf"\1?token={token}", text, flags=re.M)
            text = text.replace('URI="init.mp4"', f'URI="init.mp4?token={token}"')
        return web.Response(text=text, content_type="application/vnd.apple.mpegurl")
    return web.FileResponse(path, headers={"Content-Type": "video/mp4"})


def add_routes(app: web.Application) -> None:
    """Register this file's routes (in the order the handlers stand), and the RTMP gate."""
    app.router.add_routes(ROUTES)
    gate = app[RTMP_GATE] = RTMPGate()

    async def close_gate(_: web.Application) -> None:
        gate.close()

    app.on_cleanup.append(close_gate)
