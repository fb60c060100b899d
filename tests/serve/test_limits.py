"""Bounded work per request and the reproduced server bugs of issue 30 that a loopback test
server shows (tiny-random, in process): each limit named in --help and /openapi.json and checked
before the work; the bearer scheme in any case; /v1/server behind the key; no server path in an
error; deep JSON refused, not a 500; WebSocket packets up to the limit taken, one byte over closed
with a reason; leftovers of killed uploads removed; renders that outlive the server; a full disk
answered 507."""

from __future__ import annotations

import asyncio
import errno
import subprocess
import sys
import threading
import time

import aiohttp
import av
import pytest

from avatarstream.errors import InputError
from avatarstream.serve.app import AVATARS, CONFIG
from avatarstream.serve.limits import LIMIT_OPTIONS, Limits, json_depth, parse_json

from .helpers import A, B, _app, _avatar, _finished_render, _png, _run, _wav

pytestmark = pytest.mark.usefixtures("one_thread")
DEEP = b"[" * 200_000  # over the JSON size limit too


def test_every_limit_is_named_in_help_and_openapi(tmp_path):
    out = subprocess.run([sys.executable, "-m", "avatarstream.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=60).stdout
    app, _ = _app(tmp_path, max_json_depth=7)

    async def body(client):  # type: ignore[no-untyped-def]
        return await (await client.get("/openapi.json")).json()

    stated = _run(app, body)["info"]["x-limits"]
    assert set(stated) == {f.name for f in LIMIT_OPTIONS} == set(Limits.__dataclass_fields__)
    for o in LIMIT_OPTIONS:
        assert o.flag in out, o.flag
        assert stated[o.name]["option"].startswith(o.flag)
    assert stated["max_json_depth"]["value"] == 7  # the server's own, not the defaults
    r = subprocess.run([sys.executable, "-m", "avatarstream.cli", "serve", "--max-json-depth", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--max-json-depth must be positive" in r.stderr
    assert "Traceback" not in r.stderr


def test_json_depth_counts_brackets_outside_strings():
    assert json_depth('{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert json_depth('["\\"[[[", []]') == 2
    limits = Limits(max_json_depth=3, max_json_bytes=10_000)
    assert parse_json(b'{"a": [[1]]}', limits) == {"a": [[1]]}
    for bad, word in [(b'{"a": [[[1]]]}', "nested 4"), (b"x" * 10_001, "limit"),
                      (b"1" * 5000, "JSON"), (b"\xff", "UTF-8"), (b"{", "valid JSON")]:
        with pytest.raises(InputError, match=word):
            parse_json(bad, limits)


def test_bearer_scheme_is_case_insensitive_and_server_needs_the_key(tmp_path):
    """Bugs 10 and 15."""
    app, _ = _app(tmp_path, api_keys=frozenset({"K"}))

    async def body(client):  # type: ignore[no-untyped-def]
        for auth in ("Bearer K", "bearer K", "BEARER K", "bEaReR   K"):
            r = await client.get("/v1/avatars/" + "0" * 24, headers={"Authorization": auth})
            assert r.status == 404, auth  # accepted: the avatar just does not exist
        for auth in ("Basic K", "Bearer", "BearerK", "Bearer k"):
            r = await client.get("/v1/avatars/" + "0" * 24, headers={"Authorization": auth})
            assert r.status == 401, auth
        r = await client.get("/v1/server")
        assert r.status == 401 and "Bearer" in (await r.json())["error"]
        assert (await client.get("/v1/server", headers={"Authorization": "Bearer other"})).status == 401
        assert (await client.get("/v1/server", headers={"Authorization": "bearer K"})).status == 200
        assert (await client.get("/v1/voices")).status == 200  # public, like the schema

    _run(app, body)
    open_app, _ = _app(tmp_path / "open")  # without --api-key: any key, and /v1/server is open

    async def open_body(client):  # type: ignore[no-untyped-def]
        assert (await client.get("/v1/server")).status == 200

    _run(open_app, open_body)


def test_reference_pixels_are_refused_from_the_header_before_decoding(tmp_path, monkeypatch):
    """Bug 3 (the check; test_faults.py measures the memory of a real server)."""
    import avatarstream.serve.avatars as avatars

    app, _ = _app(tmp_path, max_pixels=96 * 96 - 1)
    decoded = []
    monkeypatch.setattr(avatars, "load_reference", lambda *a, **k: decoded.append(1))

    async def body(client):  # type: ignore[no-untyped-def]
        r = await client.post("/v1/avatars", data=_png(96), headers={**A, "Content-Type": "image/png"})
        assert r.status == 400 and "pixels" in (await r.json())["error"]

    _run(app, body)
    assert not decoded


def test_uploads_are_read_and_decoded_a_few_at_a_time(tmp_path):
    """Bug 3: at most max_parallel_uploads uploads are in the store at once; the others wait."""
    app, _ = _app(tmp_path, max_parallel_uploads=1)
    store = app[AVATARS]
    create, lock, now = store.create, threading.Lock(), [0, 0]

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        with lock:
            now[0] += 1
            now[1] = max(now)
        try:
            time.sleep(0.2)
            return create(*args, **kw)
        finally:
            with lock:
                now[0] -= 1

    store.create = counted  # type: ignore[method-assign]

    async def body(client):  # type: ignore[no-untyped-def]
        ids = await asyncio.gather(*[_avatar(client) for _ in range(3)])
        assert len(set(ids)) == 3

    _run(app, body)
    assert now[1] == 1


def test_errors_name_no_server_path(tmp_path):
    """Bug 7: the store's own copy of an upload is never named to the client."""
    app, _ = _app(tmp_path)
    png = _png(96)

    async def body(client):  # type: ignore[no-untyped-def]
        for data, ctype in [(png[:60] + b"garbage" * 50, "image/png"), (b"garbage" * 50, "image/png"),
                            (b"garbage" * 50, "video/mp4"), (png[:200], "image/webp"),
                            (b"\x1aE\xdf\xa3" + b"\0" * 300, "video/webm")]:
            r = await client.post("/v1/avatars", data=data, headers={**A, "Content-Type": ctype})
            message = (await r.json())["error"]
            assert r.status == 400, message
            assert "upload." not in message and str(tmp_path) not in message, message
            assert "avatars/" not in message and "data/" not in message, message
        r = await client.post("/v1/renders?avatar_id=" + await _avatar(client), data=b"junk",
                              headers={**A, "Content-Type": "audio/wav"})
        message = (await r.json())["error"]
        assert r.status == 400 and "tmp" not in message and str(tmp_path) not in message

    _run(app, body)


def test_deep_or_large_json_is_refused_before_parsing(tmp_path):
    """Bug 8: JSON nested 100,000 deep is a 400, not a 500 (RecursionError)."""
    app, _ = _app(tmp_path)
    json_headers = {**A, "Content-Type": "application/json"}

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        s = await (await client.post("/v1/sessions", json={"avatar_id": avatar}, headers=A)).json()
        for url in ["/v1/sessions", "/v1/renders", s["say_url"], s["offer_url"]]:
            r = await client.post(url, data=DEEP[:50_000], headers=json_headers)
            assert r.status == 400 and "nested" in (await r.json())["error"], url
            r = await client.post(url, data=DEEP, headers=json_headers)  # also over the size
            assert r.status == 413 and "limit" in (await r.json())["error"], url
        ws = await client.ws_connect(s["audio_url"])
        await ws.send_str("[" * 10_000)
        assert "nested" in (await ws.receive_json(timeout=5))["error"]
        await ws.send_json({"type": "keep_alive"})  # the socket is still open
        await ws.send_json({"type": "marker"})
        assert "control messages" in (await ws.receive_json(timeout=5))["error"]
        await ws.close()

    _run(app, body)


def test_websocket_packet_limit_is_inclusive_and_its_excess_closes_with_a_reason(tmp_path):
    """Bug 9: a packet of exactly max_packet_bytes is taken; one byte more closes with 1009 and
    a reason that names the limit."""
    app, _ = _app(tmp_path)
    limit = app[CONFIG].limits.max_packet_bytes

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        s = await (await client.post("/v1/sessions", json={"avatar_id": avatar}, headers=A)).json()
        # found by the fuzzing: a token that is not ASCII was a 500 (compare_digest's TypeError)
        r = await client.get(f"/v1/sessions/{s['session_id']}?token=%C3%A9")
        assert r.status == 404
        ws = await client.ws_connect(s["audio_url"])
        await ws.send_bytes(b"\0\1" * (limit // 2))
        await ws.send_json({"type": "marker"})
        while (msg := await ws.receive_json(timeout=5))["type"] != "error":
            assert msg["type"] in ("slow_down", "speech_started", "speech_ended", "playout"), msg
        await ws.send_bytes(b"\0" * (limit + 1))
        msg = await ws.receive(timeout=5)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1009
        assert f"at most {limit} bytes" in msg.extra, msg.extra

    _run(app, body)


def test_leftovers_of_interrupted_uploads_are_removed_at_start(tmp_path):
    """Bug 11: `*.upload.*` files (and partial writes, files without a row) of a killed server
    are removed when the next one starts; the avatars stay."""
    app, _ = _app(tmp_path)

    async def body(client):  # type: ignore[no-untyped-def]
        return await _avatar(client)

    avatar = _run(app, body)
    d = tmp_path / "data" / "avatars"
    kept = sorted(p.name for p in d.iterdir())
    stale = [d / "0123456789abcdef01234567.upload.png", d / f"{avatar}.safetensors.partial",
             d / "89abcdef0123456789abcdef.safetensors", d / f"{avatar}.x.ref.safetensors.tmp"]
    for p in stale:
        p.write_bytes(b"x" * 100)
    (tmp_path / "data" / "sessions" / "0123456789abcdef01234567" / "hls").mkdir(parents=True)
    _app(tmp_path)
    assert sorted(p.name for p in d.iterdir()) == kept
    assert not list((tmp_path / "data" / "sessions").iterdir())


def test_renders_survive_a_restart(tmp_path):
    """Bug 12: a finished render is answered (and its MP4 served) by the next server on the
    same data folder; one still running when the server stopped is reported failed."""
    app, _ = _app(tmp_path)
    ids: dict = {}

    async def first(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        job = await _finished_render(client, avatar, _wav(1.0))
        assert job["state"] == "done"
        ids["done"] = job["id"]
        r = await client.post(f"/v1/renders?avatar_id={avatar}", data=_wav(29.0),
                              headers={**A, "Content-Type": "audio/wav"})
        ids["running"] = (await r.json())["id"]  # the server stops before it is done

    _run(app, first)
    app2, _ = _app(tmp_path)

    async def second(client):  # type: ignore[no-untyped-def]
        job = await (await client.get(f"/v1/renders/{ids['done']}", headers=A)).json()
        assert job["state"] == "done" and job["frames"] == 25, job
        r = await client.get(job["output_url"], headers=A)
        assert r.status == 200
        (tmp_path / "out.mp4").write_bytes(await r.read())
        with av.open(str(tmp_path / "out.mp4")) as c:
            assert sum(1 for _ in c.decode(video=0)) == 25
        assert (await client.get(f"/v1/renders/{ids['done']}", headers=B)).status == 404
        job = await (await client.get(f"/v1/renders/{ids['running']}", headers=A)).json()
        assert job["state"] == "failed" and "stopped" in job["error"], job
        assert (await client.delete(f"/v1/renders/{ids['done']}", headers=A)).status == 204
        assert (await client.get(f"/v1/renders/{ids['done']}", headers=A)).status == 404
        assert (await client.get(job["output_url"].replace(ids["running"], ids["done"]),
                                 headers=A)).status == 404

    _run(app2, second)
    assert not (tmp_path / "data" / "renders" / f"{ids['done']}.mp4").exists()


def test_a_full_disk_is_answered_507(tmp_path, monkeypatch):
    import avatarstream.serve.avatars as avatars

    def full(*a, **k):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(avatars, "save_file", full)
    app, _ = _app(tmp_path)

    async def body(client):  # type: ignore[no-untyped-def]
        r = await client.post("/v1/avatars", data=_png(), headers={**A, "Content-Type": "image/png"})
        assert r.status == 507 and "space" in (await r.json())["error"]

    _run(app, body)
    assert not [p for p in (tmp_path / "data" / "avatars").iterdir()]  # nothing half-written


def test_a_stalled_or_trickling_body_is_cut_with_408_and_frees_its_upload_slot(tmp_path):
    """A client that sends the headers and part of the body, then nothing (or a byte now and
    then), holds the only upload slot: it gets 408 and its connection closed after
    body_idle_seconds, and the upload waiting behind it goes through."""
    app, _ = _app(tmp_path, max_parallel_uploads=1, body_idle_seconds=0.5)

    async def stalled(client, trickle: bool) -> tuple[bytes, float]:  # type: ignore[no-untyped-def]
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/avatars HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                     b"Content-Type: image/png\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100)
        await writer.drain()
        t0 = time.monotonic()
        answer = b""
        while b"}" not in answer and time.monotonic() - t0 < 30:
            try:
                part = await asyncio.wait_for(reader.read(4096), 0.3)
            except TimeoutError:
                if trickle:  # never idle for 0.5 s, but ~3 bytes/s is far under the rate
                    writer.write(b"x")
                    await writer.drain()
                continue
            if not part:
                break
            answer += part
        writer.close()
        return answer, time.monotonic() - t0

    async def body(client):  # type: ignore[no-untyped-def]
        for trickle in (False, True):
            staller = asyncio.create_task(stalled(client, trickle))
            await asyncio.sleep(0.1)  # it holds the slot now
            t0 = time.monotonic()
            avatar = await _avatar(client)  # waits for the slot, then goes through
            waited = time.monotonic() - t0
            answer, cut_after = await staller
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"Connection: close" in answer and b"stalled" in answer and avatar
            assert 0.4 <= cut_after < 10 and waited < 20

    _run(app, body)
