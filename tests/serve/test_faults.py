"""Faults against real `avatarstream serve` processes on loopback (tiny-random): what a large
picture costs the server's memory (bug 3), a request aiohttp cannot parse (bug 14), the server
killed (SIGKILL) mid-session and restarted, a client that vanishes mid-session, and a disk that
fills during a live session's HLS output (a real full file system where the test may mount one,
as root; the same fault injected into a test server in process otherwise, and always)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from avatarstream.media.image import write_png
from avatarstream.serve.client import ServerProcess

from .helpers import A, _app, _avatar, _pcm, _png, _run, _tone

ARGS = ("--max-sessions", "2", "--playout-delay", "0.3")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _post(url: str, data: bytes, ctype: str) -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={**A, "Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_large_pictures_are_refused_without_costing_memory(tmp_path):
    """Bug 3: three parallel uploads of an 8000x8000 PNG (a ~200 KB file) cost the server no
    memory worth naming: refused from the header, never decoded (it was ~0.8 GB each)."""
    img = np.zeros((8000, 8000, 3), np.uint8)
    img[::50] = 200
    big = write_png(tmp_path / "big.png", img).read_bytes()
    del img
    assert len(big) < 400_000
    with ServerProcess(tmp_path / "data", args=ARGS) as server:
        before = _peak_rss_mb(server.proc.pid)
        out: list = []
        threads = [threading.Thread(target=lambda: out.append(
            _post(server.url + "/v1/avatars", big, "image/png"))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grown = _peak_rss_mb(server.proc.pid) - before
    assert [s for s, _ in out] == [400] * 3 and all("8000x8000" in m for _, m in out), out
    assert grown < 100, f"the server's peak memory grew by {grown:.0f} MB"


def test_an_overlong_request_line_is_a_json_400_without_a_traceback(tmp_path):
    """Bug 14."""
    with ServerProcess(tmp_path / "data", args=ARGS) as server:
        for request in (b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET / HTTP/1.1\r\nX-Big: " + b"b" * 20_000 + b"\r\n\r\n",
                        b"\x16\x03\x01 not http\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(request)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.split(b"\r\n")[0].endswith(b" 400 Bad Request"), head
            assert b"Content-Type: application/json" in head, head
            assert b'"error"' in body and b"aaaa" not in body, body
        with urllib.request.urlopen(server.url + "/v1/voices", timeout=10) as r:
            assert r.status == 200  # and it goes on serving
    log = server.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert log.count("refused a request") == 3


async def _open_session(http: aiohttp.ClientSession, url: str, avatar: str,
                        **body: object) -> tuple[dict, aiohttp.ClientWebSocketResponse]:
    async with http.post(url + "/v1/sessions", json={"avatar_id": avatar, **body}) as r:
        assert r.status == 201, await r.text()
        s = await r.json()
    return s, await http.ws_connect(url + s["audio_url"])


async def _until(ws: aiohttp.ClientWebSocketResponse, kind: str, timeout: float = 30) -> dict:
    """The first event of `kind` (other messages skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
        assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, msg.data, msg.extra)
        event = msg.json()
        if event.get("type") == kind:
            return event


def test_a_killed_server_restarts_with_its_avatars_and_clients_start_again(tmp_path):
    data = tmp_path / "data"
    m: dict = {}

    async def before_kill(server: ServerProcess) -> None:
        async with aiohttp.ClientSession(headers=A) as http:
            async with http.post(server.url + "/v1/avatars", data=_png(),
                                 headers={"Content-Type": "image/png"}) as r:
                m["avatar"] = await r.json()
            m["session"], ws = await _open_session(http, server.url, m["avatar"]["id"], hls=True)
            await ws.send_bytes(_pcm(_tone(1.0)))
            await _until(ws, "speech_started")
            server.proc.send_signal(signal.SIGKILL)  # mid-session, speech queued
            msg = await ws.receive(timeout=10)
            m["closed"] = msg.type  # the connection ends: the client is not left hanging

    with ServerProcess(data, args=ARGS) as server:
        asyncio.run(before_kill(server))
        server.proc.wait(10)
    assert m["closed"] in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.ERROR)
    (data / "avatars" / "0123456789abcdef01234567.upload.png").write_bytes(b"x")  # a killed upload
    assert list((data / "sessions").iterdir())  # what the killed server left

    async def after_restart(server: ServerProcess) -> None:
        async with aiohttp.ClientSession(headers=A) as http:
            async with http.get(f"{server.url}/v1/avatars/{m['avatar']['id']}") as r:
                assert r.status == 200 and await r.json() == m["avatar"]
            async with http.get(f"{server.url}/v1/sessions/{m['session']['session_id']}") as r:
                assert r.status == 404 and "error" in await r.json()  # a clean answer
            _, ws = await _open_session(http, server.url, m["avatar"]["id"])
            await ws.send_bytes(_pcm(_tone(0.5)))
            await ws.send_json({"type": "end_of_speech"})
            await _until(ws, "speech_ended")
            server.proc.send_signal(signal.SIGTERM)  # a graceful stop tells the client why
            msg = await ws.receive(timeout=15)
            while msg.type == aiohttp.WSMsgType.TEXT:
                msg = await ws.receive(timeout=15)
            m["close"] = (msg.type, msg.data, msg.extra)

    with ServerProcess(data, args=ARGS) as server:
        assert not list((data / "sessions").iterdir())
        assert not list((data / "avatars").glob("*.upload.*"))
        asyncio.run(after_restart(server))
        server.proc.wait(15)
    assert m["close"][:2] == (aiohttp.WSMsgType.CLOSE, 1001) and "shutting down" in m["close"][2]


