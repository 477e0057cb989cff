"""A raw ASGI app for a *stock* server behind a health-checking balancer: ``/readyz``
answers 200 (as an app's own health route does) and every other path ``hello``."""

from __future__ import annotations

from typing import Any


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b"ready\n" if scope["path"] == "/readyz" else b"hello\n"
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
