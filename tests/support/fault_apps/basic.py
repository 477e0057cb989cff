"""A raw ASGI app whose every request says when it started and when it was *handled*.

``handled <id>`` is written after the last ``http.response.body`` was handed to the
server, so a test can compare what the app answered with what every client received:
a request the app handled whose response never reached its client is a loss.

Routes (``id`` names the request in the log; every response body is ``ok <id>``):

``/``                     answers at once
``/slow?s=1``             answers after ``s`` seconds
``/big?mb=50``            a ``mb`` MiB response in 64 KiB chunks
``/upload``               reads the whole request body, answers ``got <bytes>``
``/stubborn``             swallows every cancellation and keeps sleeping (60 s)
``/thread``               blocks 60 s in ``anyio.to_thread.run_sync(time.sleep)``
``/executor``             blocks 60 s in ``loop.run_in_executor(None, time.sleep)``

Lifespan, driven by environment variables:

``FAULTS_STARTUP_GATE=<path>``   startup logs ``startup waiting`` and waits until the
                                 file exists (at most 60 s), then ``startup complete``
``FAULTS_SHUTDOWN=hang``         shutdown logs ``shutdown hanging`` and sleeps an hour
``FAULTS_SHUTDOWN=raise``        shutdown logs ``shutdown raising`` and fails the way
                                 Starlette does (``lifespan.shutdown.failed``, re-raise)
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

import anyio

from . import log

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CHUNK = 64 * 1024


async def _respond(send: Send, status: int, body: bytes, rid: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
    log(f"handled {rid}")


async def _http(scope: Scope, receive: Receive, send: Send) -> None:
    query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
    rid = query.get("id", "-")
    path = scope["path"]
    if path == "/":
        await _respond(send, 200, f"ok {rid}\n".encode(), rid)
        return
    log(f"started {rid} {path}")
    if path == "/slow":
        await anyio.sleep(float(query.get("s", "1")))
        await _respond(send, 200, f"ok {rid}\n".encode(), rid)
    elif path == "/big":
        size = int(float(query.get("mb", "50")) * 1024 * 1024)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(size).encode())],
            }
        )
        chunk = b"x" * CHUNK
        for offset in range(0, size, CHUNK):
            await send(
                {
                    "type": "http.response.body",
                    "body": chunk[: size - offset],
                    "more_body": offset + CHUNK < size,
                }
            )
        log(f"handled {rid}")
    elif path == "/upload":
        total = 0
        more = True
        reported = 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                log(f"disconnected {rid} after {total} bytes")
                return
            total += len(message.get("body", b""))
            more = message.get("more_body", False)
            if total - reported >= 8 * 1024 * 1024:  # progress the test can wait on
                reported = total
                log(f"upload {rid} at {total // (1024 * 1024)} MiB")
        await _respond(send, 200, f"got {total}\n".encode(), rid)
    elif path == "/stubborn":
        for _ in range(1000):  # bounded: ~60 s of sleeping, whatever happens
            try:
                await asyncio.sleep(60)
                break
            except asyncio.CancelledError:
                log(f"ignored cancellation {rid}")
        await _respond(send, 200, f"ok {rid}\n".encode(), rid)
    elif path == "/thread":
        await anyio.to_thread.run_sync(time.sleep, 60)
        await _respond(send, 200, f"ok {rid}\n".encode(), rid)
    elif path == "/executor":
        await asyncio.get_running_loop().run_in_executor(None, time.sleep, 60)
        await _respond(send, 200, f"ok {rid}\n".encode(), rid)
    else:
        await _respond(send, 404, b"not found\n", rid)


async def _lifespan(scope: Scope, receive: Receive, send: Send) -> None:
    message = await receive()
    assert message["type"] == "lifespan.startup"
    gate = os.environ.get("FAULTS_STARTUP_GATE")
    if gate:
        log("startup waiting")
        # The app's own poll (nothing to wait on but a file): a stat every 10 ms.
        with anyio.move_on_after(60):
            while not os.path.exists(gate):  # noqa: ASYNC110, ASYNC240
                await anyio.sleep(0.01)
    log("startup complete")
    await send({"type": "lifespan.startup.complete"})
    message = await receive()
    assert message["type"] == "lifespan.shutdown"
    mode = os.environ.get("FAULTS_SHUTDOWN", "")
    if mode == "hang":
        log("shutdown hanging")
        await anyio.sleep(3600)
    elif mode == "raise":
        log("shutdown raising")
        try:
            raise RuntimeError("faults: lifespan shutdown failed on purpose")
        except RuntimeError:
            await send({"type": "lifespan.shutdown.failed", "message": traceback.format_exc()})
            raise
    log("shutdown complete")
    await send({"type": "lifespan.shutdown.complete"})


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http":
        await _http(scope, receive, send)
    elif scope["type"] == "lifespan":
        await _lifespan(scope, receive, send)
