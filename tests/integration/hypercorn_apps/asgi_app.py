"""``examples.asgi_app:app`` plus a websocket handler that never ends, for the server
matrix's ASGI rows (``graceful run`` and ``graceful.hypercorn``).

``/ws?stubborn=1`` accepts the websocket and then never receives, sends or returns: only
a cut ends it (as ``/ws?stubborn=1`` of the aiohttp test app).  Everything else goes to
the example app unchanged, lifespan included.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio
from examples.asgi_app import app as example_app


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "websocket" and b"stubborn=1" in scope.get("query_string", b""):
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        sys.stdout.write("websocket accepted\n")
        sys.stdout.flush()
        await anyio.sleep_forever()
    await example_app(scope, receive, send)
