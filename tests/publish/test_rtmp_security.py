"""RTMP as an attacker would use it (issue 38: items 1, 3, 8 and 10; issue 37 item 7): hostile
`rtmp_url`s, the default allow-list, admission before any connection, a tarpit target, secrets in
responses, errors and logs. Real sockets on loopback and a real nginx-rtmp (tests/nginx_rtmp.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from nginx_rtmp import NginxRTMP, free_port, missing

from avatarstream.errors import ConfigError
from avatarstream.publish.rtmp_url import parse_rtmp_url
from avatarstream.serve.app import CONFIG, SESSIONS
from avatarstream.serve.rtmp_gate import RTMPPolicy

needs_nginx = pytest.mark.skipif(missing() is not None, reason=str(missing()))
REFUSED = "this server does not push to"


class Listener(threading.Thread):
    """A TCP server on `host` that counts the connections it accepts (and closes them)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.done.set()
        self.join(2)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = Listener()
    yield lst
    lst.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NginxRTMP]:
    with NginxRTMP(tmp_path / "nginx") as s:
        yield s


def _server_app(tmp_path: Path, allow: tuple[str, ...] | None = None, **kw):  # type: ignore[no-untyped-def]
    from serve.helpers import _app

    app, config = _app(tmp_path, **kw)
    if allow is not None:
        app[CONFIG] = dataclasses.replace(app[CONFIG], rtmp_allow=allow)
    return app


async def _create(client, avatar: str, url: object, headers: dict):  # type: ignore[no-untyped-def]
    r = await client.post("/v1/sessions", json={"avatar_id": avatar, "rtmp_url": url}, headers=headers)
    return r.status, await r.json()


def _publishing(server: NginxRTMP) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/stat", timeout=2) as r:
        return "<publishing/>" in r.read().decode()


def test_hostile_url_strings_are_refused_or_rebuilt() -> None:
    """What FFmpeg is given is rebuilt from the parsed parts: never a NUL, a space or an upper-case
    scheme it would read otherwise; malformed ports and hosts are one ConfigError."""
    for url in ("rtmp://127.0.0.2:1935\x00@localhost:1935/app/SECRETK", " rtmp://h/live/SECRETK",
                "rtmp://h/live/SECRETK ", "rtmp://h/li ve/SECRETK", "rtmp://h/live/SECRETK\n",
                "rtmp://h:99999/a/SECRETK", "rtmp://h:abc/a/SECRETK", "rtmp://[::1/a/SECRETK",
                "rtmp://h:0/a/SECRETK", "rtmp://a@b@h/x/SECRETK", "rtmp://h/live/SECRETK#x",
                "rtmp://hé.example/live/SECRETK", "http://h/live/SECRETK", "rtmp:/h/SECRETK"):
        with pytest.raises(ConfigError) as e:
            parse_rtmp_url(url)
        assert "\n" not in str(e.value) and "SECRETK" not in str(e.value), str(e.value)
    t = parse_rtmp_url("RTMP://User:Pw@Ingest.Example.com:1935/live/KEY/")
    assert t.ffmpeg_url() == "rtmp://User:Pw@ingest.example.com:1935/live/KEY/"
    assert t.ffmpeg_url("203.0.113.9") == "rtmp://User:Pw@203.0.113.9:1935/live/KEY/"
    assert t.shown == "rtmp://***@ingest.example.com:1935/live/***"
    assert parse_rtmp_url("rtmp://h/KEY").shown == "rtmp://h/***"  # one part: the key alone
    assert parse_rtmp_url("rtmps://[2001:db8::1]/app/k?x=1").ffmpeg_url("::1") == "rtmps://[::1]:443/app/k?x=1"


def test_the_default_policy_admits_public_addresses_only() -> None:
    star = RTMPPolicy.parse(("*",))
    for ip in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0",
               "100.64.0.1", "224.0.0.1", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::"):
        assert not star.admits("x.example.com", ip), ip
    assert star.admits("x.example.com", "8.8.8.8") and star.admits("x", "2606:4700::1111")
    named = RTMPPolicy.parse(("localhost", "*.corp.example", "10.0.0.0/8"))
    assert named.admits("localhost", "127.0.0.1")  # named exactly: any address
    assert not named.admits("a.corp.example", "192.168.0.1")  # a pattern: public only
    assert named.admits("a.corp.example", "10.9.9.9") and named.admits("anything", "10.0.0.1")
    assert not RTMPPolicy.parse(("example.com",)).admits("example.com.evil.net", "8.8.8.8")
    with pytest.raises(ConfigError, match="--rtmp-allow"):
        RTMPPolicy.parse(("10.0.0.0/33",))


