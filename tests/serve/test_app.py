"""The server's HTTP/WebSocket API over loopback (aiohttp test server, tiny-random, one thread):
avatars (limits, ownership, encoded once and reused across restarts), sessions (WebSocket
speech with back-pressure, TTS, interrupt, live fMP4 HLS), admission control, render jobs,
clear JSON errors."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

import av
import numpy as np
import pytest

from avatarstream.provenance.credentials import signing_identity
from avatarstream.serve.app import AVATARS, SESSIONS
from avatarstream.serve.openapi import openapi_schema

from .helpers import A, B, SR, _app, _avatar, _pcm, _png, _run, _tone, _wav

pytestmark = pytest.mark.usefixtures("one_thread")


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
        avatar = await _avatar(client)
        assert (await client.get(f"/v1/avatars/{avatar}", headers=A)).status == 200
        r = await client.get(f"/v1/avatars/{avatar}", headers=B)
        assert r.status == 404 and "error" in await r.json()  # another key: not even confirmed
        assert (await client.get(f"/v1/avatars/{avatar}")).status == 401
        assert (await client.get("/v1/avatars/..%2F..%2Favatars.sqlite", headers=A)).status == 404
        r = await client.post("/v1/avatars", data=b"x", headers={**A, "Content-Type": "text/plain"})
        assert r.status == 415 and "unsupported" in (await r.json())["error"]
        r = await client.post("/v1/avatars", data=b"", headers={**A, "Content-Type": "image/png"})
        assert r.status == 400 and "empty" in (await r.json())["error"]
        r = await client.post("/v1/avatars", data=b"not a png" * 10,
                              headers={**A, "Content-Type": "image/png"})
        assert r.status == 400 and "error" in await r.json()
        r = await client.post("/v1/avatars", data=_png(blank=True),  # nobody in the picture
                              headers={**A, "Content-Type": "image/png"})
        assert r.status == 400 and "usable" in (await r.json())["error"]
        r = await client.post("/v1/avatars", data=b"\0" * 300_000,
                              headers={**A, "Content-Type": "video/mp4"})
        assert r.status == 413 and "limit" in (await r.json())["error"]
        r = await client.post("/v1/sessions", json={"avatar_id": avatar}, headers=B)
        assert r.status == 404  # another key cannot use it either
        r = await client.post("/v1/sessions", data=b"{", headers=A)
        assert r.status == 400 and "JSON" in (await r.json())["error"]
        r = await client.get("/v1/nothing/here")
        assert r.status == 404 and "error" in await r.json()
        assert not list((tmp_path / "data" / "avatars").glob("*.upload*"))  # no leftovers

    _run(app, body)


def test_reference_is_encoded_once_and_reused_after_a_restart(tmp_path):
    app, _ = _app(tmp_path)
    ids: dict = {}

    async def first(client):  # type: ignore[no-untyped-def]
        ids["a"] = await _avatar(client)
        assert app[AVATARS].encodes == 1
        for _ in range(2):
            r = await client.post("/v1/sessions", json={"avatar_id": ids["a"]}, headers=A)
            assert r.status == 201
            await client.delete(f"/v1/sessions/{(await r.json())['session_id']}", headers=A)
        assert app[AVATARS].encodes == 1  # sessions load the stored encoding

    _run(app, first)
    assert len(list((tmp_path / "data" / "avatars").glob("*.ref.safetensors"))) == 1
    app2, _ = _app(tmp_path)  # a restart on the same data folder

    async def second(client):  # type: ignore[no-untyped-def]
        r = await client.post("/v1/sessions", json={"avatar_id": ids["a"]}, headers=A)
        assert r.status == 201
        assert app2[AVATARS].encodes == 0
        r = await client.post("/v1/sessions", json={"avatar_id": ids["a"]}, headers=B)
        assert r.status == 404

    _run(app2, second)


def _decode_fmp4(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Video pts [N], audio sample times [M], audio samples [M] of init + fMP4 segments."""
    vpts, apts, aval = [], [], []
    with av.open(io.BytesIO(data), format="mp4") as c:
        for frame in c.decode(video=0, audio=0):
            t = float(frame.pts * frame.time_base)
            if isinstance(frame, av.VideoFrame):
                vpts.append(t)
            else:
                x = frame.to_ndarray().astype(np.float32).reshape(-1, frame.samples).mean(0)
                apts.append(t + np.arange(x.size) / frame.sample_rate)
                aval.append(x)
    return np.array(vpts), np.concatenate(apts), np.concatenate(aval)


