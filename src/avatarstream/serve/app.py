"""The HTTP + WebSocket server (aiohttp): avatars, live sessions, their audio socket and HLS.

    POST   /v1/avatars                      body: image/video, Content-Type names it -> {id, ...}
    GET    /v1/avatars/{id}
    POST   /v1/sessions                     {"avatar_id"} -> {session_id, token, audio_url, hls_url}
    WS     /v1/sessions/{id}/audio?token=   binary PCM16 mono 16 kHz; JSON control messages
    GET    /v1/sessions/{id}/hls/{name}     index.m3u8 and segment_NNNNN.ts (?token= or API key)
    DELETE /v1/sessions/{id}
    GET    /openapi.json

Requests carry `Authorization: Bearer KEY`; with `api_keys` given only those keys are accepted,
otherwise any non-empty key names a tenant. Errors are JSON `{"error": message}`. Every live
session is a `LiveSession` (serve/session.py) publishing into its own HLS folder; later slices
add WebRTC tracks and admission control at the `SessionManager`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import WSMsgType, web

from avatarstream.engine.pipeline import ModelSet
from avatarstream.errors import AvatarStreamError
from avatarstream.publish.hls import PLAYLIST, HLSSink
from avatarstream.serve.avatars import (AvatarStore, UnsupportedUploadError, UploadLimits,
                                         key_fingerprint)
from avatarstream.serve.openapi import openapi_schema
from avatarstream.serve.session import LiveSession, LiveSessionConfig

log = logging.getLogger(__name__)

_HLS_NAME = re.compile(r"^(index\.m3u8|segment_\d{5}\.ts)$")
_SESSION_ID = re.compile(r"^[0-9a-f]{24}$")


@dataclass
class ServerConfig:
    data_dir: Path
    api_keys: frozenset[str] | None = None  # None: any non-empty bearer key
    limits: UploadLimits = field(default_factory=UploadLimits)
    session: LiveSessionConfig = field(default_factory=LiveSessionConfig)
    hls_segment_seconds: float = 1.0
    reap_every_s: float = 1.0  # how often ended (idle-timed-out) sessions are cleaned up


CONFIG: web.AppKey[ServerConfig] = web.AppKey("config", ServerConfig)


@dataclass
class _Entry:
    session: LiveSession
    owner: str
    token: str
    dir: Path


class SessionManager:
    """Open sessions by id. One process-wide model; later: batching and admission control."""

    def __init__(self, models: ModelSet, config: ServerConfig) -> None:
        self.models, self.config = models, config
        self.dir = config.data_dir / "sessions"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, _Entry] = {}

    def open(self, owner: str, reference: torch.Tensor) -> tuple[str, _Entry]:
        """Start a session on `reference` ([F, 3, H, W] uint8) for the key fingerprint `owner`."""
        sid = secrets.token_hex(12)
        d = self.dir / sid
        hls = HLSSink(d / "hls", segment_seconds=self.config.hls_segment_seconds)
        # Only HLS is read here (nobody consumes frames()): keep no in-process frame queue.
        live = dataclasses.replace(self.config.session, max_out_items=0)
        session = LiveSession(self.models, reference, config=live, sinks=[hls])
        entry = _Entry(session, owner, secrets.token_urlsafe(24), d)
        self.entries[sid] = entry
        session.start()
        return sid, entry

    async def close(self, sid: str) -> None:
        entry = self.entries.pop(sid, None)
        if entry is None:
            return
        await asyncio.to_thread(entry.session.stop, 10.0)
        shutil.rmtree(entry.dir, ignore_errors=True)

    async def reap(self) -> None:
        """Clean up sessions that ended on their own (idle timeout, failure)."""
        for sid in [s for s, e in self.entries.items() if e.session.source.closed
                    and not e.session.running]:
            await self.close(sid)

    async def close_all(self) -> None:
        for sid in list(self.entries):
            await self.close(sid)


SESSIONS: web.AppKey[SessionManager] = web.AppKey("sessions", SessionManager)
AVATARS: web.AppKey[AvatarStore] = web.AppKey("avatars", AvatarStore)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _api_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if not auth.startswith("Bearer "):
        return None
    key = auth[len("Bearer "):].strip()
    allowed: frozenset[str] | None = request.app[CONFIG].api_keys
    if not key or (allowed is not None and key not in allowed):
        return None
    return key


def _session_entry(request: web.Request) -> tuple[str, _Entry] | web.Response:
    """The session named in the path, if the caller holds its token or its owner's key."""
    sid = request.match_info["id"]
    manager: SessionManager = request.app[SESSIONS]
    entry = manager.entries.get(sid) if _SESSION_ID.match(sid) else None
    key = _api_key(request)
    token = request.query.get("token")
    if key is None and token is None:
        return _error(401, "send `Authorization: Bearer KEY` or the session's ?token=")
    if entry is None:
        return _error(404, "no such session")
    if not ((token is not None and secrets.compare_digest(token, entry.token))
            or (key is not None and key_fingerprint(key) == entry.owner)):
        return _error(404, "no such session")
    return sid, entry


async def post_avatar(request: web.Request) -> web.Response:
    key = _api_key(request)
    if key is None:
        return _error(401, "send `Authorization: Bearer KEY`")
    store: AvatarStore = request.app[AVATARS]
    limit = store.limits.max_bytes
    if request.content_length is not None and request.content_length > limit:
        return _error(413, f"the upload is {request.content_length} bytes; the limit is {limit} bytes")
    try:
        data = await request.content.read(limit + 1)
    except ValueError as e:
        return _error(400, f"cannot read the upload: {e}")
    if len(data) > limit:
        return _error(413, f"the upload is larger than the limit of {limit} bytes")
    ctype = request.headers.get("Content-Type", "")
    try:
        avatar = await asyncio.to_thread(store.create, key, data, ctype)
    except AvatarStreamError as e:
        return _error(415 if isinstance(e, UnsupportedUploadError) else 400, str(e))
    return web.json_response(avatar.as_dict(), status=201)


