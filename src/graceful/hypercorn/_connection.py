"""One connection of graceful's hypercorn worker, as hypercorn reports it.

The worker finds idle connections without polling: each connection's ``TCPServer``
(asyncio's or trio's) is a subclass, made by ``_graceful_tcp_server``, that overrides
its public ``protocol_send``.  hypercorn's protocols send an ``Updated(idle=…)`` event
through it whenever a connection becomes busy or idle (HTTP/1.1 request start and
keep-alive recycling, every HTTP/2 stream opened or closed); ``_Connection`` keeps what
that says, with the connection's HTTP/2 state.  Closing a connection uses the same
method with hypercorn's own ``Closed`` event, holding the ``TCPServer``'s ``send_lock``
so that no other task of the connection is mid-send when the stream shuts down.
``_Closer`` reports the end of a connection to the coordinator once, whichever way it
ended.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from hypercorn.events import Closed, Event, Updated
from hypercorn.protocol.h2 import H2Protocol
from typing_extensions import final

from .._core.coordinator import ShutdownCoordinator


class _Worker(Protocol):
    """What a connection asks of the worker that handed itself in
    (``graceful.hypercorn._server._Worker``, which uses this module, not the other way
    round)."""

    watching: bool

    async def on_updated(self, conn: _Connection, idle: bool) -> None: ...


@final
class _Connection:
    """What the worker knows about one connection (see the module docs).

    Attributes:
        server: The connection's hypercorn ``TCPServer`` (our subclass).
        busy: A request or stream is in progress (from hypercorn's ``Updated`` events).
        before_nudge: It was open when nudging began, so it may get a GOAWAY before
            it carried a stream.
        during_drain: It was accepted once draining had begun.
        seen_stream: The highest HTTP/2 stream id seen (new streams are activity).
        goaway_last: The last-stream-id of the GOAWAY it was sent, if any.
        goaway_closed: h2's own state machine sent the GOAWAY (no stream after it).
        idle_since: When it last became idle (loop clock).
        watched: A task waits to close it once its idle window is over.
        closing: It is being closed by this module.
    """

    __slots__ = (
        "before_nudge",
        "busy",
        "closing",
        "during_drain",
        "goaway_closed",
        "goaway_last",
        "idle_since",
        "seen_stream",
        "server",
        "watched",
    )

    def __init__(self, server: _TCPServer, *, now: float, during_drain: bool) -> None:
        self.server = server
        self.busy = False
        self.before_nudge = False
        self.during_drain = during_drain
        self.seen_stream = 0
        self.goaway_last: int | None = None
        self.goaway_closed = False
        self.idle_since = now
        self.watched = False
        self.closing = False

    def idle(self) -> bool:
        """No request or stream in progress (HTTP/2: checked on the protocol too)."""
        if self.busy:
            return False
        proto = self.h2()
        return proto is None or not proto.streams

    def h2(self) -> H2Protocol | None:
        """The connection's HTTP/2 protocol, if it speaks HTTP/2 (after an upgrade or
        prior knowledge hypercorn swaps its protocol object, so look it up each time)."""
        wrapper = getattr(self.server, "protocol", None)
        protocol = getattr(wrapper, "protocol", None)
        return protocol if isinstance(protocol, H2Protocol) else None


class _TCPServer(Protocol):
    """What both backends' ``TCPServer`` subclasses add to hypercorn's."""

    graceful_connection: _Connection

    async def graceful_send(self, event: Event) -> None:
        """Send ``event`` through hypercorn's ``protocol_send``, unobserved."""

    async def graceful_close(self) -> None:
        """Close the connection (hypercorn's ``Closed`` event) under the send lock."""


def _graceful_tcp_server(base: type[Any]) -> type[Any]:
    """A subclass of hypercorn's per-connection ``TCPServer`` (asyncio's or trio's: the
    same public ``protocol_send``) that reports busy/idle to the worker."""

    class GracefulTCPServer(base):  # type: ignore[misc]
        graceful_connection: _Connection

        def __init__(self, worker: _Worker, *args: Any) -> None:
            super().__init__(*args)
            self._graceful_worker = worker

        def protocol_send(self, event: Event) -> Awaitable[None]:
            # A plain function returning hypercorn's own send: no coroutine of ours per
            # event, and exact type tests (hypercorn's events derive from an ABC, whose
            # isinstance costs about a thousand instructions; four events a request).
            kind = type(event)
            if kind is Updated:
                conn = self.graceful_connection
                idle: bool = event.idle  # type: ignore[attr-defined]
                conn.busy = not idle  # before anything yields
                if self._graceful_worker.watching:  # only once shutdown was requested
                    return self._graceful_updated(event, idle)
            elif kind is Closed:
                self.graceful_connection.closing = True
            return super().protocol_send(event)  # type: ignore[no-any-return]

        async def _graceful_updated(self, event: Event, idle: bool) -> None:
            await super().protocol_send(event)
            await self._graceful_worker.on_updated(self.graceful_connection, idle)

        async def graceful_send(self, event: Event) -> None:
            await super().protocol_send(event)

        async def graceful_close(self) -> None:
            # Under the send lock: no other task of the connection is mid-send when the
            # stream is shut down (trio raises BusyResourceError in that task otherwise).
            async with self.send_lock:
                await super().protocol_send(Closed())

    GracefulTCPServer.__name__ = GracefulTCPServer.__qualname__ = f"Graceful{base.__name__}"
    return GracefulTCPServer


@final
class _Closer:
    """Reports a connection's close to the coordinator exactly once."""

    __slots__ = ("_coordinator", "closed")

    def __init__(self, coordinator: ShutdownCoordinator) -> None:
        self._coordinator = coordinator
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._coordinator.connection_closed()


def _peer(server: Any) -> object:
    protocol = getattr(server, "protocol", None)
    return getattr(protocol, "client", None)
