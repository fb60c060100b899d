"""`avatarstream verify`: both signals, JSON and exit codes, files, URLs (a real local HTTP server)
and an HLS stream; a server render verifies as AI-generated."""

from __future__ import annotations

import functools
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from avatarstream.errors import InputError
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.media.synthetic import speechlike
from avatarstream.provenance.credentials import credentials_for
from avatarstream.provenance.verify import EXIT_MARKED, EXIT_NOT_MARKED, exit_code, verify
from avatarstream.publish.hls import HLSSink
from conftest import run_cli
from serve.helpers import A, _app, _avatar, _finished_render, _run, _wav

from .clips import FPS, SR, write_clip


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("clips")
    creds = credentials_for("tiny-random")
    write_clip(d / "signed.mp4", creds)
    write_clip(d / "plain.mp4")
    write_clip(d / "marked.mp4", size=128, watermark=True)
    data = bytearray((d / "signed.mp4").read_bytes())
    data[data.rfind(b"mdat") + 100] ^= 0xFF
    (d / "tampered.mp4").write_bytes(bytes(data))
    return {p.stem: p for p in d.iterdir()}


def marked_hls(folder: Path, seed: int) -> None:
    """Two seconds of watermarked noise as an HLS stream (MPEG-TS segments) in `folder`."""
    from avatarstream.provenance.watermark import embed

    sink = HLSSink(folder, segment_seconds=1.0)
    sink.open(128, 128, FPS, SR)
    rng = np.random.default_rng(seed)
    for k in range(2):
        frames = embed(rng.integers(0, 255, (FPS, 128, 128, 3), dtype=np.uint8), k * FPS)
        sink.write_video(VideoChunk(frames=frames, start_frame=k * FPS, fps=FPS))
        sink.write_audio(AudioChunk(samples=speechlike(1.0), start_sample=k * SR, sample_rate=SR))
    sink.close()