def test_an_embedded_nul_cannot_reach_a_host_off_the_list(tmp_path: Path) -> None:
    """Issue 38.1: with `--rtmp-allow localhost`, "rtmp://127.0.0.2:P\\0@localhost:Q/app/key" was
    201 and FFmpeg connected to 127.0.0.2:P (it reads up to the NUL). Now: a 400, and nothing ever
    connects to 127.0.0.2:P."""
    from serve.helpers import A, _avatar, _run

    hidden, allowed = Listener("127.0.0.2"), Listener("127.0.0.1")
    app = _server_app(tmp_path, allow=("localhost",))

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        for url in (f"rtmp://127.0.0.2:{hidden.port}\x00@localhost:{allowed.port}/app/key",
                    f"rtmp://127.0.0.2:{hidden.port}%00@localhost:{allowed.port}/app/key"):
            status, out = await _create(client, avatar, url, A)
            await asyncio.sleep(1.0)  # a sink's thread would connect by now
            assert status in (400, 201), out
            if status == 201:  # %00 is text in the user part: the stream goes to localhost
                await client.delete(f"/v1/sessions/{out['session_id']}", headers=A)
        return hidden.accepted

    try:
        assert _run(app, body, timeout=60) == 0
    finally:
        hidden.close()
        allowed.close()


def test_loopback_private_and_link_local_are_refused_by_default(tmp_path: Path,
                                                               listener: Listener) -> None:
    """Issue 38.3: by default (`*`) a session cannot make the server connect to loopback, private
    or link-local addresses; the 400 says the same for a name that does not resolve (it maps
    nothing) and no connection is made. Named (host or network), loopback is taken."""
    from serve.helpers import A, _avatar, _run

    p = listener.port
    app = _server_app(tmp_path)  # the default --rtmp-allow

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        messages = set()
        for host in ("127.0.0.1", "localhost", "[::1]", "[::ffff:127.0.0.1]", "0.0.0.0", "10.0.0.1",
                     "192.168.0.1", "169.254.169.254", "no-such-host.invalid"):
            status, out = await _create(client, avatar, f"rtmp://{host}:{p}/live/KEY", A)
            assert status == 400, (host, out)
            messages.add(out["error"].replace(repr(host.strip("[]")), "HOST"))
        assert len(messages) == 1 and "--rtmp-allow" in messages.pop()
        assert listener.accepted == 0
        app[CONFIG].rtmp_allow = ("127.0.0.0/8",)  # the list is read per request
        status, out = await _create(client, avatar, f"rtmp://localhost:{p}/live/KEY", A)
        assert status == 201 and listener.accepted >= 1, out
        await client.delete(f"/v1/sessions/{out['session_id']}", headers=A)

    _run(app, body, timeout=60)


def test_a_full_server_refuses_before_connecting(tmp_path: Path, listener: Listener) -> None:
    """Issue 38.3: the session is admitted before its RTMP target is checked: a full server
    answers 503 without touching the target (its reachability is not revealed)."""
    from serve.helpers import A, _avatar, _run

    app = _server_app(tmp_path, allow=("127.0.0.1",), max_sessions=0)

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        status, out = await _create(client, avatar, f"rtmp://127.0.0.1:{listener.port}/live/k", A)
        assert status == 503, out

    _run(app, body, timeout=60)
    assert listener.accepted == 0


def test_a_tarpit_target_holds_up_no_other_tenant(tmp_path: Path) -> None:
    """Issue 38.3: 12 session creates aimed at a target that never accepts (a full backlog: the
    SYN is dropped) from 6 keys must not delay another key's upload (before: 0.03 s -> 4.55 s,
    the shared executor's threads waited on the connect); a 3rd concurrent create of one key is
    a 429 at once (at most 2 checks in flight per key)."""
    from serve.helpers import A, _avatar, _run

    tarpit = socket.socket()
    tarpit.bind(("127.0.0.1", 0))
    tarpit.listen(0)
    filler = socket.create_connection(tarpit.getsockname())  # fills the accept queue
    url = f"rtmp://127.0.0.1:{tarpit.getsockname()[1]}/live/k"
    app = _server_app(tmp_path, allow=("127.0.0.1",), max_sessions=64)
    keys = [{"Authorization": f"Bearer tenant-{i}"} for i in range(6)]

    async def timed(coro):  # type: ignore[no-untyped-def]
        t = time.monotonic()
        out = await coro
        return out, time.monotonic() - t

    async def body(client):  # type: ignore[no-untyped-def]
        avatars = [await _avatar(client, headers=k) for k in keys]
        _, alone = await timed(_avatar(client))
        creates = [asyncio.ensure_future(timed(_create(client, a, url, k)))
                   for a, k in zip(avatars * 2, keys * 2)]
        await asyncio.sleep(0.3)  # all 12 are waiting on the tarpit now
        ((third, _), third_s), (_, loaded) = await asyncio.gather(
            timed(_create(client, avatars[0], url, keys[0])), timed(_avatar(client)))
        results = await asyncio.gather(*creates)
        return alone, loaded, third, third_s, results

    try:
        alone, loaded, third, third_s, results = _run(app, body, timeout=120)
    finally:
        filler.close()
        tarpit.close()
    assert loaded < alone + 1.0, (alone, loaded, third_s)
    assert all(status == 400 and "timed out" in out["error"] for (status, out), _ in results), results
    assert min(s for _, s in results) >= 4.0  # they did wait on the tarpit (5 s connect timeout)
    assert third == 429 and third_s < 1.0, (third, third_s)


