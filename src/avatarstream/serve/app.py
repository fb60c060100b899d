"""The HTTP + WebSocket + WebRTC server (aiohttp + aiortc): avatars, live sessions, renders.

    GET    /                                 the web page (serve/static/index.html)
    GET    /openapi.json                     the schema;  GET /v1/server: model, capacity, load
    POST   /v1/avatars                       body: image/video, Content-Type names it -> {id, ...}
    GET    /v1/avatars/{id}                  GET /v1/voices: the TTS voices
    POST   /v1/sessions                      {"avatar_id", "hls"?} -> {session_id, token, urls}
    GET    /v1/sessions/{id}                 state, media time, lag, late frames
    POST   /v1/sessions/{id}/offer           WebRTC: {sdp, type: "offer"} -> the answer
    WS     /v1/sessions/{id}/audio?token=    binary PCM16 mono 16 kHz; JSON control + events
    POST   /v1/sessions/{id}/say             {"text", "voice"?}  (TTS)
    POST   /v1/sessions/{id}/interrupt | /end_of_speech | /keep_alive
    GET    /v1/sessions/{id}/hls/{name}      index.m3u8, init.mp4, segment_NNNNN.m4s
    DELETE /v1/sessions/{id}
    POST   /v1/renders                       {"avatar_id", "text"} or audio body ?avatar_id=
    GET    /v1/renders/{id} | /v1/renders/{id}/output;  DELETE /v1/renders/{id}

Requests carry `Authorization: Bearer KEY` (the scheme in any case, RFC 7235); with `api_keys`
given only those keys are accepted (and `/v1/server` needs one too), otherwise any non-empty key
is accepted and names its own tenant. Session routes also accept the session's `?token=`.
Errors are JSON `{"error": message}` with a proper status, never a traceback or a server path.
What one request may cost is bounded by `ServerConfig.limits` (serve/limits.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources

from aiohttp import web

from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.errors import AvatarStreamError
from avatarstream.batch.remote import RayRender, RayRenders
from avatarstream.serve.avatars import AvatarStore, UnsupportedUploadError
from avatarstream.serve.common import (AVATARS, CONFIG, MODELS, RAY_RENDERS, RECORDS, RENDERS, SCHEDULER,
                                       SESSIONS, TTS, UPLOADS, api_key, error, read_body)
from avatarstream.serve.config import ServerConfig
from avatarstream.serve.openapi import openapi_schema
from avatarstream.serve.render_records import RenderRecords
from avatarstream.live.renders import RenderJob, RenderManager
from avatarstream.live.capacity import Capacity
from avatarstream.live.scheduler import ChunkScheduler
from avatarstream.serve.sessions import SessionManager
from avatarstream.media.tts import TextToSpeech
from avatarstream.serve import routes_renders, routes_sessions

log = logging.getLogger(__name__)

# Live chunks are at most 0.8 s = 5 latent frames (2 of them the prefix overlap: 0.48 s of new
# video). The first speech frame waits for one chunk's audio and compute: with the bundled model's
# own 1.28 s chunks (0.96 s new) a 2-core CPU measured ~2.4 s to the first frame, with these ~1.4 s,
# at the same load within noise (README, Serve).
LIVE_SECONDS_PER_CHUNK = 0.8


def live_chunk(config: PipelineConfig, seconds: float | None) -> int:
    """Latent frames per chunk a live server runs: `seconds` exactly, or (None) the model's own
    capped at LIVE_SECONDS_PER_CHUNK."""
    if seconds is not None:
        return config.chunk_for_seconds(seconds)
    return min(config.chunk, config.chunk_for_seconds(LIVE_SECONDS_PER_CHUNK))


async def post_avatar(request: web.Request) -> web.Response:
    key = api_key(request)
    if key is None:
        return error(401, "send `Authorization: Bearer KEY`")
    store = request.app[AVATARS]
    async with request.app[UPLOADS]:  # at most max_parallel_uploads bodies read and decoded
        data = await read_body(request, store.limits.max_bytes)
        if isinstance(data, web.Response):
            return data
        ctype = request.headers.get("Content-Type", "")
        try:
            avatar = await asyncio.to_thread(store.create, key, data, ctype)
        except AvatarStreamError as e:
            return error(415 if isinstance(e, UnsupportedUploadError) else 400, str(e))
    return web.json_response(avatar.as_dict(), status=201)


async def get_avatar(request: web.Request) -> web.Response:
    key = api_key(request)
    if key is None:
        return error(401, "send `Authorization: Bearer KEY`")
    avatar = request.app[AVATARS].get(key, request.match_info["id"])
    if avatar is None:
        return error(404, "no such avatar")
    return web.json_response(avatar.as_dict())


async def get_voices(request: web.Request) -> web.Response:
    from avatarstream.media.tts import DEFAULT_VOICE

    return web.json_response({"default": DEFAULT_VOICE, "voices": request.app[TTS].voices()})


async def get_server(request: web.Request) -> web.Response:
    if request.app[CONFIG].api_keys is not None and api_key(request) is None:
        return error(401, "send `Authorization: Bearer KEY`")
    sched, sessions = request.app[SCHEDULER], request.app[SESSIONS]
    cap = sched.capacity
    return web.json_response({
        "model": request.app[MODELS].name,
        "capacity": None if cap is None else cap.as_dict(),
        "live_sessions": sessions.live_count(), "refused": sessions.refused,
        "playout_delay_s": round(sessions.playout_delay_s, 3),
        "scheduler": sched.stats.as_dict(),
    })


async def get_openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_schema(request.app[CONFIG].limits))


async def get_page(request: web.Request) -> web.Response:
    page = resources.files("avatarstream.serve").joinpath("static/index.html").read_text()
    return web.Response(text=page, content_type="text/html")


@web.middleware
async def json_errors(request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
    """Unknown routes and unexpected failures answer JSON too (the log keeps the traceback)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status >= 400 and e.content_type != "application/json":
            return error(e.status, e.reason or "error")
        raise
    except AvatarStreamError as e:
        return error(400, str(e))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            log.exception("request %s %s failed", request.method, request.path)
            return error(500, "internal error (see the server log)")
        log.warning("request %s %s: no space left on device", request.method, request.path)
        return error(507, "the server has no space left on its disk; try again later")
    except Exception:
        log.exception("request %s %s failed", request.method, request.path)
        return error(500, "internal error (see the server log)")