async def get_avatar(request: web.Request) -> web.Response:
    key = _api_key(request)
    if key is None:
        return _error(401, "send `Authorization: Bearer KEY`")
    avatar = request.app[AVATARS].get(key, request.match_info["id"])
    if avatar is None:
        return _error(404, "no such avatar")
    return web.json_response(avatar.as_dict())


async def post_session(request: web.Request) -> web.Response:
    key = _api_key(request)
    if key is None:
        return _error(401, "send `Authorization: Bearer KEY`")
    try:
        body = await request.json()
        avatar_id = body["avatar_id"]
        if not isinstance(avatar_id, str):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError):
        return _error(400, 'send a JSON body {"avatar_id": "..."}')
    store: AvatarStore = request.app[AVATARS]
    avatar = store.get(key, avatar_id)
    if avatar is None:
        return _error(404, "no such avatar")
    frames = await asyncio.to_thread(store.frames, avatar)
    sid, entry = request.app[SESSIONS].open(key_fingerprint(key), frames)
    return web.json_response({
        "session_id": sid, "token": entry.token,
        "audio_url": f"/v1/sessions/{sid}/audio?token={entry.token}",
        "hls_url": f"/v1/sessions/{sid}/hls/{PLAYLIST}?token={entry.token}",
        "sample_rate": request.app[SESSIONS].models.config.sample_rate,
    }, status=201)


async def delete_session(request: web.Request) -> web.Response:
    found = _session_entry(request)
    if isinstance(found, web.Response):
        return found
    await request.app[SESSIONS].close(found[0])
    return web.Response(status=204)


async def session_audio(request: web.Request) -> web.StreamResponse:
    found = _session_entry(request)
    if isinstance(found, web.Response):
        return found
    session = found[1].session
    ws = web.WebSocketResponse(heartbeat=20.0)
    await ws.prepare(request)
    async for msg in ws:
        if msg.type == WSMsgType.BINARY:
            try:
                ok = session.offer_audio(msg.data)
            except AvatarStreamError as e:
                await ws.send_json({"type": "error", "error": str(e)})
                continue
            if not ok:
                await ws.send_json({"type": "slow_down",
                                    "buffered_s": round(session.buffered_seconds, 3)})
        elif msg.type == WSMsgType.TEXT:
            await _control(ws, session, msg.data)
        elif msg.type == WSMsgType.ERROR:
            break
    return ws


async def _control(ws: web.WebSocketResponse, session: LiveSession, text: str) -> None:
    try:
        kind = json.loads(text).get("type")
    except (json.JSONDecodeError, AttributeError):
        kind = None
    if kind == "end_of_speech":
        session.end_of_speech()
    elif kind == "clear_buffer":
        await ws.send_json({"type": "cleared", "dropped_s": round(session.clear_buffer(), 3)})
    elif kind == "keep_alive":
        session.keep_alive()
    else:
        await ws.send_json({"type": "error", "error": 'control messages are JSON {"type": '
                            '"end_of_speech" | "clear_buffer" | "keep_alive"}'})


async def session_hls(request: web.Request) -> web.StreamResponse:
    found = _session_entry(request)
    if isinstance(found, web.Response):
        return found
    name = request.match_info["name"]
    if not _HLS_NAME.match(name):
        return _error(404, "no such file")
    path = found[1].dir / "hls" / name
    if not path.is_file():
        return _error(404, "not published yet")
    if name == PLAYLIST:
        text = path.read_text()
        token = request.query.get("token")
        if token:  # players do not carry the query over to segment URIs: add it
            text = re.sub(r"^(segment_\d{5}\.ts)$", rf"\1?token={token}", text, flags=re.M)
        return web.Response(text=text, content_type="application/vnd.apple.mpegurl")
    return web.FileResponse(path, headers={"Content-Type": "video/mp2t"})


async def get_openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_schema())


async def _reaper(app: web.Application) -> None:
    while True:
        await asyncio.sleep(app[CONFIG].reap_every_s)
        await app[SESSIONS].reap()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(_reaper(app))
    yield
    task.cancel()
    await app[SESSIONS].close_all()
    app[AVATARS].close()


def make_app(models: ModelSet, config: ServerConfig) -> web.Application:
    """The aiohttp application serving `models` with state under `config.data_dir`."""
    c = models.config
    app = web.Application(client_max_size=config.limits.max_bytes + 1024)
    app[CONFIG] = config
    app[AVATARS] = AvatarStore(config.data_dir, size=c.hr_size, max_frames=c.ref_pixel_frames,
                                 limits=config.limits)
    app[SESSIONS] = SessionManager(models, config)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_get("/openapi.json", get_openapi)
    app.router.add_post("/v1/avatars", post_avatar)
    app.router.add_get("/v1/avatars/{id}", get_avatar)
    app.router.add_post("/v1/sessions", post_session)
    app.router.add_delete("/v1/sessions/{id}", delete_session)
    app.router.add_get("/v1/sessions/{id}/audio", session_audio)
    app.router.add_get("/v1/sessions/{id}/hls/{name}", session_hls)
    return app
