"""A server for the stateful fuzz (test_fuzz_stateful.py): the app `avatarstream serve` runs
(make_app), in this process on a loopback port with its event loop in a thread, so that a
handler can be made to fail while it runs (INJECT); a real WebRTC offer; plain requests."""

from __future__ import annotations

import asyncio
import logging
import threading

from aiohttp import web

INJECT: set[str] = set()  # operations whose success raises RuntimeError (the fuzz's proofs)


class InProcessServer:
    """The app on a loopback port, its event loop in a thread; every route's handler wrapped so
    that a label in INJECT raises RuntimeError where it would have answered 2xx."""

    def __init__(self, app: web.Application) -> None:
        for route in app.router.routes():
            injectable(route)
        self.app, self.port = app, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.ready = threading.Event()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def injectable(route) -> None:  # type: ignore[no-untyped-def]
    real = route.handler
    label = f"{route.method} {route.resource.canonical}"

    async def handler(request: web.Request) -> web.StreamResponse:
        response = await real(request)
        action = request.match_info.get("action")
        name = label.replace("{action}", action) if action else label
        if name in INJECT and 200 <= response.status < 300:
            raise RuntimeError(f"injected into {name}")
        return response

    route._handler = handler


class ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


def plain(auth: dict, method: str, url: str, data: bytes | None = None, ctype: str = ""):  # type: ignore[no-untyped-def]
    import requests

    r = requests.request(method, url, data=data, timeout=60,
                         headers={**auth, **({"Content-Type": ctype} if ctype else {})})
    assert r.status_code < 500, (method, url, r.status_code, r.text)
    return r


async def offer() -> str:
    """A real WebRTC offer (receive video and audio), as a browser sends it."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    for kind in ("video", "audio"):
        pc.addTransceiver(kind, direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp
