"""graceful.aiohttp's hot path: requests straight to the application while nothing shuts down.

aiohttp runs a middleware through machinery of its own (a cached chain of
``functools.partial`` objects and a coroutine per middleware): one no-op middleware
costs about 14,000 instructions a request, 7 % of a hello-world request.  So
graceful's ``AppRunner`` keeps its ``Middleware`` out of the application's chain and
hands aiohttp's ``web.Server`` a dispatcher as its ``request_handler`` (a public
attribute, read by each connection when it is made): a plain function that returns the
coroutine of the application's own handler while nothing shuts down — one flag, one
header test, one integer per request, no coroutine of its own — and calls the
middleware around that handler otherwise, and for every websocket upgrade.

The requests the hot path started are counted where they run: each is a task whose
awaited coroutines include the application's handler and not the middleware
(``HotPath.running``).  At the shutdown request (the coordinator's first phase change)
``adopt`` reports those still running to the coordinator, each until its task ends, and
turns the hot path off for good.  The middleware's ``on_response_prepare`` receiver
nudges their responses like any other; at the cut, those whose response had not started
get the middleware's 503 before they are cancelled (the request is found among the
locals of the task's coroutines, by type).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import hdrs, web
from typing_extensions import final

from ._aiohttp_middleware import Middleware
from ._coordinator import ShutdownCoordinator
from ._shape import called_from, finisher

__all__ = ("HotPath",)

#: aiohttp's ``web.Server.request_handler``.
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def _code(function: Any) -> Any:
    """The code object of a function or bound method (``None`` for other callables)."""
    return getattr(getattr(function, "__func__", function), "__code__", None)


def _awaited(task: asyncio.Task[Any]) -> list[Any]:
    """The coroutines ``task`` awaits, outermost first (suspended tasks)."""
    chain = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        chain.append(awaited)
        awaited = getattr(awaited, "cr_await", None)
    return chain


def _stack_codes() -> set[Any]:
    """The code objects on the current call stack (a running task's coroutines)."""
    codes = set()
    frame = inspect.currentframe()
    while frame is not None:
        codes.add(frame.f_code)
        frame = frame.f_back
    return codes


def _request_of(task: asyncio.Task[Any]) -> web.BaseRequest | None:
    """The request a hot-path task serves: a local of one of its coroutines."""
    for coroutine in _awaited(task):
        if not inspect.iscoroutine(coroutine):
            continue
        for value in inspect.getcoroutinelocals(coroutine).values():
            if isinstance(value, web.BaseRequest):
                return value
    return None


@final
class HotPath:
    """The dispatcher ``AppRunner`` gives aiohttp's server, and what it started.

    Args:
        middleware: The runner's middleware, out of the application's chain.
        handle: The ``request_handler`` aiohttp's server was made with (the
            application's).
    """

    __slots__ = ("adopted", "handle", "middleware", "on", "request_handler", "started")

    def __init__(self, middleware: Middleware, handle: Handler) -> None:
        self.middleware = middleware
        self.handle = handle
        self.on = True  # until the first phase change
        self.started = 0  # requests it started (less those adopted, less probes)
        #: The requests adopted at the shutdown request: their tasks and requests.
        self.adopted: list[tuple[asyncio.Task[Any], web.BaseRequest | None]] = []
        self.request_handler = self._dispatcher()

    def _dispatcher(self) -> Handler:
        hot, handle, middleware, upgrade = self, self.handle, self.middleware, hdrs.UPGRADE

        def dispatch(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
            if hot.on and upgrade not in request.headers:
                hot.started += 1
                return handle(request)
            return middleware(cast(web.Request, request), handle)

        return dispatch

    def running(self) -> list[asyncio.Task[Any]]:
        """The tasks of the hot path's requests still running (not the health routes')."""
        handle_code = _code(self.handle)
        skip = {_code(type(self.middleware).__call__), *map(_code, self.middleware.uncounted)}
        current = asyncio.current_task()
        found = []
        for task in asyncio.all_tasks():
            if task.done():
                continue
            if task is current:  # running, not suspended: its call stack tells
                codes = _stack_codes()
            else:
                codes = {getattr(c, "cr_code", None) for c in _awaited(task)}
            if handle_code in codes and skip.isdisjoint(codes):
                found.append(task)
        return found

    def requests(self) -> tuple[int, int]:
        """The coordinator's request source: ``(in_flight, started)``."""
        return (len(self.running()) if self.on else 0), self.started

    def uncount(self) -> None:
        """A health route's handler runs: if the hot path dispatched it, it is no
        request (called first thing by each)."""
        if self.on and not called_from(_code(type(self.middleware).__call__)):
            self.started -= 1

    def adopt(self, coordinator: ShutdownCoordinator) -> None:
        """Shutdown was requested: report the requests in flight to the coordinator,
        each until its task ends, let the middleware cut them; later requests take the
        middleware."""
        if not self.on:
            return
        running = self.running()
        self.on = False
        self.started -= len(running)  # counted by the coordinator from now on
        for task in running:
            task.add_done_callback(finisher(coordinator, coordinator.request_started()))
            self.middleware.adopt_task(task)
            self.adopted.append((task, _request_of(task)))

    async def answer_cut(self, timeout_s: float) -> None:
        """The 503 of each adopted request still running whose response has not
        started (before the cut cancels them), within ``timeout_s``."""
        answer = [
            request
            for task, request in self.adopted
            if request is not None and not task.done() and not _response_started(request)
        ]
        if answer:
            await asyncio.wait(
                [asyncio.ensure_future(self.middleware.answer_cut(r)) for r in answer],
                timeout=max(timeout_s, 0.001),
            )


def _response_started(request: web.BaseRequest) -> bool:
    try:
        return request.writer.output_size > 0
    except (AttributeError, RuntimeError):
        return False
