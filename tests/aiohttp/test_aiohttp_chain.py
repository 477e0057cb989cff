"""Where graceful's aiohttp middleware sits: out of the application's chain under
graceful's ``AppRunner`` (its hot path, ``graceful.aiohttp._hot``), in it otherwise.

What the hot path does to requests is tested against a real server in
``tests/aiohttp/test_aiohttp.py`` and ``test_server_matrix.py``; these cases only
say which chain an application ends up with."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from aiohttp import web

import graceful
import graceful.aiohttp
from graceful.aiohttp._middleware import Middleware


async def mine(request: web.Request, handler: Any) -> web.StreamResponse:
    return await handler(request)


mine.__middleware_version__ = 1  # type: ignore[attr-defined]


def graceful_middlewares(app: web.Application) -> list[object]:
    return [m for m in app.middlewares if isinstance(m, Middleware)]


def test_the_runner_takes_its_middleware_out_of_the_chain() -> None:
    app = web.Application(middlewares=[mine])
    runner = graceful.aiohttp.AppRunner(app, coordinator=graceful.ShutdownCoordinator())
    assert list(app.middlewares) == [mine]
    assert isinstance(runner.middleware, Middleware)


def test_a_set_up_application_keeps_its_middleware_for_other_runners() -> None:
    app = web.Application()
    middleware = graceful.aiohttp.setup(app, coordinator=graceful.ShutdownCoordinator())
    assert list(app.middlewares) == [middleware]  # stock web.run_app runs it


def test_a_middleware_placed_after_another_stays_in_the_chain() -> None:
    coordinator = graceful.ShutdownCoordinator()
    ours = Middleware(coordinator)
    app = web.Application(middlewares=[mine, ours])
    runner = graceful.aiohttp.AppRunner(app, coordinator=coordinator)
    assert runner.middleware is ours
    assert list(app.middlewares) == [mine, ours]  # the order the user chose is kept


def test_the_hot_path_is_the_servers_request_handler() -> None:
    async def main() -> None:
        app = web.Application()
        runner = graceful.aiohttp.AppRunner(app, coordinator=graceful.ShutdownCoordinator())
        await runner.setup()
        try:
            server = runner.server
            assert server is not None
            assert server.request_handler.__name__ == "dispatch"
            assert not app.middlewares  # aiohttp runs no middleware machinery
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_second_runner_of_the_coordinator_keeps_the_middleware_in_the_chain() -> None:
    coordinator = graceful.ShutdownCoordinator()
    graceful.aiohttp.AppRunner(web.Application(), coordinator=coordinator)
    app = web.Application()
    runner = graceful.aiohttp.AppRunner(app, coordinator=coordinator)
    assert graceful_middlewares(app) == [runner.middleware]


def test_the_runners_server_is_a_copy_of_aiohttps_own() -> None:
    """The server aiohttp built, attribute by attribute in the same order, in an instance
    of graceful's subclass (a class switch would slow aiohttp's per-request
    ``requests_count += 1``)."""

    async def main() -> None:
        stock = web.AppRunner(web.Application())
        ours = graceful.aiohttp.AppRunner(
            web.Application(), coordinator=graceful.ShutdownCoordinator()
        )
        await stock.setup()
        await ours.setup()
        try:
            assert stock.server is not None
            assert ours.server is not None
            assert type(ours.server) is not web.Server
            assert isinstance(ours.server, web.Server)
            stock_names = list(vars(stock.server))
            assert [n for n in vars(ours.server) if n in stock_names] == stock_names
            assert ours.server.requests_count == 0
            assert ours.server.connections == []
        finally:
            await ours.cleanup()
            await stock.cleanup()

    asyncio.run(main())


def test_a_watched_request_answers_keep_alive_false_while_nudging() -> None:
    from aiohttp.test_utils import make_mocked_request

    async def main() -> None:
        coordinator = graceful.ShutdownCoordinator(policy=graceful.RefuseImmediately())
        middleware = Middleware(coordinator)
        request = make_mocked_request("GET", "/", headers={"Host": "x"})
        kind = type(request)
        middleware.watch(request)
        watched = type(request)
        assert watched is not kind
        assert isinstance(request, kind)
        assert watched.__name__ == kind.__name__
        middleware.watch(request)  # watching twice changes nothing
        assert type(request) is watched
        assert request.keep_alive  # HTTP/1.1, nothing shuts down
        other = make_mocked_request("GET", "/", headers={"Host": "x"})
        middleware.watch(other)
        assert type(other) is watched  # one subclass per class
        assert type(request.clone()) is watched  # a clone is watched too
        coordinator.request_shutdown("test")
        assert coordinator.nudging
        assert not request.keep_alive
        closing = make_mocked_request("GET", "/", headers={"Host": "x", "Connection": "close"})
        middleware.watch(closing)
        assert not closing.keep_alive

    asyncio.run(main())