@pytest.fixture(scope="module")
def http_root(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """A real HTTP server on a loopback port serving a folder."""
    root = tmp_path_factory.mktemp("www")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[assignment]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_cli_signed_file_json_and_exit_0(clips):
    r = run_cli("verify", str(clips["signed"]), "--json")
    assert r.returncode == EXIT_MARKED == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    cc = report["content_credentials"]
    assert report["ai_generated"] and report["marked_by"] == ["content_credentials"]
    assert cc["valid"] and not cc["trusted"] and cc["self_signed"] and cc["local_certificate"]
    assert cc["model"] == "tiny-random" and cc["synthesised_likeness"] is True
    assert cc["digital_source_type"].endswith("/trainedAlgorithmicMedia")
    assert not report["watermark"]["detected"]  # noise frames, never marked
    assert "AI-GENERATED" in r.stdout and "SELF-SIGNED, untrusted" in r.stdout


def test_cli_missing_file_is_one_line_exit_2(tmp_path):
    r = run_cli("verify", str(tmp_path / "nope.mp4"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"avatarstream: error: cannot verify {tmp_path / 'nope.mp4'}: no such file"]


def test_unmarked_and_tampered_files_are_not_ai_marked(clips):
    plain = verify(str(clips["plain"]))
    assert not plain["ai_generated"] and exit_code(plain) == EXIT_NOT_MARKED == 1
    assert not plain["content_credentials"]["present"] and plain["watermark"]["frames"] == FPS
    tampered = verify(str(clips["tampered"]))
    cc = tampered["content_credentials"]
    assert cc["present"] and not cc["valid"] and cc["claims_ai_generated"]
    assert "assertion.bmffHash.mismatch" in cc["failures"]
    assert not tampered["ai_generated"] and exit_code(tampered) == EXIT_NOT_MARKED


def test_watermark_alone_marks_a_file(clips):
    report = verify(str(clips["marked"]))
    assert report["marked_by"] == ["watermark"] and exit_code(report) == EXIT_MARKED
    assert not report["content_credentials"]["present"]


def test_urls_file_and_hls(clips, http_root):
    root, url = http_root
    (root / "signed.mp4").write_bytes(clips["signed"].read_bytes())
    remote = verify(f"{url}/signed.mp4")
    local = verify(str(clips["signed"]))
    assert remote["content_credentials"] == local["content_credentials"]
    assert remote["watermark"] == local["watermark"] and remote["ai_generated"]
    with pytest.raises(InputError, match="larger than"):
        verify(f"{url}/signed.mp4", max_download_bytes=1000)
    with pytest.raises(InputError, match="cannot download"):
        verify(f"{url}/missing.mp4")

    marked_hls(root / "live", seed=1)
    hls = verify(f"{url}/live/index.m3u8")
    assert not hls["content_credentials"]["present"] and "HLS" in hls["content_credentials"]["error"]
    assert hls["watermark"]["frames"] == 2 * FPS and hls["marked_by"] == ["watermark"]
    on_disk = verify(str(root / "live" / "index.m3u8"))
    assert on_disk["watermark"] == hls["watermark"] and on_disk["content_credentials"] == hls["content_credentials"]


def test_server_render_verifies_as_ai_generated(tmp_path):
    app, _ = _app(tmp_path)
    out = tmp_path / "render.mp4"

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        job = await _finished_render(client, avatar, _wav(1.0))
        assert job["state"] == "done", job
        out.write_bytes(await (await client.get(job["output_url"], headers=A)).read())
        return job

    job = _run(app, body)
    assert job["content_credentials"]["signed"] and job["content_credentials"]["self_signed"]
    assert sorted(p.name for p in (tmp_path / "data" / "renders").iterdir()) == [f"{job['id']}.mp4"]
    report = verify(str(out))
    cc = report["content_credentials"]
    assert report["ai_generated"] and cc["valid"] and cc["model"] == "tiny-random"
    assert cc["digital_source_type"].endswith("/trainedAlgorithmicMedia")


class _KeyedHandler(http.server.SimpleHTTPRequestHandler):
    """Serves its folder only to requests with the bearer key (a render's or session's URL)."""

    def send_head(self):  # type: ignore[no-untyped-def]
        if self.headers.get("Authorization") != "Bearer s3cret":
            self.send_error(401, "send the key")
            return None
        return super().send_head()

    def log_message(self, *a) -> None:  # type: ignore[no-untyped-def]
        pass


def test_a_url_behind_a_key_is_verified_with_header(clips, tmp_path):
    """`verify URL --header 'Authorization: Bearer KEY'`: the header goes with the download of a
    file and with FFmpeg's requests of an HLS playlist and its segments; without it, one clear
    error (exit 2); a malformed header is one clear error too."""
    (tmp_path / "signed.mp4").write_bytes(clips["signed"].read_bytes())
    marked_hls(tmp_path / "live", seed=2)
    handler = functools.partial(_KeyedHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        key = ["--header", "Authorization: Bearer s3cret"]
        r = run_cli("verify", f"{url}/signed.mp4", *key, "--json")
        assert r.returncode == EXIT_MARKED, r.stderr
        report = json.loads(r.stdout.strip().splitlines()[-1])
        assert report["content_credentials"]["ai_generated"]
        hls = verify(f"{url}/live/index.m3u8", headers={"Authorization": "Bearer s3cret"})
        assert hls["watermark"]["frames"] == 2 * FPS and hls["marked_by"] == ["watermark"]
        r = run_cli("verify", f"{url}/signed.mp4")
        assert r.returncode == 2 and "HTTP 401" in r.stderr and "--header" in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1
        with pytest.raises(InputError, match="401|cannot read"):
            verify(f"{url}/live/index.m3u8")
        r = run_cli("verify", f"{url}/signed.mp4", "--header", "Authorization Bearer s3cret")
        assert r.returncode == 2 and "'Name: value'" in r.stderr and "s3cret" not in r.stderr
    finally:
        server.shutdown()
