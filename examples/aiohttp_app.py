"""An example aiohttp app for graceful-drain's docs and tests.

    python -m examples.aiohttp_run_app --port 8080

Routes:
    ``/slow?s=2``   answers after 2 seconds
    ``/events``     a server-sent-event stream that ends cleanly when draining begins
"""

from __future__ import annotations

import sys

import anyio
from aiohttp import web

import graceful.aiohttp


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def slow(request: web.Request) -> web.Response:
    seconds = float(request.query.get("s", "1"))
    say(f"slow request started ({seconds:g} s)")  # tests wait for this line
    await anyio.sleep(seconds)
    return web.Response(text=f"slept {seconds:g}\n")


# --8<-- [start:events]
async def events(request: web.Request) -> web.StreamResponse:
    signal = request.config_dict[graceful.aiohttp.DRAIN_SIGNAL_KEY]  # also in sub-apps
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    while not signal.draining:
        await response.write(b"data: tick\n\n")
        await signal.wait(timeout_s=1)
    await response.write(b"event: bye\ndata: server draining\n\n")
    return response


# --8<-- [end:events]


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/slow", slow)
    app.router.add_get("/events", events)
    return app
