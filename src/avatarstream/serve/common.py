"""What the server's application and its routes share: the application's keys (its state), JSON
errors, the caller's API key, and request bodies read within the limits (`serve/app.py` builds
the application; `routes_*.py` and `guards.py` answer requests with these)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from avatarstream.batch.remote import RayRenders
from avatarstream.engine.config import ModelSet
from avatarstream.errors import InputError
from avatarstream.live.renders import RenderManager
from avatarstream.live.scheduler import ChunkScheduler
from avatarstream.media.tts import TextToSpeech
from avatarstream.serve.avatars import AvatarStore
from avatarstream.serve.config import ServerConfig
from avatarstream.serve.limits import MIN_BODY_RATE, parse_json
from avatarstream.serve.render_records import RenderRecords
from avatarstream.serve.sessions import SessionManager

log = logging.getLogger(__name__)


CONFIG: web.AppKey[ServerConfig] = web.AppKey("config", ServerConfig)
AVATARS: web.AppKey[AvatarStore] = web.AppKey("avatars", AvatarStore)
SESSIONS: web.AppKey[SessionManager] = web.AppKey("sessions", SessionManager)
SCHEDULER: web.AppKey[ChunkScheduler] = web.AppKey("scheduler", ChunkScheduler)
RENDERS: web.AppKey[RenderManager] = web.AppKey("renders", RenderManager)
RECORDS: web.AppKey[RenderRecords] = web.AppKey("records", RenderRecords)
# present with `serve --batch-ray`: the renders go to Ray (batch/remote.py), not to RENDERS
RAY_RENDERS: web.AppKey[RayRenders] = web.AppKey("ray_renders", RayRenders)
TTS: web.AppKey[TextToSpeech] = web.AppKey("tts", TextToSpeech)
MODELS: web.AppKey[ModelSet] = web.AppKey("models", ModelSet)
UPLOADS: web.AppKey[asyncio.Semaphore] = web.AppKey("uploads", asyncio.Semaphore)


def error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def api_key(request: web.Request) -> str | None:
    """The request's bearer key if the server accepts it, else None. The scheme is
    case-insensitive and may be followed by several spaces (RFC 7235)."""
    scheme, _, key = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    key = key.strip()
    allowed: frozenset[str] | None = request.app[CONFIG].api_keys
    if not key or (allowed is not None and key not in allowed):
        return None
    return key


async def read_body(request: web.Request, limit: int, what: str = "upload") -> bytes | web.Response:
    """The request body, or a 413 error past `limit` bytes (refused before it is read when the
    request says its length), or a 408 error when it stalls: no byte for `body_idle_seconds`, or
    an average under `MIN_BODY_RATE` after that (the connection is closed, so a stalled client
    holds no upload slot)."""
    if request.content_length is not None and request.content_length > limit:
        return error(413, f"the {what} is {request.content_length} bytes; the limit is {limit} bytes")
    idle = request.app[CONFIG].limits.body_idle_seconds
    loop = asyncio.get_running_loop()
    start = loop.time()
    parts, size = [], 0
    try:
        while True:  # read() returns what has arrived so far: read to the end, bounded
            wait = min(idle, start + idle + size / MIN_BODY_RATE - loop.time())
            try:
                if wait <= 0:
                    raise TimeoutError
                part = await asyncio.wait_for(
                    request.content.read(min(1 << 20, limit + 1 - size)), wait)
            except TimeoutError:
                log.info("a %s stalled after %d bytes in %.1f s: 408", what, size, loop.time() - start)
                r = error(408, f"the {what} stalled: {size} bytes in {loop.time() - start:.1f} s "
                               f"(send at least {MIN_BODY_RATE // 1024} KiB/s, with no pause "
                               f"over {idle:g} s)")
                r.force_close()
                return r
            if not part:
                break
            parts.append(part)
            size += len(part)
            if size > limit:
                return error(413, f"the {what} is larger than the limit of {limit} bytes")
    except ValueError as e:
        return error(400, f"cannot read the upload: {e}")
    return b"".join(parts)


async def read_json(request: web.Request) -> object | web.Response:
    """The JSON body, or the 413/400 refusing it: too large, too deep (both checked before it is
    parsed) or not JSON."""
    limits = request.app[CONFIG].limits
    data = await read_body(request, limits.max_json_bytes, "JSON body")
    if isinstance(data, web.Response):
        return data
    try:
        return parse_json(data, limits)
    except InputError as e:
        return error(400, str(e))
