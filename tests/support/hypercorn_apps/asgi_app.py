"""``examples.asgi_app:app`` plus a websocket handler that never ends, for the server
matrix's ASGI rows (``graceful run`` and ``graceful.hypercorn``).

``/ws?stubborn=1`` accepts the websocket and then never receives, sends or returns: only
a cut ends it (as ``/ws?stubborn=1`` of the aiohttp test app).  ``/held`` prints
``slow request started (held)`` and answers ``released`` once its body has come: a
request in flight for exactly as long as a test withholds the body's last byte.
``/after?s=1`` answers at once and works on for a second after its response (a
background task).  Everything else goes to the example app unchanged, lifespan included.
With
``TEST_WRAPPING_TASK_FACTORY=1`` (asyncio) every task's coroutine runs inside a wrapper
coroutine, as tracing integrations' task factories do.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import anyio

from examples.asgi_app import app as example_app


async def held(receive: Any, send: Any) -> None:
    """Answer once the request's body has come: a test sends its last byte when the
    request may end."""
    sys.stdout.write("slow request started (held)\n")
    sys.stdout.flush()
    while (message := await receive())["type"] == "http.request" and message.get("more_body"):
        pass
    if message["type"] == "http.disconnect":
        return
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"9")]}
    )
    await send({"type": "http.response.body", "body": b"released\n"})


async def work_after_the_response(scope: Any, send: Any) -> None:
    """Answer at once, then work on (what a background task does) for ``?s=`` seconds."""
    seconds = float(scope.get("query_string", b"s=1").decode().partition("=")[2] or 1)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]}
    )
    await send({"type": "http.response.body", "body": b"sent\n"})
    sys.stdout.write("work after the response started\n")
    sys.stdout.flush()
    await anyio.sleep(seconds)
    sys.stdout.write("work after the response done\n")
    sys.stdout.flush()


def wrap_tasks() -> None:
    """A task factory that runs each coroutine inside a coroutine of its own, as tracing
    integrations do (``TEST_WRAPPING_TASK_FACTORY=1``, asyncio only)."""
    loop = asyncio.get_running_loop()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        async def wrapper() -> Any:
            return await coro

        return asyncio.Task(wrapper(), loop=loop, **kwargs)

    loop.set_task_factory(factory)  # type: ignore[arg-type]


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan" and os.environ.get("TEST_WRAPPING_TASK_FACTORY"):
        wrap_tasks()
    if scope["type"] == "http" and scope["path"] == "/held":
        await held(receive, send)
        return
    if scope["type"] == "http" and scope["path"] == "/after":
        await work_after_the_response(scope, send)
        return
    if scope["type"] == "websocket" and b"stubborn=1" in scope.get("query_string", b""):
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        sys.stdout.write("websocket accepted\n")
        sys.stdout.flush()
        await anyio.sleep_forever()
    await example_app(scope, receive, send)
