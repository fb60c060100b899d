"""The annotation server over HTTP (no browser): sides per annotator, choices stored in on-disk
terms, progress and undo, only listed files served (with Range), and the command line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestClient, TestServer

from avatarstream.annotate.app import Annotation, make_app, sides_swapped
from avatarstream.annotate.pairs import load_pairs
from avatarstream.annotate.store import Store
from avatarstream.cli import main

from .helpers import make_pairs, read_jsonl


def _serve(root, check, shuffle=True, annotator=None):  # type: ignore[no-untyped-def]
    """Run `check(client, store)` against the app of the pairs folder `root`."""
    async def go() -> None:
        with Store(root / "annotations.sqlite") as store:
            app = make_app(Annotation(load_pairs(root), store, annotator, shuffle_sides=shuffle))
            async with TestClient(TestServer(app, host="127.0.0.1")) as client:
                await check(client, store)
    asyncio.run(go())


def _swapped_annotator(pair: str, want: bool) -> str:
    return next(n for n in (f"ann{i}" for i in range(100)) if sides_swapped(n, pair) == want)


def test_a_choice_made_on_swapped_sides_is_stored_in_on_disk_terms(tmp_path):
    make_pairs(tmp_path, n=2)
    swapped, straight = _swapped_annotator("p0000", True), _swapped_annotator("p0000", False)

    async def check(client, store) -> None:  # type: ignore[no-untyped-def]
        for name, order in ((swapped, ("right", "left")), (straight, ("left", "right"))):
            s = await (await client.get("/api/state", params={"annotator": name})).json()
            assert s["pair"]["left"] == f"/media/0/{order[0]}" and s["pair"]["right"] == f"/media/0/{order[1]}"
            r = await client.post("/api/choice", json={"annotator": name, "pair": "p0000", "choice": "left"})
            assert r.status == 200 and (await r.json())["pair"]["id"] == "p0001"
        rows = {j.annotator: (j.choice, j.swapped) for j in store.all()}
        assert rows == {swapped: ("right", True), straight: ("left", False)}

    _serve(tmp_path, check)


def test_fixed_sides_progress_undo_and_the_end(tmp_path):
    make_pairs(tmp_path, n=2)

    async def check(client, store) -> None:  # type: ignore[no-untyped-def]
        name = _swapped_annotator("p0000", True)  # would be swapped, but the sides are fixed
        s = await (await client.get("/api/state", params={"annotator": name})).json()
        assert (s["done"], s["total"], s["pair"]["left"], s["can_undo"]) == (0, 2, "/media/0/left", False)
        assert s["pair"]["text"] == "hello there 0"
        post = lambda path, **body: client.post(path, json={"annotator": name, **body})  # noqa: E731
        s = await (await post("/api/choice", pair="p0000", choice="left")).json()
        assert (s["done"], s["pair"]["id"], s["can_undo"]) == (1, "p0001", True)
        s = await (await post("/api/choice", pair="p0001", choice="skip")).json()
        assert (s["done"], s["pair"]) == (2, None)  # all pairs judged
        s = await (await post("/api/undo")).json()
        assert (s["done"], s["pair"]["id"]) == (1, "p0001")
        s = await (await post("/api/choice", pair="p0001", choice="tie")).json()
        assert [(j.pair, j.choice, j.swapped) for j in store.all()] == [("p0000", "left", False), ("p0001", "tie", False)]

    _serve(tmp_path, check, shuffle=False)


def test_bad_requests_are_refused(tmp_path):
    make_pairs(tmp_path, n=1)

    async def check(client, store) -> None:  # type: ignore[no-untyped-def]
        r = await client.post("/api/choice", json={"annotator": " ", "pair": "p0000", "choice": "left"})
        assert r.status == 400 and "name is required" in (await r.json())["error"]
        r = await client.post("/api/choice", json={"annotator": "a", "pair": "p9", "choice": "left"})
        assert r.status == 404
        r = await client.post("/api/choice", json={"annotator": "a", "pair": "p0000", "choice": "best"})
        assert r.status == 400
        r = await client.post("/api/choice", data='{"annotator": "a", "pair": "p0000", "choice": "left"}',
                              headers={"Content-Type": "text/plain"})  # what another site's form can send
        assert r.status == 415
        r = await client.post("/api/undo", data="[1]", headers={"Content-Type": "application/json"})
        assert r.status == 400
        assert store.all() == []

    _serve(tmp_path, check)


def test_only_the_listed_renders_are_served_with_ranges(tmp_path):
    make_pairs(tmp_path, n=1)
    (tmp_path / "renders" / "r0000.mp4").write_bytes(bytes(range(200)))
    (tmp_path / "renders" / "other.mp4").write_bytes(b"secret")

    async def check(client, store) -> None:  # type: ignore[no-untyped-def]
        r = await client.get("/media/0/left")
        assert r.status == 200 and await r.read() == bytes(range(200)) and r.content_type == "video/mp4"
        r = await client.get("/media/0/left", headers={"Range": "bytes=10-19"})
        assert r.status == 206 and await r.read() == bytes(range(10, 20))
        assert r.headers["Content-Range"] == "bytes 10-19/200"
        for path in ("/media/0/up", "/media/1/left", "/media/-1/left", "/media/p0000/left",
                     "/media/0/..%2F..%2Fpairs.jsonl",
                     "/renders/other.mp4", "/pairs.jsonl", "/annotations.sqlite"):
            assert (await client.get(path)).status == 404, path

    _serve(tmp_path, check)


def test_the_page_carries_the_default_name_escaped(tmp_path):
    make_pairs(tmp_path, n=1)

    async def check(client, store) -> None:  # type: ignore[no-untyped-def]
        html = await (await client.get("/")).text()
        assert '"annotator": "</scr' not in html and '\\u003c/script>x' in html
        assert "all pairs judged" in html and 'id="right" playsinline preload="auto" muted' in html

    _serve(tmp_path, check, annotator="</script>x")


# -- the command line ------------------------------------------------------------------------------
def test_a_missing_pairs_folder_is_one_line_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "avatarstream.cli", "annotate", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"avatarstream: error: pairs folder not found: {tmp_path / 'nope'}"]


def test_export_and_auto_from_the_command_line(tmp_path, capsys):
    make_pairs(tmp_path, n=2, auto=[(0.5, 0.1), (0.2, 0.21)])
    out = tmp_path / "auto.jsonl"
    assert main(["annotate", "auto", str(tmp_path), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["exported"] == 1 and read_jsonl(out)[0]["chosen"] == "renders/r0000.pt"
    assert main(["annotate", "export", str(tmp_path), "--out", str(out)]) == 2
    assert "no annotations found" in capsys.readouterr().err
    with Store(tmp_path / "annotations.sqlite") as s:
        s.record("p0001", "right", "ann")
        s.record("p0000", "tie", "bob")
    assert main(["annotate", "export", str(tmp_path), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["choices"] == {"left": 0, "right": 1, "tie": 1, "skip": 0}
    assert [(ln["pair"], ln["chosen"]) for ln in read_jsonl(out)] == [("p0001", "renders/r0003.pt")]


@pytest.mark.parametrize("argv, message", [
    (["export", "{p}"], "needs --out"),
    (["export"], "give the pairs folder"),
    (["{p}", "--margin", "1"], "the page takes no --margin"),
    (["auto", "{p}", "--out", "x.jsonl", "--db", "d"], "`annotate auto` takes no --db"),
    (["{p}", "extra"], "unexpected argument"),
])
def test_wrong_options_are_one_line(tmp_path, capsys, argv, message):
    make_pairs(tmp_path, n=1)
    assert main(["annotate", *(a.replace("{p}", str(tmp_path)) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_annotate_imports_no_training_server_or_model_code():
    """The package stands on its own: errors, media and aiohttp, never train (nor serve, which is
    transport only, nor the model stack), through any chain of imports."""
    import grimp

    graph = grimp.build_graph("avatarstream", cache_dir=None)
    reached = set()
    for module in graph.find_descendants("avatarstream.annotate") | {"avatarstream.annotate"}:
        reached |= graph.find_upstream_modules(module)
    pkgs = {m.split(".")[1] for m in reached if m.count(".") >= 1}
    assert pkgs <= {"annotate", "errors", "media"}, sorted(pkgs)
