"""Server-sent events that end cleanly when the server starts draining (Starlette).

    graceful run examples.sse:app --port 8000

``/events`` sends ``data: <n>`` every ``interval`` seconds (default 0.5).  Once draining
begins the stream sends a last ``event: bye`` and ends: the client sees a complete
response and reconnects — through the load balancer, to a backend that is not going
away — instead of a connection cut at the drain deadline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

import graceful.asgi


# --8<-- [start:events]
async def events(request: Request) -> Response:
    interval_s = float(request.query_params.get("interval", "0.5"))
    signal = graceful.asgi.drain_signal(request.scope)  # None without the middleware

    async def stream() -> AsyncIterator[str]:
        n = 0
        while signal is None or not signal.draining:
            yield f"data: {n}\n\n"
            n += 1
            if signal is None:
                await anyio.sleep(interval_s)
            else:
                await signal.wait(timeout_s=interval_s)  # wakes at once when draining begins
        yield "event: bye\ndata: server draining, reconnect\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")
    # --8<-- [end:events]


app = Starlette(routes=[Route("/events", events)])
