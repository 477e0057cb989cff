"""Hello-world ASGI apps for the benchmarks: the bare app and the same app wrapped."""

from __future__ import annotations

from typing import Any

from graceful import ShutdownCoordinator
from graceful.asgi import GracefulMiddleware

BODY = b"hello\n"
HEADERS = [(b"content-type", b"text/plain"), (b"content-length", b"6")]


async def bare(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


wrapped = GracefulMiddleware(bare, coordinator=ShutdownCoordinator())
