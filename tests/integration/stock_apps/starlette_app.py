"""A Starlette app with :class:`graceful.asgi.GracefulMiddleware`, for *stock* servers
(``uvicorn app:app``, ``hypercorn app:app``).  With ``RUN_COORDINATOR=1`` its lifespan
runs the coordinator (the documented way to get the policy under a stock server).

``/slow?s=N`` answers after N seconds and prints "slow request started"."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

import graceful
from graceful.asgi import GracefulMiddleware

coordinator = graceful.ShutdownCoordinator(
    policy=graceful.AcceptUntilIdle(idle_s=1), grace_period_s=20
)


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        if os.environ.get("RUN_COORDINATOR") == "1":
            await tg.start(coordinator.run)
        yield
        tg.cancel_scope.cancel()


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
