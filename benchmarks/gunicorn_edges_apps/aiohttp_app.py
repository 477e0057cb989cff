"""An aiohttp app (see the package's docstring for the routes): ``aiohttp_app:app``."""

from __future__ import annotations

from aiohttp import web

from .asgi_app import _stubborn


async def _fast(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _ready(request: web.Request) -> web.Response:
    return web.Response(text="app ready\n")


async def _sleep(request: web.Request) -> web.Response:
    import asyncio

    seconds = float(request.query.get("s", "1"))
    await asyncio.sleep(seconds)
    return web.Response(text=f"slept {seconds:g}\n")


async def _stubborn_route(request: web.Request) -> web.Response:
    seconds = float(request.query.get("s", "1"))
    await _stubborn(seconds)
    return web.Response(text=f"slept {seconds:g} (stubborn)\n")


def make_app() -> web.Application:
    application = web.Application()
    application.router.add_get("/", _fast)
    application.router.add_get("/readyz", _ready)
    application.router.add_get("/sleep", _sleep)
    application.router.add_get("/stubborn", _stubborn_route)
    return application


app = make_app()