_VANISHING_CLIENT = """
import asyncio, os, sys, aiohttp
async def main():
    url, avatar = sys.argv[1], sys.argv[2]
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as http:
        async with http.post(url + "/v1/sessions", json={"avatar_id": avatar}) as r:
            s = await r.json()
        print(s["session_id"], flush=True)
        ws = await http.ws_connect(url + s["audio_url"])
        await ws.send_bytes(b"\\1\\2" * 8000)
        await asyncio.sleep(0.3)
        os.kill(os.getpid(), 9)  # gone: no close frame, no DELETE
asyncio.run(main())
"""


def test_a_vanished_client_is_freed_within_the_idle_timeout(tmp_path):
    with ServerProcess(tmp_path / "data", args=(*ARGS, "--idle-timeout", "2")) as server:
        avatar = json.loads(_post(server.url + "/v1/avatars", _png(), "image/png")[1])["id"]
        r = subprocess.run([sys.executable, "-c", _VANISHING_CLIENT, server.url, avatar],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == -9, r.stderr
        sid = r.stdout.strip()
        assert (tmp_path / "data" / "sessions").exists()
        deadline = time.monotonic() + 30  # generous: the idle timeout is 2 s, reaping 1 s
        while True:
            with urllib.request.urlopen(server.url + "/v1/server", timeout=10) as resp:
                live = json.loads(resp.read())["live_sessions"]
            if live == 0 and not (tmp_path / "data" / "sessions" / sid).exists():
                break
            assert time.monotonic() < deadline, "the session was not freed"
            time.sleep(0.2)
        status, _ = _post(server.url + "/v1/sessions", b'{"avatar_id": "%s"}' % avatar.encode(),
                          "application/json")
        assert status == 201


def _disk_full_session(url: str, fill: Callable[[], None], free: Callable[[], None]) -> dict:
    """Open an HLS session, wait for its first segment, fill the disk: the session_ended event
    and what the server answers afterwards."""
    out: dict = {}

    async def main() -> None:
        async with aiohttp.ClientSession(headers=A) as http:
            async with http.post(url + "/v1/avatars", data=_png(),
                                 headers={"Content-Type": "image/png"}) as r:
                avatar = (await r.json())["id"]
            s, ws = await _open_session(http, url, avatar, hls=True)
            for _ in range(200):
                async with http.get(url + s["hls_url"]) as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.05)
            fill()
            out["ended"] = await _until(ws, "session_ended", timeout=30)
            free()
            async with http.get(url + "/v1/server") as r:
                out["server"] = r.status
            _, ws2 = await _open_session(http, url, avatar, hls=True)
            await ws2.send_json({"type": "keep_alive"})
            await ws2.send_json({"type": "marker"})
            out["alive"] = (await _until(ws2, "error"))["error"]

    asyncio.run(main())
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small file system needs root (the "
                    "injected version below runs anyway)")
def test_a_full_disk_ends_the_live_session_with_a_clear_event(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    filler = disk / "filler"

    def fill() -> None:
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
            except OSError:
                pass

    try:
        with ServerProcess(disk / "data", args=ARGS, log=tmp_path / "server.log") as server:
            out = _disk_full_session(server.url, fill, lambda: filler.unlink())
            assert server.proc.poll() is None  # the server lives
    finally:
        subprocess.run(["umount", "-l", str(disk)])
    assert out["ended"]["reason"] == "error" and "no space left" in out["ended"]["error"], out
    assert "/" not in out["ended"]["error"].replace("KiB", "")
    assert out["server"] == 200 and "control messages" in out["alive"]
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_a_full_disk_injected_ends_the_session_not_the_server(tmp_path, monkeypatch):
    """The same fault, injected: the HLS sink's free-space reading says the disk is full."""
    import avatarstream.serve.hls as hls

    free = {"bytes": None}
    real = hls.free_bytes
    monkeypatch.setattr(hls, "free_bytes", lambda p: real(p) if free["bytes"] is None else free["bytes"])
    app, _ = _app(tmp_path)

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        s = await (await client.post("/v1/sessions", json={"avatar_id": avatar, "hls": True},
                                     headers=A)).json()
        ws = await client.ws_connect(s["audio_url"])
        free["bytes"] = 0
        ended = await _until(ws, "session_ended")
        free["bytes"] = None
        assert (await client.get("/v1/server")).status == 200
        assert (await client.post("/v1/sessions", json={"avatar_id": avatar, "hls": True},
                                  headers=A)).status == 201
        return ended

    ended = _run(app, body)
    assert ended["reason"] == "error" and "no space left on device" in ended["error"], ended
