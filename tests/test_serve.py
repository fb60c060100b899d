"""The live-session server over loopback (aiohttp test server on an ephemeral port, tiny-random)."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import av
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from avatarstream.bench.inputs import face_image
from avatarstream.serve.app import SESSIONS, ServerConfig, make_app
from avatarstream.serve.avatars import UploadLimits
from avatarstream.serve.openapi import openapi_schema
from avatarstream.serve.session import LiveSessionConfig

pytestmark = pytest.mark.usefixtures("one_thread")
SR = 16000
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


def _png(size: int = 96) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="image2pipe") as c:
        s = c.add_stream("png")
        s.width = s.height = size
        s.pix_fmt = "rgb24"
        for p in s.encode(av.VideoFrame.from_ndarray(face_image(size), format="rgb24")):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _pcm(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def _tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def _app(tmp_path: Path, **limits):  # type: ignore[no-untyped-def]
    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    models.config.steps = 1
    cfg = ServerConfig(data_dir=tmp_path / "data", limits=UploadLimits(**limits),
                       session=LiveSessionConfig(lead_s=0.2, max_buffer_s=2.0,
                                                 idle_timeout_s=10.0),
                       hls_segment_seconds=0.5, reap_every_s=0.2)
    return make_app(models, cfg), models.config


def _run(app, body):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            return await asyncio.wait_for(body(client), timeout=60)
    return asyncio.run(main())


def _decode_ts(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Video pts [N], audio sample times [M], audio samples [M] of an MPEG-TS byte stream."""
    vpts, apts, aval = [], [], []
    with av.open(io.BytesIO(data), format="mpegts") as c:
        for frame in c.decode(video=0, audio=0):
            t = float(frame.pts * frame.time_base)
            if isinstance(frame, av.VideoFrame):
                vpts.append(t)
            else:
                x = frame.to_ndarray().astype(np.float32).reshape(-1, frame.samples).mean(0)
                apts.append(t + np.arange(x.size) / frame.sample_rate)
                aval.append(x)
    return np.array(vpts), np.concatenate(apts), np.concatenate(aval)


def test_openapi_lists_every_route(tmp_path):
    app, _ = _app(tmp_path)
    paths = openapi_schema()["paths"]
    for r in app.router.routes():
        info = r.resource.get_info()
        path = info.get("path") or info.get("formatter")
        assert path in paths, path
        assert r.method.lower() in paths[path] or r.method == "HEAD", (r.method, path)


def test_avatar_upload_limits_and_ownership(tmp_path):
    app, _ = _app(tmp_path, max_bytes=200_000, max_seconds=2.0)

    async def body(client):  # type: ignore[no-untyped-def]
        r = await client.post("/v1/avatars", data=_png(), headers={**A, "Content-Type": "image/png"})
        assert r.status == 201, await r.text()
        avatar = await r.json()
        assert (await client.get(f"/v1/avatars/{avatar['id']}", headers=A)).status == 200
        r = await client.get(f"/v1/avatars/{avatar['id']}", headers=B)
        assert r.status == 404 and "error" in await r.json()  # another key: not even confirmed
        assert (await client.get(f"/v1/avatars/{avatar['id']}")).status == 401
        assert (await client.get("/v1/avatars/..%2F..%2Favatars.sqlite", headers=A)).status == 404
        r = await client.post("/v1/avatars", data=b"x", headers={**A, "Content-Type": "text/plain"})
        assert r.status == 415 and "unsupported" in (await r.json())["error"]
        r = await client.post("/v1/avatars", data=b"", headers={**A, "Content-Type": "image/png"})
        assert r.status == 400 and "empty" in (await r.json())["error"]
        r = await client.post("/v1/avatars", data=b"not a png" * 10,
                              headers={**A, "Content-Type": "image/png"})
        assert r.status == 400
        r = await client.post("/v1/avatars", data=b"\0" * 300_000,
                              headers={**A, "Content-Type": "video/mp4"})
        assert r.status == 413 and "limit" in (await r.json())["error"]
        r = await client.post("/v1/sessions", json={"avatar_id": avatar["id"]}, headers=B)
        assert r.status == 404  # another key cannot use it either
        assert not list((tmp_path / "data" / "avatars").glob("*.upload*"))  # no leftovers

    _run(app, body)


