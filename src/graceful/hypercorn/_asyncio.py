"""graceful's hypercorn worker on asyncio and uvloop: the listeners and connection tasks.

``_AsyncioWorker`` serves each listening socket with ``loop.create_server`` and one
stream protocol per connection, as hypercorn does, so that the listeners can close at
*draining* keeping their backlog (``graceful._core.listeners`` counts accepts on
``asyncio.Server``'s sockets and hands the backlog over) and so that a connection is
counted from the kernel's hand-over to its end.  The rest is ``_Worker``'s
(``graceful.hypercorn._server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import weakref
from typing import Any, Final

from hypercorn.config import Sockets
from typing_extensions import final

from .._core.listeners import Handovers, close_keeping_backlog, count_accepts
from ._connection import _Closer, _graceful_tcp_server, _peer
from ._server import _Worker

logger = logging.getLogger("graceful")

_STREAM_LIMIT: Final = 2**16  # hypercorn's MAX_RECV


def _asyncio_tcp_server() -> type[Any]:
    from hypercorn.asyncio.tcp_server import TCPServer

    return _graceful_tcp_server(TCPServer)


@final
class _AsyncioWorker(_Worker):
    """asyncio and uvloop: ``loop.create_server`` with a stream protocol per connection."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from hypercorn.asyncio.worker_context import WorkerContext

        self._loop = asyncio.get_running_loop()
        self._worker_context = WorkerContext(self._max_requests())
        self._tcp_server = _asyncio_tcp_server()
        self._handovers = Handovers(self._c)
        self._servers: list[asyncio.AbstractServer] = []
        self._tls_servers: list[asyncio.AbstractServer] = []
        self._ssl_context: Any = None
        self._closing: asyncio.Future[Any] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lifespan: Any = None
        self._lifespan_task: asyncio.Task[None] | None = None

    @property
    def _context(self) -> Any:
        return self._worker_context

    def _now(self) -> float:
        return self._loop.time()

    async def serve(self) -> None:
        try:
            await super().serve()
        finally:
            for task in self._tasks:
                task.cancel()
            if self._lifespan_task is not None and not self._lifespan_task.done():
                self._lifespan_task.cancel()
                with contextlib.suppress(BaseException):
                    await self._lifespan_task

    async def _start_lifespan(self) -> None:
        from hypercorn.asyncio.lifespan import Lifespan
        from hypercorn.asyncio.statsd import StatsdLogger

        self._config.set_statsd_logger_class(StatsdLogger)
        self._lifespan = Lifespan(self._app, self._config, self._loop, self._lifespan_state)
        self._lifespan_task = self._loop.create_task(self._lifespan.handle_lifespan())
        await self._lifespan.wait_for_startup()
        if self._lifespan_task.done():
            exception = self._lifespan_task.exception()
            if exception is not None:
                raise exception

    async def lifespan_shutdown(self) -> None:
        await self._lifespan.wait_for_shutdown()

    async def _listen(self, sockets: Sockets) -> None:
        ssl_context = self._config.create_ssl_context() if sockets.secure_sockets else None
        self._ssl_context = ssl_context
        for secure, group in ((True, sockets.secure_sockets), (False, sockets.insecure_sockets)):
            for sock in group:
                server = await self._loop.create_server(
                    self._protocol_factory,
                    sock=sock,
                    backlog=self._config.backlog,
                    ssl=ssl_context if secure else None,
                    ssl_handshake_timeout=self._config.ssl_handshake_timeout if secure else None,
                )
                count_accepts(server, self._handovers)
                (self._tls_servers if secure else self._servers).append(server)
                await self._log_running(sock, "https" if secure else "http")

    def _protocol_factory(self) -> asyncio.StreamReaderProtocol:
        """One stream protocol per connection, counted from its hand-over.

        Its close is reported at the client's end-of-file or the transport's close,
        whichever comes first (hypercorn's connection task lingers up to
        ``keep_alive_timeout`` after the client left).  A connection whose TLS handshake
        fails reaches neither, so its close is also reported when the protocol object
        is collected.
        """
        self._handovers.protocol_created()
        closer = _Closer(self._c)
        reader = asyncio.StreamReader(limit=_STREAM_LIMIT, loop=self._loop)
        protocol = _StreamProtocol(
            closer, reader, functools.partial(self._connected, closer), loop=self._loop
        )
        weakref.finalize(protocol, closer.close)
        return protocol

    def _connected(
        self, closer: _Closer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = self._loop.create_task(self._serve_connection(closer, reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_connection(
        self, closer: _Closer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        server = self._tcp_server(
            self,
            self._app,
            self._loop,
            self._config,
            self._worker_context,
            self._lifespan_state,
            reader,
            writer,
        )
        conn = self._opened(server)
        try:
            await server.run()
        except Exception:  # one connection's failure must not end the others
            logger.exception("connection from %s failed", _peer(server))
        finally:
            self._closed(conn)
            closer.close()

    def close_listeners(self) -> None:
        closing = [
            close_keeping_backlog(
                self._servers, self._protocol_factory, self._loop, self._handovers
            )
        ]
        if self._tls_servers:  # their backlog does its TLS handshake like the others
            closing.append(
                close_keeping_backlog(
                    self._tls_servers,
                    self._protocol_factory,
                    self._loop,
                    self._handovers,
                    ssl=self._ssl_context,
                )
            )
        self._closing = asyncio.gather(*closing)

    async def listeners_closed(self, timeout_s: float) -> None:
        if self._closing is not None and timeout_s > 0:
            await asyncio.wait((self._closing,), timeout=timeout_s)

    async def _cut(self, timeout_s: float) -> None:
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel(msg="graceful: stopping")
        if tasks and timeout_s > 0:
            await asyncio.wait(tasks, timeout=timeout_s)


class _StreamProtocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, reporting the end of the connection to a closer."""

    def __init__(self, closer: _Closer, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._graceful_closer = closer

    def eof_received(self) -> bool:
        self._graceful_closer.close()
        return bool(super().eof_received())

    def connection_lost(self, exc: Exception | None) -> None:
        self._graceful_closer.close()
        super().connection_lost(exc)
