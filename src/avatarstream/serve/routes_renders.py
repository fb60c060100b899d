"""Render routes: avatar + speech -> an MP4 file, with progress (non-live use).

    POST   /v1/renders                 JSON {"avatar_id", "text", "voice"?}, or the speech itself
                                       (audio/* body, any format PyAV reads) with ?avatar_id=;
                                       rendered here, or on Ray with `serve --batch-ray`
    GET    /v1/renders/{id}            {state, progress, frames, total_frames, fps, error}
    GET    /v1/renders/{id}/output     the MP4 (fragmented: playable while it is written)
    DELETE /v1/renders/{id}
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from avatarstream.batch.remote import RayRender
from avatarstream.errors import AvatarStreamError, InputError
from avatarstream.serve.common import (AVATARS, MODELS, RAY_RENDERS, RECORDS, RENDERS, SCHEDULER, TTS,
                                       UPLOADS, error, read_body, read_json)
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
    pieces, size, limit = [], 0, max_seconds * 16000
    with tempfile.TemporaryDirectory(prefix="avatarstream-upload-") as d:
        path = Path(d) / f"speech{AUDIO_TYPES[ctype]}"
        path.write_bytes(data)
        try:
            for x in AudioReader(path):  # decoding stops at the limit
                pieces.append(x.numpy())
                size += pieces[-1].size
                if size > limit:
                    raise InputError(f"the audio is longer than {max_seconds:g} s, the limit "
                                     f"of a render")
        except InputError as e:
            if size > limit:
                raise
            # its message names a temporary file: say it for the upload
            raise InputError("the upload is not audio this server can read (send wav, mp3, "
                             "flac, ogg, m4a or webm with speech in it)") from e
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


@ROUTES.post("/v1/renders")
@resolved(caller_key)
async def post_render(request: web.Request, key: str) -> web.Response:
    renders, store = request.app[RENDERS], request.app[AVATARS]
    ctype = request.headers.get("Content-Type", "")
    try:
        if ctype.startswith("application/json"):
            body = await read_json(request)
            if isinstance(body, web.Response):
                return body
            if not isinstance(body, dict) or not isinstance(body.get("avatar_id"), str):
                return error(400, 'send {"avatar_id": "...", "text": "..."} or the audio itself')
            text, voice = body.get("text"), body.get("voice")
            if not isinstance(text, str) or (voice is not None and not isinstance(voice, str)):
                return error(400, 'send {"avatar_id": "...", "text": "...", "voice": "..."}')
            avatar = store.get(key, body["avatar_id"])
            if avatar is None:
                return error(404, "no such avatar")
            audio = await asyncio.to_thread(request.app[TTS].speak, text, voice)
        else:  # the speech itself: its type and avatar are checked before the body is read
            upload_type(ctype, AUDIO_TYPES, "audio")
            avatar = store.get(key, request.query.get("avatar_id", ""))
            if avatar is None:
                return error(404, "no such avatar")
            async with request.app[UPLOADS]:
                data = await read_body(request, store.limits.max_bytes)
                if isinstance(data, web.Response):
                    return data
                audio = await asyncio.to_thread(decode_audio, data, ctype, renders.max_seconds)
        ray = request.app.get(RAY_RENDERS)
        if ray is not None:  # on the Ray cluster (batch/remote.py): the avatar's frames go there
            frames = await asyncio.to_thread(store.frames, avatar)
            job: RenderJob | RayRender = await asyncio.to_thread(
                ray.create, key_fingerprint(key), frames, audio, request.app[RECORDS].dir)
        else:
            prepared = await asyncio.to_thread(store.prepared, avatar, request.app[MODELS])
            job = await asyncio.to_thread(renders.create, key_fingerprint(key), prepared, audio)
    except AvatarStreamError as e:
        return error(415 if isinstance(e, UnsupportedUploadError) else 400, str(e))
    request.app[RECORDS].add(job)  # before it can finish
    if isinstance(job, RayRender):
        ray.start(job)
    else:
        request.app[SCHEDULER].add_job(job)
    return web.json_response(job.as_dict(), status=202)


Found = tuple[str, "RenderJob | RayRender | None", dict]  # (id, the job while in memory, state)


async def _job(request: web.Request) -> Found | web.Response:
    """The caller's render named in the path, or the 401/404 refusing it. A finished job is
    answered from its record."""
    key = await caller_key(request)
    if isinstance(key, web.Response):
        return key
    job_id, owner = request.match_info["id"], key_fingerprint(key)
    if not _ID.match(job_id):
        return error(404, "no such render")
    ray = request.app.get(RAY_RENDERS)
    job = request.app[RENDERS].get(owner, job_id) if ray is None else ray.get(owner, job_id)
    info = job.as_dict() if job is not None else request.app[RECORDS].get(owner, job_id)
    return error(404, "no such render") if info is None else (job_id, job, info)


@ROUTES.get("/v1/renders/{id}")
@resolved(_job)
async def get_render(request: web.Request, found: Found) -> web.Response:
    return web.json_response(found[2])


@ROUTES.get("/v1/renders/{id}/output")
@resolved(_job)
async def get_render_output(request: web.Request, found: Found) -> web.StreamResponse:
    job_id, _, info = found
    path = request.app[RECORDS].path(job_id)
    if not path.is_file():
        return error(404, "nothing written yet" if info["state"] in ("queued", "running")
                     else f"the render {info['state']}")
    return web.FileResponse(path, headers={"Content-Type": "video/mp4"})


@ROUTES.delete("/v1/renders/{id}")
@resolved(_job)
async def delete_render(request: web.Request, found: Found) -> web.Response:
    job_id, job, _ = found
    if isinstance(job, RayRender):
        request.app[RAY_RENDERS].remove(job)  # a running one's file is removed when it ends
    elif job is not None:
        request.app[RENDERS].remove(job)  # a running or finishing job is cancelled, its file removed by it
    request.app[RECORDS].remove(job_id, file=job is None)  # never under a job still writing or signing it
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    """Register this file's routes (in the order the handlers stand)."""
    app.router.add_routes(ROUTES)