def test_live_session_over_websocket_with_hls(tmp_path):
    app, c = _app(tmp_path)
    chunk_s = 4 * c.chunk / c.fps
    m: dict = {}

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        r = await client.post("/v1/sessions", json={"avatar_id": avatar, "hls": True}, headers=A)
        assert r.status == 201
        s = await r.json()
        sid, token = s["session_id"], s["token"]
        session = app[SESSIONS].entries[sid].session
        assert (await client.get(s["hls_url"].replace(token, "wrong"))).status == 404
        assert (await client.get(f"/v1/sessions/{sid}", headers=B)).status == 404
        ws = await client.ws_connect(s["audio_url"])
        events: list[dict] = []

        async def receive(timeout: float) -> dict:
            while True:
                msg = await ws.receive_json(timeout=timeout)
                if msg["type"] in ("speech_started", "speech_ended", "playout"):
                    events.append(msg)
                    continue
                return msg

        # 3 s of speech sent at once in 0.1 s packets: the 2 s buffer takes what fits, the
        # rest is answered with slow_down. Half a second later: interrupt.
        for p in np.split(_tone(3.0), 30):
            await ws.send_bytes(_pcm(p))
        assert (await receive(2))["type"] == "slow_down"
        await asyncio.sleep(0.5)
        m["clear_pos"] = session.frame / c.fps  # what is published at the interrupt
        await ws.send_json({"type": "clear_buffer"})
        while (reply := await receive(2))["type"] == "slow_down":
            pass
        assert reply["type"] == "cleared" and reply["dropped_s"] > 0.2, reply
        await ws.send_json({"type": "end_of_speech"})
        f0, w0 = session.frame, time.monotonic()
        await asyncio.sleep(2.0)  # idle: frames keep coming at real-time pace
        m["idle_fps"] = (session.frame - f0) / (time.monotonic() - w0)
        st = await (await client.get(f"/v1/sessions/{sid}", headers=A)).json()
        assert st["state"] == "idle" and st["utterances"] == 1
        kinds = [e["type"] for e in session.events]
        assert kinds == ["speech_started", "cleared", "speech_ended"], kinds
        assert events and events[0]["type"] == "speech_started"  # events reach the socket
        # HLS (fMP4): the playlist, its init segment and media segments, with the token.
        r = await client.get(s["hls_url"])
        assert r.status == 200
        playlist = await r.text()
        segs = [ln for ln in playlist.splitlines() if ln.startswith("segment_")]
        assert segs and all(f"token={token}" in ln for ln in segs)
        assert f'URI="init.mp4?token={token}"' in playlist
        parts = [await (await client.get(f"/v1/sessions/{sid}/hls/init.mp4?token={token}")).read()]
        parts += [await (await client.get(f"/v1/sessions/{sid}/hls/{ln}")).read() for ln in segs]
        m["hls"] = b"".join(parts)
        bad = await client.get(f"/v1/sessions/{sid}/hls/..%2F..%2Favatars.sqlite?token={token}")
        assert bad.status == 404
        # Back-pressure: 20 s of audio pushed instantly never queues beyond the 2 s bound.
        for p in np.split(_tone(20.0), 200):
            await ws.send_bytes(_pcm(p))
        await ws.send_json({"type": "keep_alive"})
        await ws.send_json({"type": "marker"})  # unknown: answered with an error, ends the count
        slow = 0
        while True:
            msg = await receive(5)
            if msg["type"] == "slow_down":
                slow += 1
            else:
                assert msg["type"] == "error" and "control messages" in msg["error"]
                break
        m["slow"] = slow
        m["peak_buffered_s"] = session.queue.peak_buffered / SR
        await ws.send_bytes(b"\x00")  # odd byte count: a clear error, the socket stays open
        assert "even" in (await receive(2))["error"]
        await ws.close()
        assert (await client.delete(f"/v1/sessions/{sid}", headers=A)).status == 204
        assert sid not in app[SESSIONS].entries and not session.running
        assert not (tmp_path / "data" / "sessions" / sid).exists()
        assert (await client.get(s["hls_url"])).status == 404

    _run(app, body)
    assert m["slow"] > 0 and m["peak_buffered_s"] <= 2.0 + 1e-6
    assert 25 * 0.6 < m["idle_fps"] < 25 * 1.6, m["idle_fps"]
    vpts, apts, aval = _decode_fmp4(m["hls"])
    assert vpts.size > 25 and np.allclose(np.diff(vpts), 1 / 25, atol=1e-3)
    loud = apts[np.abs(aval) > 0.1]
    assert loud.size
    interrupt_latency = loud.max() - m["clear_pos"]
    assert interrupt_latency <= chunk_s + 0.15, interrupt_latency  # within one chunk
    assert apts.max() > loud.max() + 0.5  # silence after the interrupt
    print(f"\nserve: interrupt latency {interrupt_latency:.2f} s of media (chunk {chunk_s:.2f} s), "
          f"idle {m['idle_fps']:.1f} fps, {m['slow']} slow_down, peak buffer "
          f"{m['peak_buffered_s']:.2f} s")


