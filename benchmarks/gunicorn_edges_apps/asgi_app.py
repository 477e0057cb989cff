"""A plain ASGI app (see the package's docstring for the routes)."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import parse_qs


async def _stubborn(seconds: float) -> None:
    """Sleep ``seconds`` whatever: a cancellation is caught and the sleep goes on."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            continue


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    path = scope["path"]
    query = parse_qs(scope.get("query_string", b"").decode())
    seconds = float(query.get("s", ["1"])[0])
    status = 200
    if path == "/sleep":
        await asyncio.sleep(seconds)
        body = f"slept {seconds:g}\n".encode()
    elif path == "/stubborn":
        await _stubborn(seconds)
        body = f"slept {seconds:g} (stubborn)\n".encode()
    elif path == "/readyz":
        body = b"app ready\n"
    elif path == "/":
        body = b"ok\n"
    else:
        status, body = 404, b"not found\n"
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
