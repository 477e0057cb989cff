"""graceful's hypercorn worker on trio: its own accept loop, one nursery for connections.

hypercorn's trio listeners would close with their backlog still in them, so
``_TrioWorker`` accepts on the stdlib sockets itself (``trio.lowlevel.wait_readable``,
then ``accept()`` until the kernel has nothing left): a connection counts in the same
step the kernel handed it over, and at *draining* the backlog is accepted before the
listener closes.  trio is imported only when a ``_TrioWorker`` is created.  The rest is
``_Worker``'s (``graceful.hypercorn._server``).
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import TYPE_CHECKING, Any, Final

import anyio
from hypercorn.config import Sockets
from typing_extensions import final

from .._core.listeners import seal
from ._connection import _Closer, _graceful_tcp_server, _peer
from ._server import _Worker

if TYPE_CHECKING:
    import trio

logger = logging.getLogger("graceful")

_RESOURCE_ERRORS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def _trio_tcp_server() -> type[Any]:
    from hypercorn.trio.tcp_server import TCPServer

    return _graceful_tcp_server(TCPServer)


@final
class _TrioWorker(_Worker):
    """trio: our own accept loop on the stdlib sockets, one nursery for connections."""

    _on_trio = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import trio
        from hypercorn.trio.worker_context import WorkerContext

        self._trio = trio
        self._worker_context = WorkerContext(self._max_requests())
        self._tcp_server = _trio_tcp_server()
        self._listen_sockets: list[tuple[socket.socket, bool]] = []
        self._ssl_context: Any = None
        self._accepting = trio.CancelScope()
        self._connections_scope = trio.CancelScope()
        self._connections_done = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._root: trio.Nursery | None = None
        self._lifespan: Any = None

    @property
    def _context(self) -> Any:
        return self._worker_context

    def _now(self) -> float:
        return float(self._trio.current_time())

    async def serve(self) -> None:
        trio = self._trio
        async with trio.open_nursery() as root:
            self._root = root
            try:
                await super().serve()
            finally:
                self._accepting.cancel()
                self._connections_scope.cancel()
                root.cancel_scope.cancel()

    def _root_nursery(self) -> trio.Nursery:
        assert self._root is not None, "only while serve() runs"
        return self._root

    async def _start_lifespan(self) -> None:
        from hypercorn.trio.lifespan import Lifespan
        from hypercorn.trio.statsd import StatsdLogger

        self._config.set_statsd_logger_class(StatsdLogger)
        self._lifespan = Lifespan(self._app, self._config, self._lifespan_state)
        await self._root_nursery().start(self._lifespan.handle_lifespan)
        await self._lifespan.wait_for_startup()

    async def lifespan_shutdown(self) -> None:
        await self._lifespan.wait_for_shutdown()

    async def _listen(self, sockets: Sockets) -> None:
        if sockets.secure_sockets:
            self._ssl_context = self._config.create_ssl_context()
        for secure, group in ((True, sockets.secure_sockets), (False, sockets.insecure_sockets)):
            for sock in group:
                sock.listen(self._config.backlog)
                sock.setblocking(False)
                self._listen_sockets.append((sock, secure))
                await self._log_running(sock, "https" if secure else "http")
        await self._root_nursery().start(self._run_connections)
        await self._root_nursery().start(self._run_accepting)

    async def _run_connections(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        trio = self._trio
        try:
            with self._connections_scope:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            self._nursery = None
            self._connections_done.set()

    async def _run_accepting(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        trio = self._trio
        with self._accepting:
            async with trio.open_nursery() as nursery:
                for sock, secure in self._listen_sockets:
                    nursery.start_soon(self._accept_loop, sock, secure)
                task_status.started()

    async def _accept_loop(self, sock: socket.socket, secure: bool) -> None:
        trio = self._trio
        while True:
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError:
                return
            if self._accept_ready(sock, secure):
                await trio.sleep(0.1)  # out of descriptors: let some close first

    def _accept_ready(self, sock: socket.socket, secure: bool) -> bool:
        """Accept what the kernel has and start serving it; no checkpoint in between,
        so every accepted socket is counted in the step that accepted it.

        Returns:
            ``True`` if accepting failed for lack of resources.
        """
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                if exc.errno in _RESOURCE_ERRORS:
                    logger.error("accept() failed: %s", exc)
                    return True
                continue  # ECONNABORTED and friends: that connection is gone
            self._c.connection_opened()
            self._start(conn, secure)

    def _start(self, conn: socket.socket, secure: bool) -> None:
        trio = self._trio
        closer = _Closer(self._c)
        if self._nursery is None:  # stopping already: nothing will serve it
            conn.close()
            closer.close()
            return
        stream: Any = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
        if secure:
            stream = trio.SSLStream(
                stream, self._ssl_context, server_side=True, https_compatible=True
            )
        self._nursery.start_soon(self._serve_connection, _CountingStream(stream, closer), closer)

    async def _serve_connection(self, stream: Any, closer: _Closer) -> None:
        server = self._tcp_server(
            self, self._app, self._config, self._worker_context, self._lifespan_state, stream
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
        trio = self._trio
        self._accepting.cancel()
        for sock, secure in self._listen_sockets:
            # The backlog is served, not reset: seal (no new handshake), accept it all,
            # then close (``graceful._core.listeners``).
            seal([sock])
            self._accept_ready(sock, secure)
            trio.lowlevel.notify_closing(sock)
            sock.close()
        self._listen_sockets.clear()

    async def _cut(self, timeout_s: float) -> None:
        self._connections_scope.cancel()
        with self._trio.move_on_after(timeout_s):
            await self._connections_done.wait()


@final
class _CountingStream:
    """A trio stream that reports the end of the connection (the client's end-of-file,
    a broken stream, or our close) to a closer; everything else is the inner stream's
    (``do_handshake`` is missing unless it is TLS, as hypercorn expects)."""

    __slots__ = ("_closer", "_stream", "send_all")

    def __init__(self, stream: Any, closer: _Closer) -> None:
        self._stream = stream
        self._closer = closer
        # The inner stream's own method: no frame of ours, and no ``__getattr__`` (a
        # failed lookup first), for each of a response's sends.
        self.send_all = stream.send_all

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data: bytes | bytearray = await self._stream.receive_some(max_bytes)
        except BaseException:
            self._closer.close()
            raise
        if not data:
            self._closer.close()
        return data

    async def aclose(self) -> None:
        self._closer.close()
        await self._stream.aclose()
