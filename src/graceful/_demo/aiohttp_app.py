"""The demo's backend for aiohttp: ``graceful._demo.app``'s endpoints as aiohttp handlers.

aiohttp serves its own handler interface, not ASGI, so the aiohttp rows of the demo need
the same app written for it: ``/`` answers ``hello``; ``/slow?s=2`` answers after 2
seconds; ``/ws`` echoes text messages over a websocket.  Every response (and the
websocket handshake) carries ``x-backend`` from ``GRACEFUL_DEMO_NAME``, as the ASGI app's
do, so the clients count it the same way.  Stock and graceful aiohttp serve this same
app; only the shutdown differs.
"""

from __future__ import annotations

import asyncio

from aiohttp import WSMsgType, web

from .app import NAME

__all__ = ("make_app",)

_BACKEND = NAME.decode()


async def _hello(request: web.Request) -> web.Response:
    return web.Response(text="hello\n", headers={"x-backend": _BACKEND})


async def _slow(request: web.Request) -> web.Response:
    await asyncio.sleep(min(float(request.query.get("s", "1")), 60.0))
    return web.Response(text="slow\n", headers={"x-backend": _BACKEND})


async def _echo(request: web.Request) -> web.WebSocketResponse:
    """A websocket echo: every text message comes back, until the client leaves."""
    ws = web.WebSocketResponse()
    ws.headers["x-backend"] = _BACKEND
    await ws.prepare(request)
    async for message in ws:
        if message.type is WSMsgType.TEXT:
            await ws.send_str(message.data)
    return ws


def make_app() -> web.Application:
    """A new application with the demo's routes."""
    app = web.Application()
    app.router.add_get("/", _hello)
    app.router.add_get("/slow", _slow)
    app.router.add_get("/ws", _echo)
    return app
