"""What the server tests share: media made on the fly, a tiny-random app on a data folder, a
loopback test client, an uploaded avatar."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import av
import numpy as np
from aiohttp.test_utils import TestClient, TestServer

from avatarstream.bench.inputs import face_image, speechlike
from avatarstream.live.session import LiveSessionConfig
from avatarstream.serve.app import ServerConfig, make_app
from avatarstream.serve.limits import Limits

SR = 16000
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


def _png(size: int = 96, blank: bool = False) -> bytes:
    img = np.full((size, size, 3), 128, np.uint8) if blank else face_image(size)
    buf = io.BytesIO()
    with av.open(buf, "w", format="image2pipe") as c:
        s = c.add_stream("png")
        s.width = s.height = size
        s.pix_fmt = "rgb24"
        for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _wav(seconds: float) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as c:
        s = c.add_stream("pcm_s16le", rate=SR)
        s.layout = "mono"
        f = av.AudioFrame.from_ndarray(speechlike(seconds)[None], format="flt", layout="mono")
        f.sample_rate = SR
        for p in s.encode(f):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _pcm(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def _tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


_MODELS: dict = {}


def _app(tmp_path: Path, max_sessions: int | None = 4, api_keys: frozenset[str] | None = None,
         **limits):  # type: ignore[no-untyped-def]
    from avatarstream.registry import load_model

    if "m" not in _MODELS:
        _MODELS["m"] = load_model("tiny-random")
        _MODELS["m"].config.steps = 1
    models = _MODELS["m"]
    limits = {"max_render_seconds": 30.0, **limits}
    cfg = ServerConfig(data_dir=tmp_path / "data", limits=Limits(**limits), api_keys=api_keys,
                       session=LiveSessionConfig(lead_s=0.2, max_buffer_s=2.0,
                                                 idle_timeout_s=10.0),
                       hls_segment_seconds=0.5, reap_every_s=0.2, max_sessions=max_sessions,
                       playout_delay_s=0.3)
    return make_app(models, cfg), models.config


def _run(app, body, timeout: float = 60):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            return await asyncio.wait_for(body(client), timeout=timeout)
    return asyncio.run(main())


async def _avatar(client, headers=A, data=None) -> str:  # type: ignore[no-untyped-def]
    r = await client.post("/v1/avatars", data=data or _png(),
                          headers={**headers, "Content-Type": "image/png"})
    assert r.status == 201, await r.text()
    return (await r.json())["id"]


async def _finished_render(client, avatar: str, wav: bytes, headers=A) -> dict:  # type: ignore[no-untyped-def]
    """POST a render of `wav` on `avatar`, poll it until done or failed; its last state."""
    r = await client.post(f"/v1/renders?avatar_id={avatar}", data=wav,
                          headers={**headers, "Content-Type": "audio/wav"})
    job = await r.json()
    while job["state"] not in ("done", "failed"):
        await asyncio.sleep(0.05)
        job = await (await client.get(f"/v1/renders/{job['id']}", headers=headers)).json()
    return job

