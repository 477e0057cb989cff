"""Raw ``asyncio`` servers that follow a ``graceful.ShutdownCoordinator``.

Drop-ins for ``asyncio.start_server`` and ``asyncio.loop.create_server``::

    coordinator = graceful.ShutdownCoordinator()
    server = await graceful.asyncio.start_server(handle, "127.0.0.1", 8000,
                                                 coordinator=coordinator)
    async with server:
        await coordinator.run()        # returns once drained (or at the deadline)

Why the listener is not simply closed
-------------------------------------
Closing a listening socket makes the kernel reset every connection that completed its
handshake but was not yet ``accept()``-ed: those clients sent a request and get
``ECONNRESET``, which is not safe to retry.  When the coordinator ends *accepting*, this
module first accepts everything in the backlog (through a duplicate of the listening
file descriptor, so the socket stays open while the event loop's own reader is removed),
closes the server, accepts once more, and only then closes the last descriptor.  The
accepted sockets are handed to the loop with ``connect_accepted_socket`` and served like
any other connection.  New connections after that are refused (``ECONNREFUSED``), which a
client can always retry.

Why connections are tracked here
--------------------------------
``Server.wait_closed()`` returns at once on Python 3.11, waits for every connection on
3.12.1+, and uvloop differs again; ``close_clients()`` exists only from 3.13.  So this
module tracks transports itself (one wrapper protocol per connection) and never relies on
``wait_closed``: behaviour is the same on every version and loop.

Handlers learn that draining began through ``GracefulServer.draining`` (an
``asyncio.Event``), ``GracefulServer.is_draining``, and
``GracefulServer.unless_draining``, which waits for the next message only while the
server is not draining.  Protocols may define ``drain_requested()``; it is called once
when draining begins.  At *stopping* the remaining transports are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from typing_extensions import Self, final

from ._core.coordinator import ShutdownCoordinator, _check_coordinator
from ._core.engine import _check_callable
from ._core.listeners import CLOSE_BOUND_S, Handovers, close_keeping_backlog, count_accepts
from ._core.policy import Phase

__all__ = ("GracefulServer", "Messages", "create_server", "start_server")

T = TypeVar("T")
logger = logging.getLogger("graceful")

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class _Tracking(asyncio.Protocol):
    """Wraps an application protocol to report the connection's life to the server."""

    def __init__(self, server: GracefulServer, inner: asyncio.BaseProtocol) -> None:
        self._server = server
        self._inner = inner
        self._transport: asyncio.BaseTransport | None = None
        # StreamWriter.start_tls() moves the inner protocol behind an SSL protocol and
        # the transport stops talking to us: hear its close from the inner protocol.
        lost = inner.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            try:
                lost(exc)
            finally:
                server._connection_lost(self)

        self._lost = False
        # A protocol with __slots__ refuses: it has no TLS upgrade to follow.
        with contextlib.suppress(AttributeError):
            inner.connection_lost = connection_lost  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._server._connections.add(self)
        self._server._all_closed.clear()
        self._inner.connection_made(transport)
        if self._server.is_draining:
            self._request_drain()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            self._server._connection_lost(self)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()  # type: ignore[attr-defined, no-any-return]

    def _request_drain(self) -> None:
        drain = getattr(self._inner, "drain_requested", None)
        if drain is not None:
            drain()

    def _close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _abort(self) -> None:
        if self._transport is not None:
            abort = getattr(self._transport, "abort", None)
            (abort or self._transport.close)()


class _TrackingBuffered(_Tracking, asyncio.BufferedProtocol):
    def get_buffer(self, sizehint: int) -> Any:
        return self._inner.get_buffer(sizehint)  # type: ignore[attr-defined]

    def buffer_updated(self, nbytes: int) -> None:
        self._inner.buffer_updated(nbytes)  # type: ignore[attr-defined]


@final
class Messages(AsyncIterator[T]):
    """Per-connection message reader from ``GracefulServer.messages``."""

    __slots__ = ("_first", "_read", "_server")

    def __init__(self, server: GracefulServer, read: Callable[[], Awaitable[T]]) -> None:
        if not isinstance(server, GracefulServer):
            raise TypeError(f"server must be a graceful.asyncio.GracefulServer, got {server!r}")
        self._server = server
        self._read = _check_callable("read", read)
        self._first = True

    def __aiter__(self) -> Messages[T]:
        return self

    async def __anext__(self) -> T:
        first, self._first = self._first, False
        message = await self._server.unless_draining(self._read(), first=first)
        if not message:
            raise StopAsyncIteration
        return message