def test_text_to_speech_and_its_errors(tmp_path):
    app, _ = _app(tmp_path)

    async def body(client):  # type: ignore[no-untyped-def]
        voices = await (await client.get("/v1/voices")).json()
        assert voices["default"] in [v["id"] for v in voices["voices"]]
        avatar = await _avatar(client)
        s = await (await client.post("/v1/sessions", json={"avatar_id": avatar}, headers=A)).json()
        url = s["say_url"]
        r = await client.post(url, json={"text": "Hello there."})
        assert r.status == 202 and 0.3 < (await r.json())["seconds"] < 3
        for bad, word in [({"text": "   "}, "empty"), ({"text": "x" * 3000}, "limit"),
                          ({"text": "hi", "voice": "espeak:xx"}, "voice"), ({"text": 3}, "text")]:
            r = await client.post(url, json=bad)
            assert r.status == 400 and word in (await r.json())["error"], bad
        r = await client.post(url.replace(s["token"], "nope"), json={"text": "hi"})
        assert r.status == 404
        session = app[SESSIONS].entries[s["session_id"]].session
        deadline = time.monotonic() + 10
        while not any(e["type"] == "speech_ended" for e in session.events):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        r = await client.post(f"/v1/sessions/{s['session_id']}/interrupt", headers=A)
        assert r.status == 200 and (await r.json())["dropped_s"] == 0
        r = await client.post(f"/v1/sessions/{s['session_id']}/offer", headers=A,
                              json={"sdp": "not sdp", "type": "offer"})
        assert r.status in (400, 500) and "error" in await r.json()

    _run(app, body)


def test_admission_refuses_what_it_cannot_serve_in_real_time(tmp_path):
    app, _ = _app(tmp_path, max_sessions=2)

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        made = []
        for _ in range(2):
            r = await client.post("/v1/sessions", json={"avatar_id": avatar}, headers=A)
            assert r.status == 201
            made.append((await r.json())["session_id"])
        r = await client.post("/v1/sessions", json={"avatar_id": avatar}, headers=A)
        assert r.status == 503 and r.headers["Retry-After"]
        assert "capacity" in (await r.json())["error"]
        server = await (await client.get("/v1/server")).json()
        assert server["live_sessions"] == 2 and server["refused"] == 1
        await client.delete(f"/v1/sessions/{made[0]}", headers=A)
        r = await client.post("/v1/sessions", json={"avatar_id": avatar}, headers=A)
        assert r.status == 201  # room again

    _run(app, body)


