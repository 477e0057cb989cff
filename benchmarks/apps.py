"""Hello-world ASGI apps for the benchmarks: the demo's bare app, and the same wrapped."""

from __future__ import annotations

from graceful import ShutdownCoordinator
from graceful._demo.app import app as bare
from graceful.asgi import GracefulMiddleware

__all__ = ("aiohttp_app", "bare", "wrapped")

wrapped = GracefulMiddleware(bare, coordinator=ShutdownCoordinator())


def aiohttp_app() -> object:
    """The same hello-world as an aiohttp application (a factory: aiohttp is imported only
    by the benchmarks that serve it)."""
    from aiohttp import web

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    return app