async def _reaper(app: web.Application) -> None:
    while True:
        await asyncio.sleep(app[CONFIG].reap_every_s)
        try:
            await app[SESSIONS].reap()
        except Exception:  # noqa: BLE001 - keep reaping
            log.warning("reaping sessions failed", exc_info=True)


def _measure(models: ModelSet, config: ServerConfig, sched: ChunkScheduler,
             sessions: SessionManager) -> None:
    """Capacity and playout delay from the model's measured chunk time on this machine."""
    from avatarstream.media.reference import fit_resize
    from avatarstream.media.synthetic import face_image
    from avatarstream.live.prepared import prepare_reference
    from avatarstream.live.capacity import calibrate, measure_steps

    c = models.config
    frames = fit_resize(face_image(max(c.out_hw)), *c.out_hw).unsqueeze(0)  # [1, 3, H, W]
    prepared = prepare_reference(models, frames)
    if config.max_sessions is None:
        sched.capacity = calibrate(models, prepared)
        step = sched.capacity.step_base_s + sched.capacity.step_per_session_s
    else:
        sched.capacity = Capacity(max_sessions=config.max_sessions)
        step = measure_steps(models, prepared, 1, steps=2)[0] if config.playout_delay_s is None else 0.0
    if config.playout_delay_s is None:
        sessions.playout_delay_s = playout_delay(models, step, config.session.lead_s)
    log.info("capacity %s, playout delay %.2f s", sched.capacity.as_dict(), sessions.playout_delay_s)


def playout_delay(models: ModelSet, step_s: float, lead_s: float) -> float:
    """The WebRTC playout delay that lets speech arriving in real time never wait for video:
    the first chunk's audio (plus the audio look-ahead) arriving, plus 1.5 chunk times, minus
    the lead the timeline already has over the wall clock."""
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.engine.loop import make_config_schedule

    c = models.config
    pipe = Pipeline(models)
    horizon = make_config_schedule(pipe.config).horizon()  # latents the first chunk needs
    frames = pipe.clock.video_span(horizon - 1)[1] + 2  # + audio look-ahead and window
    return round(max(0.1, frames / c.fps + 1.5 * step_s - lead_s), 3)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    sched = app[SCHEDULER]
    await asyncio.to_thread(_measure, app[MODELS], app[CONFIG], sched, app[SESSIONS])
    await asyncio.to_thread(app[TTS].warm)
    sched.start()
    task = asyncio.create_task(_reaper(app))
    yield
    task.cancel()
    await app[SESSIONS].close_all()
    await asyncio.to_thread(sched.stop)
    if RAY_RENDERS in app:
        await asyncio.to_thread(app[RAY_RENDERS].close)
    app[AVATARS].close()
    app[RECORDS].close()


async def _close_sessions(app: web.Application) -> None:
    await app[SESSIONS].close_all()


def make_app(models: ModelSet, config: ServerConfig, remote_renders: RayRenders | None = None) -> web.Application:
    """The aiohttp application serving `models` with state under `config.data_dir`; its renders
    on `remote_renders` (a Ray actor pool: `serve --batch-ray`) when given."""
    # the server's own copy of the model set (same networks), with the live chunk length
    models = dataclasses.replace(models, config=dataclasses.replace(
        models.config, chunk=live_chunk(models.config, config.seconds_per_chunk)))
    c = models.config
    limits = config.limits
    app = web.Application(client_max_size=limits.max_bytes + 1024, middlewares=[json_errors])
    app[CONFIG] = config
    app[MODELS] = models
    app[UPLOADS] = asyncio.Semaphore(limits.max_parallel_uploads)
    app[AVATARS] = AvatarStore(config.data_dir, size=c.out_hw, max_frames=c.ref_pixel_frames,
                               limits=limits, models=models)
    app[SCHEDULER] = ChunkScheduler(models, batching=config.batching)
    app[SESSIONS] = SessionManager(models, config, app[SCHEDULER])
    records = app[RECORDS] = RenderRecords(config.data_dir)

    def finished(job: RenderJob) -> None:  # the scheduler thread: record it, then let it go
        records.finish(job)
        renders.forget(job)

    renders = app[RENDERS] = RenderManager(config.data_dir, models, on_finish=finished,
                                           max_seconds=limits.max_render_seconds)
    if remote_renders is not None:
        def finished_on_ray(job: RayRender) -> None:  # its dispatcher thread: as `finished`
            records.finish(job)
            remote_renders.forget(job)

        remote_renders.on_finish = finished_on_ray
        app[RAY_RENDERS] = remote_renders
    app[TTS] = TextToSpeech(piper_voice=config.piper_voice, max_chars=limits.max_text_chars)
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_close_sessions)  # before the server waits for open handlers
    app.router.add_get("/", get_page)
    app.router.add_get("/openapi.json", get_openapi)
    app.router.add_get("/v1/server", get_server)
    app.router.add_get("/v1/voices", get_voices)
    app.router.add_post("/v1/avatars", post_avatar)
    app.router.add_get("/v1/avatars/{id}", get_avatar)
    routes_sessions.add_routes(app)
    routes_renders.add_routes(app)
    return app
