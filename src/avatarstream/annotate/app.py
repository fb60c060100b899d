"""The annotation page's server (aiohttp): the page, the pair to judge next, choices, undo, and
the renders of pairs.jsonl (nothing else is served; seeking works through HTTP Range).

Sides: with `shuffle_sides`, each annotator sees each pair's renders in an order drawn from a
hash of (annotator, pair): stable when they reload, different between pairs and people, so a
preference for one screen side cannot line up with the on-disk order. The page speaks of the
sides as shown; the server turns a choice into on-disk terms before storing it, with `swapped`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web

from avatarstream.annotate.page import PAGE
from avatarstream.annotate.pairs import Pair, PairsFolder
from avatarstream.annotate.store import CHOICES, Store, check_annotator
from avatarstream.errors import AvatarStreamError, ConfigError

SIDES = ("left", "right")


def sides_swapped(annotator: str, pair: str) -> bool:
    """Whether `annotator` sees `pair`'s on-disk right render on the left."""
    return hashlib.sha256(f"{annotator}\n{pair}".encode()).digest()[0] & 1 == 1


class Annotation:
    """The state behind the page: the pairs, the store, the side rule."""

    def __init__(self, folder: PairsFolder, store: Store, annotator: str | None = None,
                 shuffle_sides: bool = True) -> None:
        self.folder, self.store, self.annotator, self.shuffle = folder, store, annotator, shuffle_sides
        self.index = {p.pair: n for n, p in enumerate(folder.pairs)}  # a line's place: its URLs

    def swapped(self, annotator: str, pair: str) -> bool:
        return self.shuffle and sides_swapped(annotator, pair)

    def shown(self, annotator: str, pair: Pair) -> dict[str, Any]:
        """`pair` as the page shows it to `annotator`: its video URLs in screen order."""
        order = ("right", "left") if self.swapped(annotator, pair.pair) else SIDES
        n = self.index[pair.pair]  # any pair id makes a valid URL
        return {"id": pair.pair, "text": pair.text,
                "left": f"/media/{n}/{order[0]}", "right": f"/media/{n}/{order[1]}"}

    def state(self, annotator: str, pair: Pair | None = None) -> dict[str, Any]:
        """Progress and the pair to judge: `pair`, or the first one not judged yet."""
        total = len(self.folder.pairs)
        if not annotator:
            return {"annotator": "", "total": total, "done": 0, "pair": None, "can_undo": False}
        judged = self.store.judged(annotator)
        if pair is None:
            pair = next((p for p in self.folder.pairs if p.pair not in judged), None)
        done = sum(p.pair in judged for p in self.folder.pairs)
        return {"annotator": annotator, "total": total, "done": done,
                "pair": None if pair is None else self.shown(annotator, pair), "can_undo": bool(judged)}

    def choose(self, annotator: str, pair_id: str, shown_choice: str) -> dict[str, Any]:
        """Record `shown_choice` (left/right as on screen, tie, skip) for the pair."""
        annotator = check_annotator(annotator)
        pair = self.folder.get(pair_id)
        if pair is None:
            raise web.HTTPNotFound(text=json.dumps({"error": f"no pair {pair_id!r}"}),
                                   content_type="application/json")
        if shown_choice not in CHOICES:
            raise web.HTTPBadRequest(text=json.dumps({"error": f"choice must be one of {', '.join(CHOICES)}"}),
                                     content_type="application/json")
        swapped = self.swapped(annotator, pair.pair)
        flip = {"left": "right", "right": "left"}
        choice = flip.get(shown_choice, shown_choice) if swapped else shown_choice
        self.store.record(pair.pair, choice, annotator, swapped=swapped)
        return self.state(annotator)

    def undo(self, annotator: str) -> dict[str, Any]:
        """Forget the annotator's last choice and show that pair again."""
        annotator = check_annotator(annotator)
        last = self.store.undo(annotator)
        return self.state(annotator, None if last is None else self.folder.get(last.pair))


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object a POST carries. Only application/json is read: a page of another site
    cannot send that to this one without a preflight, which is never answered."""
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text=json.dumps({"error": "send application/json"}),
                                           content_type="application/json")
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "the body must be a JSON object"}),
                                 content_type="application/json")
    return body


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    return value if isinstance(value, str) else ""


def make_app(annotation: Annotation) -> web.Application:
    """The web application of `avatarstream annotate`."""
    config = json.dumps({"annotator": annotation.annotator or "", "total": len(annotation.folder.pairs),
                         "folder": annotation.folder.root.name})
    page = PAGE.replace("__CONFIG__", config.replace("<", "\\u003c"))

    @web.middleware
    async def user_errors(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except AvatarStreamError as e:
            return web.json_response({"error": str(e)}, status=400)

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def state(request: web.Request) -> web.Response:
        name = request.query.get("annotator", "").strip()
        return web.json_response(annotation.state(check_annotator(name) if name else ""))

    async def choice(request: web.Request) -> web.Response:
        body = await _body(request)
        return web.json_response(annotation.choose(_text(body, "annotator"), _text(body, "pair"),
                                                   _text(body, "choice")))

    async def undo(request: web.Request) -> web.Response:
        body = await _body(request)
        return web.json_response(annotation.undo(_text(body, "annotator")))

    async def media(request: web.Request) -> web.StreamResponse:
        n, side, pairs = request.match_info["n"], request.match_info["side"], annotation.folder.pairs
        if not (n.isascii() and n.isdigit() and int(n) < len(pairs)) or side not in SIDES:
            raise web.HTTPNotFound()
        return web.FileResponse(pairs[int(n)].video(side), headers={"Cache-Control": "private, max-age=3600"})

    app = web.Application(middlewares=[user_errors], client_max_size=64 * 1024)
    app.router.add_get("/", index)
    app.router.add_get("/api/state", state)
    app.router.add_post("/api/choice", choice)
    app.router.add_post("/api/undo", undo)
    app.router.add_get("/media/{n}/{side}", media)
    return app


def serve(app: web.Application, host: str, port: int, on_listening: Callable[[str], None]) -> None:
    """Serve `app` until SIGINT or SIGTERM, then close it; `on_listening(url)` once the port
    accepts connections (the port the system gave, with --port 0)."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = web.AppRunner(app, shutdown_timeout=2.0)
        await runner.setup()
        try:
            try:
                await web.TCPSite(runner, host, port).start()
            except OSError as e:  # the port is taken, the address is not this machine's
                raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
            bound = runner.addresses[0][1] if runner.addresses else port
            shown = f"[{host}]" if ":" in host else host
            on_listening(f"http://{shown}:{bound}/")
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
