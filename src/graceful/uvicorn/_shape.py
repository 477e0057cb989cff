"""The shape (``graceful._core.shape``) filled in for uvicorn, and its hot path.

``UvicornShape`` follows the phases with uvicorn's listeners, protocols and tasks.
``HotPath`` is the app uvicorn is given: while nothing shuts down it hands each HTTP
request straight to the application, past the middleware; ``tracking_class`` makes the
protocol subclasses that count connections.  Neither replaces a method of uvicorn's or
reads a private name of it: the seams are ``Config.loaded_app``, ``Config(http=…)`` and
the server's task set.  The undocumented names of uvicorn's read here (``server_state``,
a protocol's request ``cycle``) are listed, with the releases they were checked against,
in ``docs/adapters.md`` ("Private names each adapter reads").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import uvicorn
from typing_extensions import final

from .._core.coordinator import ShutdownCoordinator
from .._core.listeners import close_keeping_backlog
from .._core.shape import ServerShape, awaited, called_from, finisher, self_test_failed
from ..asgi import ASGIApp, GracefulMiddleware
from ._http2 import Http2GoAway

if TYPE_CHECKING:
    from .._core.listeners import Handovers


class Server(Protocol):
    """What the shape and the tracking protocols read of graceful's ``uvicorn.Server``
    (``graceful.uvicorn``, which uses this module, not the other way round)."""

    coordinator: ShutdownCoordinator
    config: uvicorn.Config
    idle_grace_s: float
    server_state: Any  # uvicorn's ServerState: connections, tasks
    servers: list[Any]
    should_exit: bool
    force_exit: bool
    lifespan: Any
    _loop: asyncio.AbstractEventLoop | None
    _wake: asyncio.Future[None] | None
    _transports: set[asyncio.BaseTransport]
    _handovers: Handovers
    _hot: HotPath | None

    def grace_for(self, connection: Any) -> float: ...
    def _is_http(self, connection: Any) -> bool: ...
    def _shutdown_connection(self, connection: Any) -> None: ...
    def _protocol_factory(self) -> asyncio.Protocol: ...
    def _transport_made(self, protocol: Any, transport: asyncio.BaseTransport) -> None: ...
    def _transport_of(self, protocol: Any) -> asyncio.BaseTransport | None: ...
    def _transport_closed(self, transport: asyncio.BaseTransport) -> None: ...


__all__ = ("HotPath", "UvicornShape", "is_httptools", "tracking_class")

logger = logging.getLogger("graceful")

#: uvicorn's httptools cycle writes ``Connection: close`` for ``keep_alive = False``
#: from 0.53 on.
_KEEP_ALIVE_WRITES_CLOSE = tuple(int(p) for p in uvicorn.__version__.split(".")[:2]) >= (0, 53)
_CLOSE_HEADER = (b"connection", b"close")


def tracking_class(base: type[Any], server: Any, *, counts: bool) -> type[Any]:
    """A subclass of a uvicorn protocol class that reports to ``server``.

    HTTP protocols (``counts``) count their connection when they are *created* — on
    uvloop that is the kernel hand-over itself; on asyncio it takes over the count the
    listening socket's ``accept()`` already made (see ``graceful._core.listeners``).
    A websocket upgrade hands the transport from the HTTP protocol to a websocket
    protocol without calling the HTTP protocol's ``connection_lost``, so connections
    are closed per transport: whichever protocol holds it last reports the close.

    The subclass adds no instance attribute: uvicorn's httptools protocol has 28, and
    from 30 on CPython 3.11 no longer keeps an instance's attributes in the shared-key
    layout its attribute caches specialise on — every ``self.…`` in uvicorn's
    per-request code would get slower (two attributes more cost about 1,800 instructions
    a request, by ``benchmarks/server_instructions.py``).
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

    __slots__ = ("app", "cycles", "failed", "middleware", "on", "started", "tasks")

    def __init__(self, middleware: GracefulMiddleware, tasks: set[asyncio.Task[Any]]) -> None:
        self.middleware = middleware
        self.tasks = tasks  # uvicorn's server_state.tasks
        self.on = True  # until the first phase change
        self.started = 0  # requests it started (less those adopted)
        self.failed = False  # the self-test failed: off for good, nothing to adopt
        self.cycles: Callable[[], list[Any]] | None = None  # UvicornShape.cycles
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
            codes = [getattr(c, "cr_code", None) for c in awaited(task.get_coro())]
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
        if self.failed:
            return
        running = self.running()
        self.on = False
        self.started -= len(running)  # counted by the coordinator from now on
        for task in running:
            task.add_done_callback(finisher(coordinator, coordinator.request_started()))

    def _dispatcher(self, middleware: GracefulMiddleware) -> ASGIApp:
        hot, real, special_paths = self, middleware.app, middleware.health_endpoints
        app: Callable[[Any, Any, Any], Awaitable[None]] = real

        def first(scope: Any, receive: Any, send: Any) -> Awaitable[None]:
            # The first hot request only: the self-test (``check``).  The dispatcher's
            # ``app`` is the application from now on, so later requests pay nothing.
            nonlocal app
            app = real
            return hot._probe(scope, real(scope, receive, send))

        app = first

        def graceful(scope: Any, receive: Any, send: Any) -> Awaitable[None]:
            if hot.on and scope["type"] == "http" and scope["path"] not in special_paths:
                hot.started += 1
                return app(scope, receive, send)
            return middleware(scope, receive, send)

        return graceful

    # --------------------------------------------------------------- self-test

    async def _probe(self, scope: Any, coroutine: Awaitable[None]) -> None:
        """The first hot request's app call: the self-test runs while this request is
        suspended (``call_soon`` runs before the task's next step), then the app runs."""
        task = asyncio.current_task()
        if task is None:
            self.fail("the application is not called from a task", None)
        else:
            asyncio.get_running_loop().call_soon(self.check, task, scope)
            await asyncio.sleep(0)
        await coroutine

    def check(self, task: asyncio.Task[Any], scope: Any) -> None:
        """The self-test: ``running`` — the finder that counts the hot path's requests
        for the drain — finds the request being served (``task``, suspended), and the
        shape finds its request cycle (``cycles``: the nudge, the 503 of a cut)."""
        if not self.on:  # shutdown began meanwhile: adopt ran the finder already
            return
        if task not in self.tasks:
            self.fail("the request's task is not in uvicorn's server_state.tasks", task)
        elif task not in self.running():
            self.fail("the request's task does not await the application's coroutine", task)
        elif self.cycles is not None and not any(c.scope is scope for c in self.cycles()):
            self.fail("no connection's cycle holds the request's scope", task)

    def fail(self, what: str, task: asyncio.Task[Any] | None) -> None:
        """The self-test failed: one warning, and every later request takes the
        middleware (which counts each itself); the request being tested is reported to
        the coordinator until its task ends."""
        self_test_failed("uvicorn", uvicorn.__version__, what)
        self.on = False
        self.failed = True
        if task is not None and not task.done():
            coordinator = self.middleware.coordinator
            self.started -= 1
            task.add_done_callback(finisher(coordinator, coordinator.request_started()))


