"""An aiohttp app served three ways, for tests/aiohttp/test_aiohttp.py.

    python -m tests.support.aiohttp_apps.app run_app --port 0 --policy accept-until-idle
    python -m tests.support.aiohttp_apps.app runner ...   # own AppRunner + TCPSite
        [--stock-beside]   # and a stock AppRunner serving the app on another port
    python -m tests.support.aiohttp_apps.app chain ...    # setup() + aiohttp's AppRunner
    python -m tests.support.aiohttp_apps.app stock ...    # aiohttp.web.run_app
    gunicorn tests.support.aiohttp_apps.app:app -k graceful.aiohttp._worker.AiohttpWorker

Routes:
    ``/``                 ``hello`` (``x-backend`` from ``GRACEFUL_DEMO_NAME``)
    ``/slow?s=2``         answers after 2 seconds
    ``/held``             answers once its body has come
    ``/stream?n=5``       a streamed (prepared) response, one chunk per 0.1 s
    ``/events``           server-sent events until draining begins (graceful modes only)
    ``/ws``               a websocket echo; ``/ws?stubborn=1`` never ends by itself
``on_shutdown`` and ``on_cleanup`` print a line each; the tests wait on lines, never on
the clock.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from aiohttp import WSMsgType, web

from tests.support.lingering import linger

NAME = os.environ.get("GRACEFUL_DEMO_NAME", "backend")


def say(line: str) -> None:
    """One write per line, so that lines of several worker processes don't interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def hello(request: web.Request) -> web.Response:
    return web.Response(text="hello\n", headers={"x-backend": NAME})


async def slow(request: web.Request) -> web.Response:
    seconds = float(request.query.get("s", "1"))
    say(f"slow request started ({seconds:g} s)")
    await asyncio.sleep(seconds)
    return web.Response(text=f"slept {seconds:g}\n", headers={"x-backend": NAME})


async def held(request: web.Request) -> web.Response:
    """Answer once the request's body has come (a test withholds its last byte)."""
    say("slow request started (held)")
    await request.read()
    return web.Response(text="released\n", headers={"x-backend": NAME})


async def stream(request: web.Request) -> web.StreamResponse:
    count = int(request.query.get("n", "5"))
    response = web.StreamResponse()
    response.content_type = "text/plain"
    say("stream started")
    if request.query.get("after") == "shutdown":  # prepare once shutdown was requested
        await _shutdown_requested(request)
    await response.prepare(request)
    for i in range(count):
        await response.write(f"chunk {i}\n".encode())
        await asyncio.sleep(0.1)
    await response.write_eof()
    return response


