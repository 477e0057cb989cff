"""A Starlette app with :class:`graceful.asgi.GracefulMiddleware`, for *stock* servers
(``uvicorn app:app``, ``hypercorn app:app``).  With ``RUN_COORDINATOR=1`` its lifespan
is the documented one (``examples/middleware_lifespan.py``): it runs the coordinator.

``/slow?s=N`` answers after N seconds and prints "slow request started"."""

from __future__ import annotations

import os
import sys

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from examples.middleware_lifespan import coordinator
from examples.middleware_lifespan import lifespan as documented_lifespan
from graceful.asgi import GracefulMiddleware

lifespan = documented_lifespan if os.environ.get("RUN_COORDINATOR") == "1" else None


async def slow(request: Request) -> PlainTextResponse:
    print("slow request started", file=sys.stderr, flush=True)
    await anyio.sleep(float(request.query_params.get("s", "1")))
    return PlainTextResponse("slow done")


async def home(request: Request) -> PlainTextResponse:
    return PlainTextResponse("home")


app = Starlette(
    routes=[Route("/", home), Route("/slow", slow)],
    lifespan=lifespan,
    middleware=[Middleware(GracefulMiddleware, coordinator=coordinator)],
)