def test_live_session_over_websocket_and_hls(tmp_path):
    app, c = _app(tmp_path)
    chunk_s = 4 * c.chunk / c.fps
    m: dict = {}

    async def body(client):  # type: ignore[no-untyped-def]
        r = await client.post("/v1/avatars", data=_png(), headers={**A, "Content-Type": "image/png"})
        avatar = await r.json()
        r = await client.post("/v1/sessions", json={"avatar_id": avatar["id"]}, headers=A)
        assert r.status == 201
        s = await r.json()
        sid, token = s["session_id"], s["token"]
        session = app[SESSIONS].entries[sid].session
        assert (await client.get(s["hls_url"].replace(token, "wrong"))).status == 404
        ws = await client.ws_connect(s["audio_url"])
        # ~3 s of speech, sent at once in 0.1 s packets (fits the 2 s buffer only in part:
        # the rest comes back as slow_down and is sent again).
        packets = [_pcm(p) for p in np.split(_tone(3.0), 30)]
        m["t_push"] = time.monotonic()
        pending = list(packets)
        while pending:
            await ws.send_bytes(pending[0])
            try:
                reply = await ws.receive_json(timeout=0.05)
                assert reply["type"] == "slow_down"
                await asyncio.sleep(0.1)
                continue
            except asyncio.TimeoutError:
                pending.pop(0)
            if len(pending) == 10:  # 2 s of speech in: interrupt
                await asyncio.sleep(0.5)
                m["clear_pos"] = session.frames_published / c.fps
                await ws.send_json({"type": "clear_buffer"})
                reply = await ws.receive_json(timeout=2)
                assert reply["type"] == "cleared" and reply["dropped_s"] > 0.2
                m["dropped_s"] = reply["dropped_s"]
                break
        await ws.send_json({"type": "end_of_speech"})
        f0, w0 = session.frames_published, time.monotonic()
        await asyncio.sleep(2.0)  # idle: frames keep coming at real-time pace
        m["idle_fps"] = (session.frames_published - f0) / (time.monotonic() - w0)
        # HLS: the playlist and its segments, fetched with the session token.
        r = await client.get(s["hls_url"])
        assert r.status == 200
        playlist = await r.text()
        segs = [ln for ln in playlist.splitlines() if ln.startswith("segment_")]
        assert segs and all(f"token={token}" in ln for ln in segs)
        data = b"".join([await (await client.get(f"/v1/sessions/{sid}/hls/{ln}")).read()
                         for ln in segs])
        assert (await client.get(f"/v1/sessions/{sid}/hls/..%2F..%2Favatars.sqlite?token={token}"
                                 )).status == 404
        m["ts"] = data
        # Back-pressure: 20 s of audio pushed instantly never queues beyond the 2 s bound.
        slow = 0
        for p in np.split(np.zeros(20 * SR, np.float32), 200):
            await ws.send_bytes(_pcm(p))
        await ws.send_json({"type": "keep_alive"})
        await ws.send_json({"type": "marker"})  # unknown: answered with an error, ends the count
        while True:
            msg = await ws.receive_json(timeout=5)
            if msg["type"] == "slow_down":
                slow += 1
            else:
                assert msg["type"] == "error"
                break
        m["slow"] = slow
        m["peak_buffered_s"] = session.source.peak_buffered / SR
        await ws.close()
        r = await client.delete(f"/v1/sessions/{sid}", headers=A)
        assert r.status == 204
        assert sid not in app[SESSIONS].entries and not session.running
        assert not (tmp_path / "data" / "sessions" / sid).exists()
        assert (await client.get(s["hls_url"])).status == 404

    _run(app, body)
    assert m["slow"] > 0 and m["peak_buffered_s"] <= 2.0 + 1e-6
    assert 25 * 0.6 < m["idle_fps"] < 25 * 1.6, m["idle_fps"]
    vpts, apts, aval = _decode_ts(m["ts"])
    assert vpts.size > 25 and np.allclose(np.diff(vpts), 1 / 25, atol=1e-3)
    loud = apts[np.abs(aval) > 0.1]
    assert loud.size
    interrupt_latency = loud.max() - m["clear_pos"]
    assert interrupt_latency <= chunk_s + 0.2 + 0.15, interrupt_latency
    assert apts.max() > loud.max() + 0.5  # silence after the interrupt
    print(f"\nserve: interrupt latency {interrupt_latency:.2f} s (chunk {chunk_s:.2f} s), idle "
          f"{m['idle_fps']:.1f} fps, {m['slow']} slow_down, peak buffer {m['peak_buffered_s']:.2f} s")