async def _shutdown_requested(request: web.Request, within_s: float = 10.0) -> None:
    import graceful
    import graceful.aiohttp

    signal = request.config_dict[graceful.aiohttp.DRAIN_SIGNAL_KEY]
    if not await signal.coordinator.wait_for_phase(graceful.Phase.ACCEPTING, timeout_s=within_s):
        raise TimeoutError(f"no shutdown requested within {within_s:g} s")


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events that end cleanly once the server starts draining."""
    import graceful.aiohttp

    signal = request.config_dict[graceful.aiohttp.DRAIN_SIGNAL_KEY]
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    say("events started")
    while not signal.draining:
        await response.write(b"data: tick\n\n")
        await signal.wait(timeout_s=0.2)
    await response.write(b"event: bye\ndata: server draining\n\n")
    await response.write_eof()
    return response


async def websocket(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    say("websocket connected")
    if request.query.get("stubborn"):
        await asyncio.Event().wait()  # never reads, never closes: only a cut ends it
    async for message in ws:
        if message.type is WSMsgType.TEXT:
            await ws.send_str(message.data)
    say(f"websocket closed with code {ws.close_code}")
    return ws


async def on_shutdown(app: web.Application) -> None:
    say("on_shutdown ran")


async def on_cleanup(app: web.Application) -> None:
    say("on_cleanup ran")


async def on_startup(app: web.Application) -> None:
    if os.environ.get("TEST_LINGER"):
        app["linger"] = asyncio.get_running_loop().create_task(
            linger(say)
        )  # run_app cancels it in its teardown


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/", hello)
    app.router.add_get("/slow", slow)
    app.router.add_get("/held", held)
    app.router.add_get("/stream", stream)
    app.router.add_get("/ws", websocket)
    app.router.add_get("/events", events)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    app.on_startup.append(on_startup)
    return app


app = make_app()  # for gunicorn


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiohttp test app")
    parser.add_argument("mode", choices=["run_app", "runner", "chain", "stock"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--policy", default="accept-until-idle")
    parser.add_argument("--idle", type=float, default=None)
    parser.add_argument("--max-wait", type=float, default=None)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--grace-period", type=float, default=None)
    parser.add_argument("--websocket-close-grace", type=float, default=1.0)
    parser.add_argument("--prestop-path", default=None)
    parser.add_argument("--shutdown-timeout", type=float, default=60.0, help="stock only")
    parser.add_argument("--backlog", type=int, default=128)
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument(
        "--stock-beside",
        action="store_true",
        help="runner only: also serve the app with a stock aiohttp AppRunner on another port",
    )
    return parser


async def serve_with_runner(args: argparse.Namespace, coordinator: object) -> None:
    """What a user with an AppRunner of their own writes."""
    import anyio

    import graceful
    import graceful.aiohttp

    assert isinstance(coordinator, graceful.ShutdownCoordinator)
    runner = graceful.aiohttp.AppRunner(
        make_app(),
        coordinator=coordinator,
        websocket_close_grace_s=args.websocket_close_grace,
        prestop_path=args.prestop_path,
    )
    await runner.setup()
    stock = web.AppRunner(make_app(), handle_signals=False, shutdown_timeout=0.5)
    try:
        site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=args.backlog)
        await site.start()
        if args.stock_beside:  # another application on the same loop, not graceful's
            await stock.setup()
            beside = web.TCPSite(stock, "127.0.0.1", 0)
            await beside.start()
            say(f"stock beside on {beside.name}")
        async with anyio.create_task_group() as tg:
            await tg.start(coordinator.run)  # returns once the signal handlers are in place
            say(f"======== Running on {site.name} ========")
    finally:
        await runner.cleanup()
        await stock.cleanup()


async def serve_in_chain(args: argparse.Namespace, coordinator: object) -> None:
    """graceful's middleware in the application's chain (``setup``), under aiohttp's own
    ``web.AppRunner``: the coordinator sees requests, not connections."""
    import anyio

    import graceful
    import graceful.aiohttp

    assert isinstance(coordinator, graceful.ShutdownCoordinator)
    app = make_app()
    graceful.aiohttp.setup(
        app,
        coordinator=coordinator,
        websocket_close_grace_s=args.websocket_close_grace,
        prestop_path=args.prestop_path,
    )
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=args.backlog)
        await site.start()
        async with anyio.create_task_group() as tg:
            await tg.start(coordinator.run)
            say(f"======== Running on {site.name} ========")
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    loop = None
    if args.uvloop:
        import uvloop

        loop = uvloop.new_event_loop()
    if args.mode == "stock":
        web.run_app(
            make_app(),
            host="127.0.0.1",
            port=args.port,
            backlog=args.backlog,
            shutdown_timeout=args.shutdown_timeout,
            loop=loop,
        )
        say("exited")
        return 0

    import graceful
    import graceful.aiohttp

    coordinator = graceful.ShutdownCoordinator(
        policy=graceful.policy_from_name(args.policy, idle_s=args.idle, max_wait_s=args.max_wait),
        drain_timeout_s=args.drain_timeout,
        grace_period_s=args.grace_period,
    )
    if args.mode == "runner":
        asyncio.run(serve_with_runner(args, coordinator))
    elif args.mode == "chain":
        asyncio.run(serve_in_chain(args, coordinator))
    else:
        graceful.aiohttp.run_app(
            make_app(),
            coordinator=coordinator,
            host="127.0.0.1",
            port=args.port,
            backlog=args.backlog,
            websocket_close_grace_s=args.websocket_close_grace,
            prestop_path=args.prestop_path,
            loop=loop,
        )
    say("exited")
    return 0


if __name__ == "__main__":
    sys.exit(main())