def test_render_job_writes_a_file_with_progress(tmp_path):
    app, c = _app(tmp_path)

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        r = await client.post(f"/v1/renders?avatar_id={avatar}", data=_wav(2.0),
                              headers={**A, "Content-Type": "audio/wav"})
        assert r.status == 202, await r.text()
        job = await r.json()
        assert job["total_frames"] == 50 and job["state"] in ("queued", "running")
        seen = []
        while job["state"] not in ("done", "failed"):
            await asyncio.sleep(0.05)
            job = await (await client.get(f"/v1/renders/{job['id']}", headers=A)).json()
            seen.append(job["progress"])
        assert job["state"] == "done" and job["progress"] == 1.0 and job["frames"] == 50
        assert seen == sorted(seen)
        # signed, and no path of the server's in the answer (issue 37: the certificate's was)
        assert job["content_credentials"]["signed"] is True
        text = json.dumps(job)
        for server_path in (str(signing_identity().certificate), str(tmp_path), str(Path.home())):
            assert server_path not in text, (server_path, text)
        assert (await client.get(f"/v1/renders/{job['id']}", headers=B)).status == 404
        r = await client.get(job["output_url"], headers=A)
        assert r.status == 200
        path = tmp_path / "render.mp4"
        path.write_bytes(await r.read())
        with av.open(str(path)) as cont:
            assert sum(1 for _ in cont.decode(video=0)) == 50
        r = await client.post("/v1/renders", json={"avatar_id": avatar, "text": "Hi."}, headers=A)
        assert r.status == 202
        assert (await client.delete(f"/v1/renders/{(await r.json())['id']}", headers=A)).status == 204
        for data, ctype, status in [(b"junk", "audio/wav", 400), (b"x", "text/plain", 415),
                                    (_wav(31.0), "audio/wav", 400)]:
            r = await client.post(f"/v1/renders?avatar_id={avatar}", data=data,
                                  headers={**A, "Content-Type": ctype})
            assert r.status == status and "error" in await r.json(), (ctype, status, await r.text())

    _run(app, body)


def test_live_hls_is_a_bounded_sliding_window(tmp_path):
    """An open-ended session's HLS keeps the last LIVE_SEGMENTS segments (playlist and disk),
    not every segment since it started; what is listed still decodes from init.mp4."""
    import av

    from avatarstream.media.frames import AudioChunk, VideoChunk
    from avatarstream.serve.hls import INIT, LIVE_SEGMENTS, FMP4HLSSink

    sink = FMP4HLSSink(tmp_path / "hls", segment_seconds=0.2)
    sink.open(64, 64, 25, 16000)
    for i in range(40):  # 8 s of 0.2 s chunks -> ~40 segments made
        frames = np.full((5, 64, 64, 3), (i * 6) % 255, np.uint8)
        sink.write_video(VideoChunk(frames=frames, start_frame=5 * i, fps=25))
        sink.write_audio(AudioChunk(samples=np.zeros(3200, np.float32), start_sample=3200 * i,
                                    sample_rate=16000))
        if i == 20:
            on_disk_mid = len(list((tmp_path / "hls").glob("segment_*.m4s")))
    sink.close()
    playlist = (tmp_path / "hls" / "index.m3u8").read_text()
    listed = [ln for ln in playlist.splitlines() if ln.startswith("segment_")]
    on_disk = sorted((tmp_path / "hls").glob("segment_*.m4s"))
    assert "PLAYLIST-TYPE:EVENT" not in playlist
    assert 0 < len(listed) <= LIVE_SEGMENTS
    assert on_disk_mid <= LIVE_SEGMENTS + 2 and len(on_disk) <= LIVE_SEGMENTS + 2
    assert listed[-1] == on_disk[-1].name and int(listed[0][8:13]) > 0  # old ones are gone
    data = (tmp_path / "hls" / INIT).read_bytes() + b"".join((tmp_path / "hls" / n).read_bytes() for n in listed)
    (tmp_path / "joined.mp4").write_bytes(data)
    with av.open(str(tmp_path / "joined.mp4")) as c:
        n = sum(1 for _ in c.decode(video=0))
    assert n >= 25 * 0.2 * (len(listed) - 1)
