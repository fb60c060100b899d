"""Issue 38 (2, 4, 10): `verify URL` pointed at hostile servers (real HTTP servers on loopback
ports: two ports are two origins). The user's header never leaves the URL's origin (segment, AES
key, redirect); playlists that never end, nest themselves or run to 200k lines are refused within
the limits; a remote playlist never names a local file; redirects go to http(s) only; an oversized
Content-Length is refused before its body; the whole verify has a deadline; Ctrl-C ends it."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from avatarstream.errors import InputError
from avatarstream.provenance.fetch import Limits
from avatarstream.provenance.verify import verify

from .clips import FPS
from .test_verify import marked_hls

KEY = {"Authorization": "Bearer s3cret"}
Route = Callable[[http.server.BaseHTTPRequestHandler], None]


class Origin:
    """A loopback HTTP server: `routes[path](handler)` answers; every request's path and headers
    are recorded in `seen`."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.seen: list[tuple[str, dict[str, str]]] = []
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                origin.seen.append((self.path, dict(self.headers)))
                route = origin.routes.get(self.path.split("?")[0])
                if route is None:
                    self.send_error(404)
                else:
                    route(self)

            def log_message(self, *a) -> None:  # type: ignore[no-untyped-def]
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
                if not isinstance(sys.exc_info()[1], ConnectionError):  # verify hung up at a limit
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def body(self, path: str, data: bytes, kind: str = "application/octet-stream") -> None:
        def answer(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            h.send_header("Content-Type", kind)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
        self.routes[path] = answer

    def redirect(self, path: str, to: str) -> None:
        def answer(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(302)
            h.send_header("Location", to)
            h.send_header("Content-Length", "0")
            h.end_headers()
        self.routes[path] = answer

    def authorised(self) -> list[str]:
        return [path for path, headers in self.seen if "Authorization" in headers]


@pytest.fixture
def origins() -> Iterator[tuple[Origin, Origin]]:
    a, b = Origin(), Origin()
    yield a, b
    a.server.shutdown()
    b.server.shutdown()


@pytest.fixture(scope="module")
def hls(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("hls")
    marked_hls(d, seed=3)
    return {p.name: p.read_bytes() for p in d.iterdir()}


def playlist(*segments: str, key: str | None = None, end: bool = True) -> bytes:
    lines = ["#EXTM3U", "#EXT-X-VERSION:3", "#EXT-X-TARGETDURATION:1", "#EXT-X-MEDIA-SEQUENCE:0"]
    if key:
        lines.append(f'#EXT-X-KEY:METHOD=AES-128,URI="{key}"')
    for s in segments:
        lines += ["#EXTINF:1.0,", s]
    return "\n".join(lines + (["#EXT-X-ENDLIST"] if end else [])).encode() + b"\n"


def encrypt(data: bytes, key: bytes, sequence: int) -> bytes:
    padder = padding.PKCS7(128).padder()
    enc = Cipher(algorithms.AES(key), modes.CBC(sequence.to_bytes(16, "big"))).encryptor()
    return enc.update(padder.update(data) + padder.finalize()) + enc.finalize()


# -- 38.2: the header stays with its origin ------------------------------------------------------
def test_the_header_never_reaches_another_origins_segment(origins, hls):
    a, b = origins
    a.body("/live.m3u8", playlist("segment_00000.ts", f"{b.url}/segment_00001.ts"))
    a.body("/segment_00000.ts", hls["segment_00000.ts"])
    b.body("/segment_00001.ts", hls["segment_00001.ts"])
    report = verify(f"{a.url}/live.m3u8", headers=KEY)
    assert report["watermark"]["frames"] == 2 * FPS and report["marked_by"] == ["watermark"]
    assert a.authorised() == ["/live.m3u8", "/segment_00000.ts"]  # its own origin: with the key
    assert [p for p, _ in b.seen] == ["/segment_00001.ts"] and b.authorised() == []
    assert report["stream"]["segments"] == 2 and report["stream"]["requests"] == 3


def test_the_header_never_reaches_another_origins_aes_key(origins, hls):
    a, b = origins
    key = bytes(range(16))
    a.body("/live.m3u8", playlist("s0.ts", "s1.ts", key=f"{b.url}/key.bin"))
    a.body("/s0.ts", encrypt(hls["segment_00000.ts"], key, 0))
    a.body("/s1.ts", encrypt(hls["segment_00001.ts"], key, 1))
    b.body("/key.bin", key)
    report = verify(f"{a.url}/live.m3u8", headers=KEY)
    assert report["watermark"]["frames"] == 2 * FPS and report["marked_by"] == ["watermark"]
    assert [p for p, _ in b.seen] == ["/key.bin"] and b.authorised() == []  # fetched once, no key
    assert a.authorised() == ["/live.m3u8", "/s0.ts", "/s1.ts"]


def test_the_header_never_follows_a_redirect_to_another_origin(origins, hls):
    a, b = origins
    a.redirect("/live.m3u8", f"{b.url}/live.m3u8")
    b.body("/live.m3u8", playlist("segment_00000.ts", "segment_00001.ts"))
    for name in ("segment_00000.ts", "segment_00001.ts"):
        b.body(f"/{name}", hls[name])
    a.redirect("/clip.mp4", f"{b.url}/clip.mp4")
    b.body("/clip.mp4", b"not a video")
    report = verify(f"{a.url}/live.m3u8", headers=KEY)
    assert report["watermark"]["frames"] == 2 * FPS
    with pytest.raises(InputError, match="cannot read the video"):
        verify(f"{a.url}/clip.mp4", headers=KEY)
    assert a.authorised() == ["/live.m3u8", "/clip.mp4"]
    assert sorted(p for p, _ in b.seen) == ["/clip.mp4", "/live.m3u8", "/segment_00000.ts",
                                            "/segment_00001.ts"] and b.authorised() == []


# -- 38.4: bounded playlists, no local files, Ctrl-C ----------------------------------------------
def test_a_live_playlist_is_read_once_and_its_segments_are_capped(origins, hls):
    a, _ = origins
    a.body("/live.m3u8", playlist(*(f"s{i}.ts" for i in range(1000)), end=False))
    for i in range(1000):
        a.body(f"/s{i}.ts", hls[f"segment_0000{i % 2}.ts"])
    report = verify(f"{a.url}/live.m3u8", limits=Limits(max_segments=3))
    assert report["stream"] == {"playlists": 1, "segments": 3, "seconds": 3.0, "live": True, "requests": 4}
    report = verify(f"{a.url}/live.m3u8")  # the default: as much media as the detector reads
    assert report["stream"]["segments"] == 12 and len(a.seen) == 4 + 13
    with pytest.raises(InputError, match=r"more than 5 requests \(--max-requests\)"):
        verify(f"{a.url}/live.m3u8", limits=Limits(max_requests=5, max_segments=10))


def test_a_master_playlist_that_names_itself_stops_at_the_depth_limit(origins):
    a, _ = origins
    a.body("/master.m3u8", b"#EXTM3U\n#EXT-X-STREAM-INF:BANDWIDTH=1\nmaster.m3u8\n")
    with pytest.raises(InputError, match=r"nest more than 3 deep \(--max-playlist-depth\)"):
        verify(f"{a.url}/master.m3u8")
    assert len(a.seen) == 3


def test_huge_playlists_are_refused(origins):
    a, _ = origins
    lines = b"#EXTM3U\n" + b"#\n" * 200_000  # 200k lines in 400 KB
    a.body("/lines.m3u8", lines, "application/vnd.apple.mpegurl")
    with pytest.raises(InputError, match=r"more than 20000 lines \(--max-playlist-lines\)"):
        verify(f"{a.url}/lines.m3u8")
    a.body("/big.m3u8", b"#EXTM3U\n" + b"#EXTINF:1.0,\nsegment.ts\n" * 100_000)  # 2.3 MB
    with pytest.raises(InputError, match=r"larger than 1024 KB \(--max-playlist-kb\)"):
        verify(f"{a.url}/big.m3u8")
    assert len(a.seen) == 2


def test_a_remote_playlist_never_names_a_local_file(origins, hls, tmp_path):
    """A `.m3u` served as text/plain used to be saved and read by FFmpeg as a local playlist, its
    segments read from this machine's disk. Now its URIs resolve against the remote URL."""
    a, _ = origins
    local = tmp_path / "secret.ts"
    local.write_bytes(hls["segment_00000.ts"])
    a.body("/list.m3u", playlist(str(local)), "text/plain")
    with pytest.raises(InputError, match=r"HTTP 404"):
        verify(f"{a.url}/list.m3u")
    assert [p for p, _ in a.seen] == ["/list.m3u", str(local)]  # asked of the server, not the disk
    a.body("/file.m3u8", playlist(f"file://{local}"), "text/plain")
    with pytest.raises(InputError, match="only http and https"):
        verify(f"{a.url}/file.m3u8")
    a.body("/video.mp4", playlist(str(local)), "video/mp4")  # a playlist in disguise
    with pytest.raises(InputError, match=r"HTTP 404"):
        verify(f"{a.url}/video.mp4")


def _drip(h: http.server.BaseHTTPRequestHandler) -> None:
    """A body that never ends: one byte every 0.2 s."""
    h.send_response(200)
    h.send_header("Content-Type", "video/mp2t")
    h.end_headers()
    try:
        for _ in range(3000):
            h.wfile.write(b"G")
            h.wfile.flush()
            time.sleep(0.2)
    except OSError:
        pass


def test_the_whole_verify_has_a_deadline(origins):
    a, _ = origins
    a.body("/live.m3u8", playlist("drip.ts"))
    a.routes["/drip.ts"] = _drip
    t0 = time.monotonic()
    with pytest.raises(InputError, match=r"longer than 2 s \(--timeout\)"):
        verify(f"{a.url}/live.m3u8", limits=Limits(deadline_s=2.0))
    assert time.monotonic() - t0 < 5


def test_ctrl_c_ends_a_verify_in_one_line(origins):
    a, _ = origins
    a.body("/live.m3u8", playlist("drip.ts"))
    a.routes["/drip.ts"] = _drip
    proc = subprocess.Popen([sys.executable, "-m", "avatarstream.cli", "verify", f"{a.url}/live.m3u8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not any(p == "/drip.ts" for p, _ in a.seen):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and err.strip().splitlines() == ["avatarstream: interrupted"], err


# -- 38.10: schemes, sizes ----------------------------------------------------------------------
def test_a_redirect_to_ftp_is_refused_without_connecting(origins):
    a, _ = origins
    ftp = socket.socket()
    ftp.bind(("127.0.0.1", 0))
    ftp.listen(1)
    ftp.settimeout(0.5)
    a.redirect("/clip.mp4", f"ftp://127.0.0.1:{ftp.getsockname()[1]}/clip.mp4")
    try:
        with pytest.raises(InputError, match="only http and https"):
            verify(f"{a.url}/clip.mp4")
        with pytest.raises(TimeoutError):
            ftp.accept()  # nobody connected
    finally:
        ftp.close()


def test_an_oversized_content_length_is_refused_before_its_body(origins):
    a, _ = origins
    release = threading.Event()

    def huge(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "video/mp4")
        h.send_header("Content-Length", str(300 << 20))
        h.end_headers()
        h.wfile.flush()
        release.wait(20)  # the body would come only now

    a.routes["/huge.mp4"] = huge
    t0 = time.monotonic()
    try:
        with pytest.raises(InputError, match=r"larger than 1 MB \(--max-download-mb\)"):
            verify(f"{a.url}/huge.mp4", max_download_bytes=1 << 20)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()

    def chunked(h: http.server.BaseHTTPRequestHandler) -> None:  # no length: counted as it comes
        h.send_response(200)
        h.send_header("Content-Type", "video/mp4")
        h.end_headers()
        try:
            for _ in range(64):
                h.wfile.write(os.urandom(1 << 16))
        except OSError:
            pass

    a.routes["/nolength.mp4"] = chunked
    with pytest.raises(InputError, match=r"larger than 1 MB"):
        verify(f"{a.url}/nolength.mp4", max_download_bytes=1 << 20)


def test_verify_limit_flags_are_checked(origins):
    a, _ = origins
    from conftest import run_cli

    r = run_cli("verify", f"{a.url}/x.mp4", "--max-segments", "0")
    assert r.returncode == 2
    assert r.stderr.strip() == "avatarstream: error: --max-segments must be positive (got 0)"
    a.body("/master.m3u8", b"#EXTM3U\n#EXT-X-STREAM-INF:BANDWIDTH=1\nmaster.m3u8\n")
    r = run_cli("verify", f"{a.url}/master.m3u8", "--max-playlist-depth", "5")
    assert r.returncode == 2 and "nest more than 5 deep" in r.stderr and len(a.seen) == 5
    assert r.stderr.count("\n") == 1


# -- 38.10: our local certificate is told apart by its key, not by its name ------------------------
def test_a_certificate_that_only_borrows_our_name_is_not_called_ours(tmp_path):
    from avatarstream.provenance.credentials import (LOCAL_ORG, ContentCredentials, issue_certificate,
                                                     load_identity)
    from avatarstream.provenance.verify import describe

    from .clips import write_clip

    ca, chain, key = tmp_path / "ca.pem", tmp_path / "chain.pem", tmp_path / "key.pem"
    issue_certificate(ca, chain, key)  # another CA and leaf, named exactly as ours
    write_clip(tmp_path / "forged.mp4", ContentCredentials(load_identity(chain, key), "tiny-random"))
    report = verify(str(tmp_path / "forged.mp4"))
    cc = report["content_credentials"]
    assert cc["valid"] and cc["signer"]["issuer"] == LOCAL_ORG
    assert not cc["local_certificate"] and not cc["self_signed"] and not cc["trusted"]
    trust = describe(report)[1]
    assert "NOT this machine's local certificate" in trust
    assert "an avatarstream local certificate" not in trust
