"""graceful.hypercorn's hot path: HTTP requests straight to the app while nothing shuts down.

The ASGI middleware costs hypercorn about 18,000 instructions a request (its send
wrapper is a coroutine every response message goes through; on trio every checkpoint
inside a send resumes it).  So the app hypercorn is given is a plain function
(``HotPath.app``) that returns the coroutine of the application itself for an HTTP
request to a path that is no health route while nothing shuts down — one flag, the
scope's type and path, one integer — and the middleware's otherwise (websockets,
lifespan, health routes, every request once shutdown was requested).  The
``DrainSignal`` reaches the application through the lifespan state, which hypercorn
copies into every request's scope (``scope["state"]["graceful"]``).

The requests in flight are counted where hypercorn keeps them: each connection's
streams (HTTP/1.1: the protocol's current stream; HTTP/2: its stream table), an
``HTTPStream`` whose ``closed`` is false is a request in progress.  At the shutdown
request (the coordinator's first phase change) ``adopt`` turns the hot path off for
good and reports those to the coordinator; each is finished when hypercorn next reports
its connection (a busy/idle change, which every stream's end makes, or the close).
When nudging begins an adopted HTTP/1.1 request whose response has not started gets
``Connection: close`` from hypercorn itself: its connection's ``keep_alive_requests``
is raised to ``config.keep_alive_max_requests``, the limit at which hypercorn closes
the connection after the response (HTTP/2 connections get a GOAWAY, as before).  At
the cut, an adopted request whose response has not started is answered 503 through its
stream's ``app_send`` before it is cancelled.

hypercorn's names read here (public attributes of its protocol objects, each guarded):
``ProtocolWrapper.protocol``, ``H11Protocol.stream`` and ``keep_alive_requests``,
``H2Protocol.streams``, ``HTTPStream.closed``, ``state``, ``scope`` and ``app_send``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.typing import AppWrapper
from typing_extensions import final

from ._coordinator import ShutdownCoordinator
from ._hypercorn_connection import _Connection
from .asgi import GracefulMiddleware

__all__ = ("HotPath",)

logger = logging.getLogger("graceful")


def _protocol(conn: _Connection) -> Any:
    """The connection's HTTP protocol object (hypercorn swaps it on an HTTP/2 upgrade)."""
    return getattr(getattr(conn.server, "protocol", None), "protocol", None)


@final
class HotPath:
    """The app graceful's hypercorn worker gives hypercorn, and what it started.

    Args:
        middleware: The middleware around the application.
        connections: The worker's open connections.
    """

    __slots__ = ("app", "connections", "middleware", "on", "started")

    def __init__(self, middleware: GracefulMiddleware, connections: Iterable[_Connection]) -> None:
        self.middleware = middleware
        self.connections = connections
        self.on = True  # until the first phase change
        self.started = 0  # requests it started (less those adopted)
        self.app: AppWrapper = self._dispatcher()

    def _dispatcher(self) -> AppWrapper:
        hot, app, middleware = self, self.middleware.app, self.middleware
        special = middleware.health_endpoints

        def graceful(
            scope: Any,
            receive: Any,
            send: Any,
            sync_spawn: Callable[..., Any],
            call_soon: Callable[..., Any],
        ) -> Awaitable[None]:
            if hot.on and scope["type"] == "http" and scope["path"] not in special:
                hot.started += 1
                return app(scope, receive, send)
            return middleware(scope, receive, send)

        return graceful  # type: ignore[return-value]

    def streams(self, conn: _Connection) -> list[HTTPStream]:
        """The requests in progress on ``conn`` that the hot path may have started."""
        protocol = _protocol(conn)
        candidates: list[Any]
        if isinstance(protocol, H2Protocol):
            candidates = list(protocol.streams.values())
        elif isinstance(protocol, H11Protocol):
            candidates = [protocol.stream]
        else:
            return []
        special = self.middleware.health_endpoints
        found = []
        for stream in candidates:
            if type(stream) is not HTTPStream or stream.closed:
                continue
            scope = getattr(stream, "scope", None)
            if scope is not None and scope.get("path") not in special:
                found.append(stream)
        return found

    def requests(self) -> tuple[int, int]:
        """The coordinator's request source: ``(in_flight, started)``."""
        if not self.on:
            return 0, self.started
        return sum(len(self.streams(conn)) for conn in list(self.connections)), self.started

    def adopt(self, coordinator: ShutdownCoordinator) -> None:
        """Shutdown was requested: later requests take the middleware; those in flight
        are reported to the coordinator until ``finish`` sees them end."""
        if not self.on:
            return
        self.on = False
        for conn in list(self.connections):
            for stream in self.streams(conn):
                self.started -= 1  # counted by the coordinator from now on
                conn.adopted.append((stream, coordinator.request_started()))

    @staticmethod
    def finish(coordinator: ShutdownCoordinator, conn: _Connection, *, closed: bool) -> None:
        """hypercorn reported ``conn`` (a busy/idle change, or its close): report the
        end of its adopted requests that ended."""
        left = []
        for stream, sampled in conn.adopted:
            if closed or stream.closed:
                coordinator.request_finished(sampled)
            else:
                left.append((stream, sampled))
        conn.adopted = left

    @staticmethod
    def nudge(conn: _Connection, keep_alive_max_requests: int) -> None:
        """An adopted HTTP/1.1 request whose response has not started closes its
        connection after it, with ``Connection: close`` (hypercorn's own limit)."""
        protocol = _protocol(conn)
        if not isinstance(protocol, H11Protocol):
            return
        for stream, _ in conn.adopted:
            if stream.state is ASGIHTTPState.REQUEST and not stream.closed:
                protocol.keep_alive_requests = max(
                    protocol.keep_alive_requests, keep_alive_max_requests
                )

    async def answer_cut(self, timeout_s: float) -> None:
        """The 503 of each adopted request whose response has not started (before the
        cut cancels it; no middleware around it would send it), within ``timeout_s``."""
        answer = [
            stream
            for conn in list(self.connections)
            for stream, _ in conn.adopted
            if stream.state is ASGIHTTPState.REQUEST and not stream.closed
        ]
        with anyio.move_on_after(max(timeout_s, 0.001)):
            for stream in answer:
                if stream.state is ASGIHTTPState.REQUEST and not stream.closed:
                    await self.middleware.cut(stream.scope, stream.app_send)
