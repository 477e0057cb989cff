"""The demo's backend: a tiny pure-ASGI app (no framework needed).

``/`` answers ``hello``; ``/slow?s=2`` answers after 2 seconds; a websocket on any path
echoes text messages.  Every response carries
``x-backend`` (from ``GRACEFUL_DEMO_NAME``) so the demo can tell who served it.

It is pure ASGI so that what the demo measures is the server and its shutdown, not a
framework's, and so that stock uvicorn and graceful serve byte-for-byte the same app.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any
from urllib.parse import parse_qs

NAME = os.environ.get("GRACEFUL_DEMO_NAME", "backend").encode()

#: How servers are told to load this app (uvicorn's ``MODULE:APP``).
IMPORT_STRING = f"{__name__}:app"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] == "websocket":
        await _echo(receive, send)
        return
    if scope["type"] != "http":
        return
    body = b"hello\n"
    if scope["path"] == "/slow":
        seconds = float(parse_qs(scope["query_string"].decode()).get("s", ["1"])[0])
        await asyncio.sleep(min(seconds, 60.0))
        body = b"slow\n"
    headers = [
        (b"content-type", b"text/plain"),
        (b"content-length", str(len(body)).encode()),
        (b"x-backend", NAME),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _echo(receive: Any, send: Any) -> None:
    """A websocket echo: every text message comes back, until the client leaves."""
    assert (await receive())["type"] == "websocket.connect"
    await send({"type": "websocket.accept", "headers": [(b"x-backend", NAME)]})
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        await send({"type": "websocket.send", "text": message.get("text") or ""})