@final
class GracefulServer:
    """An ``asyncio.Server`` that obeys a coordinator; see the module docs.

    Use it as an async context manager around ``await coordinator.run()``: on exit any
    connection still open is aborted.
    """

    def __init__(
        self,
        coordinator: ShutdownCoordinator,
        protocol_factory: ProtocolFactory,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.coordinator = _check_coordinator(coordinator)
        self._factory = _check_callable("protocol_factory", protocol_factory)
        if not isinstance(loop, asyncio.AbstractEventLoop):
            raise TypeError(f"loop must be an asyncio event loop, got {loop!r}")
        self._loop = loop
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Tracking] = set()
        self._all_closed = asyncio.Event()
        self._all_closed.set()
        #: Set when the server starts draining (the listener is closed).
        self.draining = asyncio.Event()
        self._closing: asyncio.Future[list[asyncio.Task[object]]] | None = None
        self._handovers = Handovers(coordinator)
        self._unsubscribe = coordinator.subscribe(self._on_phase)

    def _wrapped_factory(self) -> _Tracking:
        # The connection counts from here on uvloop, from the accept() on asyncio
        # (see graceful._core.listeners); it is reported closed by connection_lost.
        self._handovers.protocol_created()
        inner = self._factory()
        if isinstance(inner, asyncio.BufferedProtocol):
            return _TrackingBuffered(self, inner)
        return _Tracking(self, inner)

    # ------------------------------------------------------------------ properties

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The listening sockets (empty once the listener is closed)."""
        if self._server is None:
            return ()
        return tuple(self._server.sockets)  # type: ignore[attr-defined]

    @property
    def is_draining(self) -> bool:
        """``True`` once the listener closed; handlers should finish and close."""
        return self.draining.is_set()

    @property
    def connection_count(self) -> int:
        """Connections currently open on this server."""
        return len(self._connections)

    async def unless_draining(self, awaitable: Awaitable[T], *, first: bool = False) -> T | None:
        """Await ``awaitable`` unless (or until) the server is draining.

        Wrap the read of the *next* message in it: an idle keep-alive connection then
        ends when draining begins, while a message already being handled is finished::

            first = True
            while (line := await server.unless_draining(reader.readline(), first=first)):
                first = False
                ...

        Args:
            awaitable: The read of the next message.
            first: This is the connection's first message.  A client that connected has
                sent, or is about to send, its request — connections from the accept
                backlog arrive after draining began — so it is awaited regardless (the
                drain deadline still bounds it).

        Returns:
            The awaitable's result, or ``None`` if draining began first (the awaitable
            is cancelled).
        """
        if first:
            return await awaitable
        if self.is_draining:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            return None
        task: asyncio.Future[T] = asyncio.ensure_future(awaitable)
        drain = asyncio.ensure_future(self.draining.wait())
        try:
            await asyncio.wait((task, drain), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # The handler is cancelled: the read must not outlive it (an orphaned
            # readline() would eat the bytes of a request nobody answers), and must have
            # let go of the reader before we return (a StreamReader serves one waiter).
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait((task,))
            raise
        finally:
            drain.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait((task,))  # raises only if *we* are cancelled meanwhile
        return None

    def messages(self, read: Callable[[], Awaitable[T]]) -> Messages[T]:
        """The messages of one connection, as long as the server is not draining.

        ::

            async def handle(reader, writer):
                async for line in server.messages(reader.readline):
                    ...answer line...

        The first message is always awaited (a connection from the accept backlog
        arrives after draining began and has sent, or is sending, its request); each
        later one only until draining begins.  The iteration ends at end of stream (a
        falsy message: ``b""``) or when draining begins between two messages.
        """
        return Messages(self, read)

    # ------------------------------------------------------------------- lifecycle

    async def _start(self, coro: Coroutine[Any, Any, asyncio.AbstractServer]) -> None:
        self._server = await coro
        count_accepts(self._server, self._handovers)

    def _connection_lost(self, conn: _Tracking) -> None:
        if conn._lost:
            return
        conn._lost = True
        self._connections.discard(conn)
        self.coordinator.connection_closed()
        if not self._connections:
            self._all_closed.set()

    def _on_phase(self, phase: Phase) -> None:
        if phase >= Phase.DRAINING and not self.draining.is_set():
            self._stop_listening()
            self.draining.set()
            for conn in list(self._connections):
                try:
                    conn._request_drain()
                except Exception:
                    logger.exception("drain_requested() of %r failed", conn._inner)
        if phase >= Phase.STOPPING:
            for conn in list(self._connections):
                conn._close()

    def _stop_listening(self) -> None:
        """Close the listener without resetting connections in the accept backlog."""
        server, self._server = self._server, None
        if server is not None:
            self._closing = close_keeping_backlog(
                [server], self._wrapped_factory, self._loop, self._handovers
            )

    async def wait_closed(self, *, timeout_s: float | None = None) -> bool:
        """Wait until every connection of this server is closed.

        Unlike ``asyncio.Server.wait_closed`` this behaves the same on every Python
        version and on uvloop.

        Returns:
            ``True`` if all closed, ``False`` if ``timeout_s`` elapsed first.
        """
        try:
            await asyncio.wait_for(self._all_closed.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Close the listener (keeping the backlog) and abort every open connection."""
        self._stop_listening()
        self.draining.set()
        for conn in list(self._connections):
            conn._abort()
        self._unsubscribe()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        if self._closing is not None:
            await asyncio.wait((self._closing,), timeout=CLOSE_BOUND_S)
        await self.wait_closed(timeout_s=1.0)


async def create_server(
    protocol_factory: ProtocolFactory,
    host: str | None = None,
    port: int | None = None,
    *,
    coordinator: ShutdownCoordinator,
    **kwargs: Any,
) -> GracefulServer:
    """Like ``asyncio.loop.create_server``, following ``coordinator``'s phases.

    Extra keyword arguments go to ``loop.create_server`` unchanged (``sock``,
    ``reuse_port``, ``backlog``, ``ssl``, …).
    """
    loop = asyncio.get_running_loop()
    server = GracefulServer(coordinator, protocol_factory, loop)
    await server._start(loop.create_server(server._wrapped_factory, host, port, **kwargs))
    return server


async def start_server(
    client_connected_cb: Callable[
        [asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None] | None
    ],
    host: str | None = None,
    port: int | None = None,
    *,
    coordinator: ShutdownCoordinator,
    limit: int = 2**16,
    **kwargs: Any,
) -> GracefulServer:
    """Like ``asyncio.start_server``, following ``coordinator``'s phases."""
    _check_callable("client_connected_cb", client_connected_cb)
    loop = asyncio.get_running_loop()

    def factory() -> asyncio.StreamReaderProtocol:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        return asyncio.StreamReaderProtocol(reader, client_connected_cb, loop=loop)

    server = GracefulServer(coordinator, factory, loop)
    await server._start(loop.create_server(server._wrapped_factory, host, port, **kwargs))
    return server