@needs_nginx
def test_secrets_never_reach_responses_errors_or_logs(tmp_path: Path, server: NginxRTMP,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Issue 38.8: `user:password@` and the stream key (a trailing "/" too) are in no response
    (201, GET, 400) and no log line at any level; issue 38.10: an upper-case scheme is published
    (it was taken and never published) and malformed URLs are one-line 400s (they were 500s)."""
    from serve.helpers import A, _avatar, _run

    app = _server_app(tmp_path, allow=("127.0.0.1",))
    secret_url = f"rtmp://alice-user:hunter2pw@127.0.0.1:{server.port}/live/SECRETKEY/"
    texts: list[str] = []

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        status, out = await _create(client, avatar, secret_url, A)
        assert status == 201 and out["rtmp"] == f"rtmp://***@127.0.0.1:{server.port}/live/***", out
        texts.append(str(out))
        await asyncio.sleep(2.0)  # the stream connects (nginx refuses an empty stream name)
        r = await client.get(f"/v1/sessions/{out['session_id']}", headers=A)
        texts.append(await r.text())
        await client.delete(f"/v1/sessions/{out['session_id']}", headers=A)
        for url in (f"rtmp://alice-user:hunter2pw@127.0.0.1:{free_port()}/live/SECRETKEY",
                    "rtmp://alice-user:hunter2pw@h:99999/live/SECRETKEY", "rtmp://alice-user:hunter2pw@[::1/live/SECRETKEY",
                    "rtmp://alice-user:hunter2pw@h:abc/live/SECRETKEY", " rtmp://h/live/SECRETKEY", ["x"]):
            status, out = await _create(client, avatar, url, A)
            assert status == 400 and "\n" not in out["error"], (url, out)
            texts.append(out["error"])
        status, out = await _create(client, avatar, f"RTMP://127.0.0.1:{server.port}/live/up", A)
        assert status == 201, out
        for _ in range(50):
            if _publishing(server):
                break
            await asyncio.sleep(0.1)
        assert _publishing(server)
        sink = app[SESSIONS].entries[out["session_id"]].rtmp
        await client.delete(f"/v1/sessions/{out['session_id']}", headers=A)
        return sink

    with caplog.at_level(logging.DEBUG):
        sink = _run(app, body, timeout=90)
        for _ in range(50):  # the session's end ends its stream
            if not sink.stats()["connected"]:
                break
            time.sleep(0.1)
    texts += [r.getMessage() for r in caplog.records]
    assert len(texts) > 8
    for text in texts:
        assert "hunter2pw" not in text and "SECRETKEY" not in text and "alice-user" not in text, text


@needs_nginx
def test_a_refused_stream_says_where_the_signed_video_is(tmp_path: Path, media,
                                                         server: NginxRTMP) -> None:
    """Issue 37.7 and 38.8: `generate -v --rtmp` to a server that refuses the stream ends with
    one error that says the complete signed MP4 was written, and names no secret even with -v."""
    out = tmp_path / "talk.mp4"
    url = f"rtmp://alice-user:hunter2pw@127.0.0.1:{server.port}/nosuchapp/SECRETKEY/"
    r = subprocess.run([sys.executable, "-m", "avatarstream.cli", "-v", "generate", "--model",
                        "tiny-random", "--reference", str(media["png"]), "--audio",
                        str(media["wav_3s"]), "--out", str(out), "--rtmp", url, "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("avatarstream: error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    last = errors[0]
    assert last.startswith("avatarstream: error: nothing was published to"), last
    assert f"the complete video is in {out} (signed with its content credentials)" in last, last
    assert out.exists() and "hunter2pw" not in r.stderr and "alice-user" not in r.stderr and "SECRETKEY" not in r.stderr


def test_an_unusable_allow_list_entry_is_one_line_at_start(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "avatarstream.cli", "serve", "--model", "tiny-random",
                        "--data-dir", str(tmp_path), "--rtmp-allow", "*.example.com,10.0.0.0/33"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "--rtmp-allow: '10.0.0.0/33' is neither" in r.stderr


@needs_nginx
def test_the_stream_connects_to_the_address_checked(tmp_path: Path, server: NginxRTMP,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38.1 (DNS rebinding): the host is resolved once, in Python, and FFmpeg connects to
    that address: a name only this process can resolve (FFmpeg's own lookup would fail) is
    published, with the name kept in the RTMP tcUrl."""
    from serve.helpers import A, _avatar, _run

    real = socket.getaddrinfo

    def lookup(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        return real("127.0.0.1" if host == "rebind.invalid" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    app = _server_app(tmp_path, allow=("*.invalid", "127.0.0.0/8"))

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        status, out = await _create(client, avatar, f"rtmp://rebind.invalid:{server.port}/live/p", A)
        assert status == 201, out
        for _ in range(50):
            if _publishing(server):
                break
            await asyncio.sleep(0.1)
        published = _publishing(server)
        await client.delete(f"/v1/sessions/{out['session_id']}", headers=A)
        return published

    assert _run(app, body, timeout=60)
    assert f"tc_url='rtmp://rebind.invalid:{server.port}/live'" in server.log()
