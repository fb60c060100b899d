"""Render jobs at their edges (issue 37/38 follow-ups): a render deleted while its file is being
closed and signed is cancelled cleanly (no warning, no traceback, no file left, gone from the API);
a render record stored before the response filter existed (holding the signing certificate's
path) is answered without any path of the server's."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time

import pytest

from avatarstream.live.sinks import BackgroundSink
from avatarstream.serve.app import RENDERS
from avatarstream.serve.avatars import key_fingerprint
from avatarstream.serve.render_records import DB_NAME

from .helpers import A, _app, _avatar, _run, _wav

pytestmark = pytest.mark.usefixtures("one_thread")


def test_deleting_a_render_while_it_finishes_cancels_it_cleanly(tmp_path, monkeypatch, caplog):
    """DELETE lands while the finishing thread is closing the file (held there by the test): the
    file used to be unlinked under it, and signing then logged "could not sign ... No such file"."""
    app, _ = _app(tmp_path)
    closing, release = threading.Event(), threading.Event()
    real_close = BackgroundSink.close

    def slow_close(self: BackgroundSink) -> None:
        closing.set()
        release.wait(30)
        real_close(self)

    monkeypatch.setattr(BackgroundSink, "close", slow_close)
    caplog.set_level(logging.WARNING)

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        r = await client.post(f"/v1/renders?avatar_id={avatar}", data=_wav(1.0),
                              headers={**A, "Content-Type": "audio/wav"})
        assert r.status == 202, await r.text()
        job_id = (await r.json())["id"]
        job = app[RENDERS].jobs[job_id]
        assert await asyncio.to_thread(closing.wait, 30), "the render never reached its finishing step"
        assert job.path.is_file() and job.state == "running"
        assert (await client.delete(f"/v1/renders/{job_id}", headers=A)).status == 204
        release.set()
        await asyncio.to_thread(job.finishing.join, 30)
        assert not job.finishing.is_alive()
        assert job.state == "cancelled" and job.error is None and job.signed is None
        assert (await client.get(f"/v1/renders/{job_id}", headers=A)).status == 404
        assert (await client.get(f"/v1/renders/{job_id}/output", headers=A)).status == 404
        return job

    job = _run(app, body)
    assert list(job.path.parent.iterdir()) == []  # the MP4 and any signing copy are gone
    noisy = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert noisy == [] and "Traceback" not in caplog.text, noisy


def test_an_old_render_record_with_a_certificate_path_is_answered_without_it(tmp_path):
    app, _ = _app(tmp_path)
    cert = str(tmp_path / "secret-config" / "avatarstream" / "local-chain.pem")
    job_id = "0123456789abcdef01234567"
    info = {"id": job_id, "state": "done", "frames": 25, "total_frames": 25, "progress": 1.0, "elapsed_s": 1.0,
            "fps": 25.0, "error": None, "output_url": f"/v1/renders/{job_id}/output",
            "content_credentials": {"signed": True, "signer": "avatarstream (local)", "self_signed": True,
                                    "certificate": cert, "error": None}}
    db = sqlite3.connect(str(tmp_path / "data" / DB_NAME))  # as a server before the filter stored it
    with db:
        db.execute("INSERT INTO renders VALUES (?, ?, ?, ?, ?)",
                   (job_id, key_fingerprint("key-a"), "done", time.time(), json.dumps(info)))
    db.close()

    async def body(client):  # type: ignore[no-untyped-def]
        r = await client.get(f"/v1/renders/{job_id}", headers=A)
        assert r.status == 200
        return await r.json()

    got = _run(app, body)
    assert got["content_credentials"] == {"signed": True, "signer": "avatarstream (local)", "self_signed": True,
                                          "error": None}
    assert cert not in json.dumps(got) and str(tmp_path) not in json.dumps(got)