@final
class UvicornShape(ServerShape):
    """The phases and stopping for uvicorn (``graceful._core.shape``): the server's
    listeners, connections (uvicorn's protocols, their request cycles) and tasks."""

    def __init__(self, server: Server) -> None:
        super().__init__(server.coordinator, idle_grace_s=server.idle_grace_s)
        self.server = server
        self.adopted: list[Any] = []  # the hot path's cycles running at adoption
        self.closing: asyncio.Future[Any] | None = None
        #: zttp's HTTP/2 connections (``--http2``): GOAWAY at nudging.
        self.http2 = Http2GoAway(server.coordinator, lambda: server._loop)

    def cycles(self) -> list[Any]:
        """The request cycle (scope, send, response state) of every HTTP connection."""
        server = self.server
        connection: Any
        cycles = []
        for connection in server.server_state.connections:
            cycle = getattr(connection, "cycle", None) if server._is_http(connection) else None
            if cycle is not None:
                cycles.append(cycle)
        return cycles

    def listeners_opened(self) -> None:
        hot = self.server._hot
        if hot is not None:
            hot.cycles = self.cycles  # for the self-test (HotPath.check)
        super().listeners_opened()

    def shutdown_requested(self) -> None:
        hot = self.server._hot
        if hot is None or hot.failed:
            return
        hot.adopt(self.coordinator)
        # Their responses, for the 503 of a cut (uvicorn's cycles: the ASGI scope and
        # send of each connection's current request).
        special = hot.middleware.health_endpoints
        self.adopted = [
            cycle
            for cycle in self.cycles()
            if not cycle.response_complete and cycle.scope["path"] not in special
        ]

    def nudge(self) -> None:
        """Every request in flight whose response has not started — adopted from the
        hot path or counted by the middleware — closes its connection after it, with
        ``Connection: close``.

        uvicorn 0.53+ writes the header for ``keep_alive = False``; before, its httptools
        cycle writes it only when the *request* carried it, so there the header joins the
        request's header list too (a hop-by-hop header, meant for this connection).
        """
        self.goaway_http2()
        hot = self.server._hot
        if hot is None or hot.failed:
            return
        for cycle in self.cycles():
            if not cycle.response_started:
                cycle.keep_alive = False
                if not _KEEP_ALIVE_WRITES_CLOSE:
                    headers = cycle.scope["headers"]
                    if _CLOSE_HEADER not in headers:
                        headers.append(_CLOSE_HEADER)

    def goaway_http2(self) -> None:
        """Every HTTP/2 connection (uvicorn's zttp) is told to go away."""
        for connection in list(self.server.server_state.connections):
            if self.http2.handles(connection):
                self.http2.goaway(connection)

    def close_listeners(self) -> None:
        server, loop = self.server, self.server._loop
        if loop is None:
            return
        listeners, server.servers = list(getattr(server, "servers", [])), []
        self.closing = close_keeping_backlog(
            listeners, server._protocol_factory, loop, server._handovers, ssl=server.config.ssl
        )

    async def listeners_closed(self, timeout_s: float) -> None:
        if self.closing is not None:
            await asyncio.wait((self.closing,), timeout=timeout_s)

    def close_idle(self, grace_s: float) -> None:
        """Busy connections close after their response (Connection: close); idle
        keep-alive ones get ``grace_s`` to send one more request, those that have not
        sent their first one yet the server's ``first_request_grace_s``.  Websockets are
        left to the middleware (1001 after a grace)."""
        server, loop = self.server, self.server._loop
        if loop is None:
            return
        connection: Any
        for connection in list(server.server_state.connections):
            if not server._is_http(connection):
                continue
            if self.http2.handles(connection):  # GOAWAY: at once if idle, else after
                self.http2.goaway(connection)  # its last stream
                continue
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not getattr(cycle, "response_complete", True):
                connection.shutdown()
            else:
                grace = grace_s if cycle is not None else server.grace_for(connection)
                loop.call_later(grace, server._shutdown_connection, connection)

    def stopping(self) -> None:
        server = self.server
        server.should_exit = True
        if server._wake is not None and not server._wake.done():
            server._wake.set_result(None)

    async def cut(self, timeout_s: float) -> None:
        """Cancel the requests still running; those adopted from the hot path whose
        response has not started get the middleware's 503 first (no middleware around
        them would send it; a handler that ignores the cancellation has it all the
        same)."""
        tasks = [t for t in self.server.server_state.tasks if not t.done()]
        if not tasks:
            return
        logger.warning("cutting %d request(s) still running", len(tasks))
        hot = self.server._hot
        answer = [c for c in self.adopted if not c.response_started and not c.disconnected]
        if hot is not None and answer:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(hot.middleware.cut(c.scope, c.send) for c in answer)),
                    max(0.001, timeout_s / 2),
                )
        for task in tasks:
            task.cancel(msg="graceful: stopping")
        await asyncio.wait(tasks, timeout=timeout_s / 2)

    def close_connections(self) -> None:
        for connection in list(self.server.server_state.connections):
            connection.shutdown()
        for transport in list(self.server._transports):
            transport.close()

    async def lifespan_shutdown(self) -> None:
        if not self.server.force_exit:
            await self.server.lifespan.shutdown()
