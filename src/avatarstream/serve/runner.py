"""Running the app: aiohttp's runner, with requests it cannot parse answered as JSON.

A request aiohttp cannot parse (a request line or header over its 8190 bytes, a malformed
method or header) never reaches a route or middleware: aiohttp's connection handler answers it
with a text/plain 400 and logs an ERROR with a traceback, once per request. `JSONErrorHandler`
answers it like every other error, `{"error": ...}` with its status, and logs one warning line.
aiohttp has no public hook for this: `JSONErrorRunner` makes the server it starts hand out
these connection handlers (tested against a real process in tests/serve/test_faults.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from avatarstream.errors import ConfigError

log = logging.getLogger(__name__)


def _describe(status: int, exc: BaseException | None) -> str:
    if isinstance(exc, LineTooLong):
        return "the request line or a header is too long; send a shorter URL or header"
    if isinstance(exc, HttpProcessingError):
        return f"this is not an HTTP request the server can read ({exc.__class__.__name__})"
    if status == 504:
        return "the request took too long"
    return "internal error (see the server log)"


class JSONErrorHandler(RequestHandler):
    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        text = _describe(status, exc)
        if status >= 500 and status != 504:
            log.error("request failed: %s", text, exc_info=exc)  # a bug: keep the traceback
        else:
            log.warning("refused a request from %s: %s", request.remote, text)
        if request.writer.output_size > 0:  # a response was already started: nothing to add
            raise ConnectionError("the response was already started")
        resp = web.json_response({"error": text}, status=status)
        resp.force_close()
        return resp


class _JSONErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JSONErrorHandler(self, loop=self._loop, **self._kwargs)


class JSONErrorRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JSONErrorServer  # the same server, handing out JSONErrorHandler
        return server


def serve_app(app: web.Application, host: str, port: int,
              on_listening: Callable[[], None] | None = None) -> None:
    """Serve `app` until SIGINT or SIGTERM (as `web.run_app`), then close it cleanly;
    `on_listening` is called once the app has started and the port accepts connections."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = JSONErrorRunner(app, shutdown_timeout=5.0)
        await runner.setup()
        try:
            try:
                await web.TCPSite(runner, host, port).start()
            except OSError as e:  # the port is taken, the address is not this machine's
                raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
            if on_listening is not None:
                on_listening()
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
