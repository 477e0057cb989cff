"""graceful's uvicorn server's hot path and protocol classes (see ``graceful.uvicorn``).

``HotPath`` is the app uvicorn is given: while nothing shuts down it hands each HTTP
request straight to the application, past the middleware; ``tracking_class`` makes the
protocol subclasses that count connections.  Neither replaces a method of uvicorn's or
reads a private name of it: the seams are ``Config.loaded_app``, ``Config(http=…)`` and
the server's task set.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from typing_extensions import final

from ._coordinator import ShutdownCoordinator
from .asgi import ASGIApp, GracefulMiddleware

__all__ = ("HotPath", "is_httptools", "tracking_class")


def tracking_class(base: type[Any], server: Any, *, counts: bool) -> type[Any]:
    """A subclass of a uvicorn protocol class that reports to ``server``.

    HTTP protocols (``counts``) count their connection when they are *created* — on
    uvloop that is the kernel hand-over itself; on asyncio it takes over the count the
    listening socket's ``accept()`` already made (see ``graceful._listeners``).
    A websocket upgrade hands the transport from the HTTP protocol to a websocket
    protocol without calling the HTTP protocol's ``connection_lost``, so connections
    are closed per transport: whichever protocol holds it last reports the close.

    The subclass adds no instance attribute: uvicorn's httptools protocol has 28, and
    from 30 on CPython 3.11 no longer keeps an instance's attributes in the shared-key
    layout its attribute caches specialise on — every ``self.…`` in uvicorn's
    per-request code would get slower (two more made about 1,800 instructions per
    request, measured with ``benchmarks/server_instructions.py``).
    """
    base = getattr(base, "_graceful_base", base)

    class Tracking(base):  # type: ignore[misc]
        _graceful_base = base

        _graceful_counted = counts  # every instance was counted when it was created

        if counts:

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                server._handovers.protocol_created()
                super().__init__(*args, **kwargs)

        def connection_made(self, transport: asyncio.BaseTransport, *args: Any) -> None:
            server._transport_made(self, transport)
            super().connection_made(transport, *args)

        def connection_lost(self, exc: Exception | None) -> None:
            transport = server._transport_of(self)
            try:
                super().connection_lost(exc)
            finally:
                if transport is not None:
                    server._transport_closed(transport)

    Tracking.__name__ = Tracking.__qualname__ = f"Graceful{base.__name__}"
    return Tracking


def is_httptools(protocol_class: type[Any]) -> bool:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is not installed
        return False
    return issubclass(protocol_class, HttpToolsProtocol)


@final
class HotPath:
    """The hot path (see "The hot path" in the module docs): the app uvicorn calls.

    ``app`` is a plain function that returns the coroutine of the app it picks, so the
    hot path adds no coroutine of its own to a request: per request it tests one flag,
    the scope's type and path, and counts one integer (the ``DrainSignal`` is in the
    lifespan state, which uvicorn copies into every request's scope).  uvicorn's own
    task set (``server_state.tasks``) holds the requests in flight: a request's task
    awaits the coroutine the dispatcher returned, so those that do not await the
    middleware's are the hot path's (``running``; the task asking, a scrape or a
    shutdown request, is running rather than awaiting: its call stack tells).
    ``adopt`` (the first phase change) turns the hot path off for good: the requests
    still running are reported to the coordinator, each until its task ends, and later
    ones go to the middleware.
    """

    __slots__ = ("app", "middleware", "on", "started", "tasks")

    def __init__(self, middleware: GracefulMiddleware, tasks: set[asyncio.Task[Any]]) -> None:
        self.middleware = middleware
        self.tasks = tasks  # uvicorn's server_state.tasks
        self.on = True  # until the first phase change
        self.started = 0  # requests it started (less those adopted)
        self.app: ASGIApp = self._dispatcher(middleware)

    def running(self) -> list[asyncio.Task[Any]]:
        """The tasks of the hot path's requests still running."""
        middleware_code = type(self.middleware).__call__.__code__
        current = asyncio.current_task()
        found: list[asyncio.Task[Any]] = []
        for task in self.tasks:
            if task.done():
                continue
            if task is current:  # a request asking (a scrape, a shutdown): not suspended
                if not called_from(middleware_code):
                    found.append(task)
                continue
            awaited: Any = task.get_coro()
            codes = []
            while awaited is not None:  # the chain of coroutines the task awaits
                codes.append(getattr(awaited, "cr_code", None))
                awaited = getattr(awaited, "cr_await", None)
            # Two or more: started (the task's own coroutine awaits an app's).
            if len(codes) > 1 and middleware_code not in codes:
                found.append(task)
        return found

    def requests(self) -> tuple[int, int]:
        """The coordinator's request source: ``(in_flight, started)``."""
        return (len(self.running()) if self.on else 0), self.started

    def adopt(self, coordinator: ShutdownCoordinator) -> None:
        """Shutdown was requested: report the requests in flight to the coordinator,
        each until its task ends; every later request takes the middleware."""
        running = self.running()
        self.on = False
        self.started -= len(running)  # counted by the coordinator from now on
        for task in running:
            task.add_done_callback(finisher(coordinator, coordinator.request_started()))

    def _dispatcher(self, middleware: GracefulMiddleware) -> ASGIApp:
        hot, app, special_paths = self, middleware.app, middleware.health_endpoints

        def graceful(scope: Any, receive: Any, send: Any) -> Awaitable[None]:
            if hot.on and scope["type"] == "http" and scope["path"] not in special_paths:
                hot.started += 1
                return app(scope, receive, send)
            return middleware(scope, receive, send)

        return graceful


def called_from(code: Any) -> bool:
    """Whether a frame of ``code`` is on the current call stack (a running coroutine's
    frames link to the ones that resumed it)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def finisher(
    coordinator: ShutdownCoordinator, sampled: float | None
) -> Callable[[asyncio.Task[Any]], None]:
    """A done callback that reports the end of an adopted request."""

    def finished(task: asyncio.Task[Any]) -> None:
        coordinator.request_finished(sampled)

    return finished
