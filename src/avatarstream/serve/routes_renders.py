"""Render routes: avatar + speech -> an MP4 file, with progress (non-live use).

    POST   /v1/renders                 JSON {"avatar_id", "text", "voice"?}, or the speech itself
                                       (audio/* body, any format PyAV reads) with ?avatar_id=
    GET    /v1/renders/{id}            {state, progress, frames, total_frames, fps, error}
    GET    /v1/renders/{id}/output     the MP4 (fragmented: playable while it is written)
    DELETE /v1/renders/{id}
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from avatarstream.errors import AvatarStreamError, InputError
from avatarstream.serve.app import AVATARS, MODELS, RENDERS, SCHEDULER, TTS, error, read_body
from avatarstream.serve.avatars import UnsupportedUploadError, key_fingerprint, upload_type
from avatarstream.serve.guards import caller_key, resolved

if TYPE_CHECKING:
    from avatarstream.live.renders import RenderJob

_ID = re.compile(r"^[0-9a-f]{24}$")
AUDIO_TYPES = {"audio/wav": ".wav", "audio/x-wav": ".wav", "audio/wave": ".wav",
               "audio/mpeg": ".mp3", "audio/flac": ".flac", "audio/ogg": ".ogg",
               "audio/mp4": ".m4a", "audio/x-m4a": ".m4a", "audio/webm": ".webm"}
ROUTES = web.RouteTableDef()  # each handler's method and path stand above it


def decode_audio(data: bytes, content_type: str, max_seconds: float) -> np.ndarray:
    """Speech bytes of any format PyAV reads -> float32 mono 16 kHz; InputError when unusable."""
    from avatarstream.media.audio import AudioReader

    ctype = upload_type(content_type, AUDIO_TYPES, "audio")
    if not data:
        raise InputError("the audio is empty")
    with tempfile.TemporaryDirectory(prefix="avatarstream-upload-") as d:
        path = Path(d) / f"speech{AUDIO_TYPES[ctype]}"
        path.write_bytes(data)
        try:
            pieces = [x.numpy() for x in AudioReader(path)]
        except InputError as e:  # its message names a temporary file: say it for the upload
            raise InputError("the upload is not audio this server can read (send wav, mp3, "
                             "flac, ogg, m4a or webm with speech in it)") from e
    x = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if x.size > max_seconds * 16000:
        raise InputError(f"the audio is {x.size / 16000:.1f} s long; renders are limited to "
                         f"{max_seconds:g} s")
    return x


@ROUTES.post("/v1/renders")
@resolved(caller_key)
async def post_render(request: web.Request, key: str) -> web.Response:
    renders = request.app[RENDERS]
    ctype = request.headers.get("Content-Type", "")
    data = await read_body(request, request.app[AVATARS].limits.max_bytes)
    if isinstance(data, web.Response):
        return data
    try:
        if ctype.startswith("application/json"):
            try:
                body = json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError):
                body = None
            if not isinstance(body, dict) or not isinstance(body.get("avatar_id"), str):
                return error(400, 'send {"avatar_id": "...", "text": "..."} or the audio itself')
            avatar_id = body["avatar_id"]
            text, voice = body.get("text"), body.get("voice")
            if not isinstance(text, str) or (voice is not None and not isinstance(voice, str)):
                return error(400, 'send {"avatar_id": "...", "text": "...", "voice": "..."}')
            audio = None
        else:
            avatar_id = request.query.get("avatar_id", "")
            text = voice = None
            audio = await asyncio.to_thread(decode_audio, data, ctype, renders.max_seconds)
        store = request.app[AVATARS]
        avatar = store.get(key, avatar_id)
        if avatar is None:
            return error(404, "no such avatar")
        if audio is None:
            audio = await asyncio.to_thread(request.app[TTS].speak, text, voice)
        prepared = await asyncio.to_thread(store.prepared, avatar, request.app[MODELS])
        job = await asyncio.to_thread(renders.create, key_fingerprint(key), prepared, audio)
    except AvatarStreamError as e:
        return error(415 if isinstance(e, UnsupportedUploadError) else 400, str(e))
    request.app[SCHEDULER].add_job(job)
    return web.json_response(job.as_dict(), status=202)


async def _job(request: web.Request) -> RenderJob | web.Response:
    """The caller's render named in the path, or the 401/404 refusing it."""
    key = await caller_key(request)
    if isinstance(key, web.Response):
        return key
    job_id = request.match_info["id"]
    job = request.app[RENDERS].get(key_fingerprint(key), job_id) if _ID.match(job_id) else None
    return job if job is not None else error(404, "no such render")


@ROUTES.get("/v1/renders/{id}")
@resolved(_job)
async def get_render(request: web.Request, job: RenderJob) -> web.Response:
    return web.json_response(job.as_dict())


@ROUTES.get("/v1/renders/{id}/output")
@resolved(_job)
async def get_render_output(request: web.Request, job: RenderJob) -> web.StreamResponse:
    if not job.path.is_file():
        return error(404, "nothing written yet" if not job.done else f"the render {job.state}")
    return web.FileResponse(job.path, headers={"Content-Type": "video/mp4"})


@ROUTES.delete("/v1/renders/{id}")
@resolved(_job)
async def delete_render(request: web.Request, job: RenderJob) -> web.Response:
    request.app[RENDERS].remove(job)
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    """Register this file's routes (in the order the handlers stand)."""
    app.router.add_routes(ROUTES)
