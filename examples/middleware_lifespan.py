"""GracefulMiddleware under *plain* ``uvicorn myapp:app``: the app's lifespan runs the
coordinator, which then takes SIGTERM from uvicorn, runs the policy at the app's level
and hands the signal back to uvicorn once it stopped (see docs/asgi.md).

    uvicorn examples.middleware_lifespan:app --port 8000
"""

from __future__ import annotations

import contextlib
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


# --8<-- [start:lifespan]
@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        await tg.start(coordinator.run)  # takes SIGTERM/SIGINT from uvicorn until it stopped
        yield
        tg.cancel_scope.cancel()


# --8<-- [end:lifespan]


async def home(request: Request) -> PlainTextResponse:
    return PlainTextResponse("home")


app = Starlette(
    routes=[Route("/", home)],
    lifespan=lifespan,
    middleware=[Middleware(GracefulMiddleware, coordinator=coordinator)],
)
