"""Route guards: what a handler needs from the request, found before the handler runs.

Most routes first find something in the request (the caller's API key, the session or render the
path names, a JSON body) and answer 401/404/400 when it is not there. A finder is a coroutine
that returns the thing or the error response; `resolved(find)` wraps a handler so that it runs
only with what was found and the refusal is answered without it, so every route refuses the
same way.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from avatarstream.serve.common import api_key, error

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def resolved(find: Callable[[web.Request], Awaitable[T | web.Response]]
             ) -> Callable[[Callable[[web.Request, T], Awaitable[web.StreamResponse]]], Handler]:
    """Decorator: call the handler as `handler(request, await find(request))`, or answer the
    response `find` returned instead."""

    def wrap(handler: Callable[[web.Request, T], Awaitable[web.StreamResponse]]) -> Handler:
        @functools.wraps(handler)
        async def route(request: web.Request) -> web.StreamResponse:
            found = await find(request)
            if isinstance(found, web.Response):
                return found
            return await handler(request, found)

        return route

    return wrap


async def caller_key(request: web.Request) -> str | web.Response:
    """The caller's API key (see `api_key`), or the 401 that asks for one."""
    key = api_key(request)
    return error(401, "send `Authorization: Bearer KEY`") if key is None else key
