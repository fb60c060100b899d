"""`avatarstream serve --batch-ray ADDRESS` (batch/remote.py): a real server process joins the
tests' local Ray; a render POSTed to it runs in a Ray renderer process (not the server's), goes
queued/running -> done through GET as a local render does, and its /output verifies as
AI-generated with signed content credentials; an unreachable cluster stops the server at start
with one line. tiny-random, ~1 s of speech."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from avatarstream.batch.run import EVENTS_FOR_TESTS
from avatarstream.provenance.verify import verify
from avatarstream.serve.client import ServerProcess

pytest.importorskip("ray")

KEY = {"Authorization": "Bearer batch-ray-test"}


def _call(url: str, method: str = "GET", data: bytes | None = None, ctype: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={**KEY, **({"Content-Type": ctype} if ctype else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_render_runs_on_a_ray_renderer_and_verifies(inputs, ray_address, tmp_path, monkeypatch):
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(EVENTS_FOR_TESTS, str(events))  # the server passes AVATARSTREAM_* to its renderers
    with ServerProcess(tmp_path / "data", args=("--batch-ray", ray_address, "--max-sessions", "1",
                                                "--size", "64x64")) as server:
        status, body = _call(server.url + "/v1/avatars", "POST", inputs["ref"].read_bytes(), "image/png")
        assert status == 201, body
        avatar = json.loads(body)["id"]
        status, body = _call(f"{server.url}/v1/renders?avatar_id={avatar}", "POST",
                             inputs["b"].read_bytes(), "audio/wav")
        assert status == 202, body
        job = json.loads(body)
        assert job["state"] == "queued" and job["progress"] == 0.0 and job["total_frames"] == 30  # 1.2 s, 25 fps
        seen, deadline = {job["state"]}, time.monotonic() + 45
        while job["state"] not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(0.1)
            status, body = _call(f"{server.url}/v1/renders/{job['id']}")
            assert status == 200, body
            job = json.loads(body)
            seen.add(job["state"])
        assert job["state"] == "done", job
        assert seen <= {"queued", "running", "done"}
        assert (job["progress"], job["frames"], job["error"]) == (1.0, 30, None)
        assert job["content_credentials"]["signed"] and "certificate" not in json.dumps(job["content_credentials"])
        status, video = _call(server.url + job["output_url"])
        assert status == 200 and len(video) > 1000
        out = tmp_path / "render.mp4"
        out.write_bytes(video)
        report = verify(str(out))
        assert report["ai_generated"] and report["content_credentials"]["valid"], report
        server_pid = server.proc.pid
    ev = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["event"] for e in ev] == ["start", "done"] and ev[0]["out"] == f"{job['id']}.mp4"
    assert ev[0]["pid"] != server_pid  # rendered by a Ray worker, not the server
    # what the server's records keep after it stopped answers the same
    assert not list((tmp_path / "data" / "renders").glob("*.partial-*"))


def test_an_unreachable_cluster_stops_the_server_at_start_with_one_line(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "avatarstream.cli", "serve", "--model", "tiny-random",
                           "--data-dir", str(tmp_path / "d"), "--batch-ray", f"127.0.0.1:{port}",
                           "--max-sessions", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("avatarstream serve: ")]
    assert len(errors) == 1 and "cannot reach a Ray cluster" in errors[0] and "Traceback" not in proc.stderr, proc.stderr
