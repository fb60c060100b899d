"""The server gives the memory of ended sessions back (issue 38: its RSS rose 336 -> 560 MB over
five rounds of 20 clients). Measured with `bench server-soak`: the live Python objects stay the
same from round to round; what grew was glibc keeping freed pages inside its heaps. Once sessions
have ended, the reaper calls malloc_trim (at most every TRIM_EVERY_S)."""

from __future__ import annotations

import asyncio
import os

import pytest

from avatarstream.bench.soak_measure import process_rss_mb
from avatarstream.serve import sessions as sessions_module
from avatarstream.serve.sessions import release_free_memory

from .helpers import A, _app, _avatar, _run


def test_freed_heap_pages_go_back_to_the_system():
    if not release_free_memory():
        pytest.skip("no glibc here (malloc_trim)")
    before = process_rss_mb(os.getpid())
    # 160 MB in the heap, every page written (distinct objects: no constant folding)
    blocks = [bytes([i % 251]) * 4096 for i in range(40_000)]
    last = blocks[-1]  # the newest block stays: the heap's top cannot shrink past it
    del blocks
    held = process_rss_mb(os.getpid())
    assert release_free_memory()
    after = process_rss_mb(os.getpid())
    assert before is not None and held is not None and after is not None
    assert held > before + 100, (before, held)  # freed, but still resident: what the server saw
    assert after < held - 100, (before, held, after)  # given back
    assert len(last) == 4096


def test_ended_sessions_give_their_memory_back_once_reaped(tmp_path, monkeypatch):
    calls: list[int] = []

    def counted() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(sessions_module, "release_free_memory", counted)
    monkeypatch.setattr(sessions_module, "TRIM_EVERY_S", 0.3)
    app, _ = _app(tmp_path)

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        ids = []
        for _ in range(2):
            r = await client.post("/v1/sessions", json={"avatar_id": avatar}, headers=A)
            assert r.status == 201, await r.text()
            ids.append((await r.json())["session_id"])
        await asyncio.sleep(1.0)  # sessions live, reaped every 0.2 s: nothing to give back
        assert calls == []
        for sid in ids:
            assert (await client.delete(f"/v1/sessions/{sid}", headers=A)).status == 204
        await asyncio.sleep(1.5)
        assert len(calls) == 1  # both ended sessions: one trim, after TRIM_EVERY_S
        await asyncio.sleep(1.0)
        assert len(calls) == 1  # nothing ended since: no more

    _run(app, body)
