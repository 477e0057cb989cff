"""An example Starlette app for graceful-drain's tests, demo and docs.

    graceful run examples.asgi_app:app --policy accept-until-idle --idle 1
    # or wrap it yourself:  GracefulMiddleware(app, coordinator=...)

Routes:
    ``/``              ``hello``
    ``/slow?s=2``      answers after 2 seconds
    ``/sse?n=100``     a server-sent-event stream that ends cleanly when draining begins
    ``/ws``            a websocket echo
    ``/signal``        what the request's DrainSignal says (``draining=False``), or
                       ``no drain signal`` when no graceful server or middleware set one
Lifespan startup and shutdown print ``lifespan startup`` / ``lifespan shutdown`` (the
tests check that shutdown still runs after a cut drain).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

import graceful.asgi


def say(line: str) -> None:
    """One write per line, so that lines of several worker processes don't interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def hello(request: Request) -> Response:
    return PlainTextResponse("hello\n")


async def slow(request: Request) -> Response:
    seconds = float(request.query_params.get("s", "1"))
    say(f"slow request started ({seconds:g} s)")  # tests wait for this line
    await anyio.sleep(seconds)
    return PlainTextResponse(f"slept {seconds:g}\n")


async def sse(request: Request) -> Response:
    """Server-sent events that end cleanly once the server starts draining."""
    count = int(request.query_params.get("n", "100"))
    interval = float(request.query_params.get("interval", "0.1"))
    signal = graceful.asgi.drain_signal(request.scope)

    async def events() -> AsyncIterator[str]:
        for i in range(count):
            if signal is not None and signal.draining:
                yield "event: bye\ndata: server draining\n\n"
                return
            yield f"data: {i}\n\n"
            if signal is None:
                await anyio.sleep(interval)
            else:
                await signal.wait(timeout_s=interval)

    return StreamingResponse(events(), media_type="text/event-stream")


async def drain_state(request: Request) -> Response:
    signal = graceful.asgi.drain_signal(request.scope)
    text = "no drain signal" if signal is None else f"draining={signal.draining}"
    return PlainTextResponse(text + "\n")


async def echo(websocket: WebSocket) -> None:
    await websocket.accept()
    say("websocket accepted")
    try:
        while True:
            await websocket.send_text(await websocket.receive_text())
    except WebSocketDisconnect as exc:
        say(f"websocket disconnected with code {exc.code}")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    say("lifespan startup")
    yield
    say("lifespan shutdown")


app = Starlette(
    routes=[
        Route("/", hello),
        Route("/slow", slow),
        Route("/sse", sse),
        Route("/signal", drain_state),
        WebSocketRoute("/ws", echo),
    ],
    lifespan=lifespan,
)
