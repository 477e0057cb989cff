"""The backend-neutral part of graceful's hypercorn worker: the shape filled in.

``graceful.hypercorn`` does not call ``hypercorn.asyncio.serve``/``hypercorn.trio.serve``:
their connections are local variables of hypercorn's ``worker_serve``, so nothing could
send a GOAWAY, find idle connections or cut a websocket at the coordinator's deadline.
It assembles hypercorn's worker from the parts ``worker_serve`` uses and owns what that
function keeps local.  ``_Worker`` is that worker for either backend: the server shape
(``graceful._core.shape``) filled in for hypercorn's connections
(``graceful.hypercorn._connection``) — idle ones, HTTP/2 GOAWAY, hypercorn's own
shutdown.  ``graceful.hypercorn._asyncio`` and ``graceful.hypercorn._trio`` add the
listeners, the connection tasks and lifespan; ``docs/hypercorn.md`` ("How it is built")
has the whole story, and ``docs/adapters.md`` ("Private names each adapter reads") the
names of hypercorn's and h2's this relies on.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from random import randint
from typing import Any, Final

import anyio
import anyio.abc
import h2.exceptions
from hypercorn.config import Config, Sockets
from hypercorn.events import RawData
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.typing import AppWrapper
from hypercorn.utils import repr_socket_addr
from hyperframe.frame import GoAwayFrame

from .._core.coordinator import ShutdownCoordinator
from .._core.policy import Phase
from .._core.shape import ServerShape
from .._core.signals import QUICK_SIGNALS, catch_signals, held_while_starting
from ..asgi import GracefulMiddleware
from ._connection import _Connection, _TCPServer
from ._hot import HotPath

logger = logging.getLogger("graceful")

#: The signals ``serve`` handles when it is given no ``shutdown_trigger``.
HANDLED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, *QUICK_SIGNALS)

_FLUSH_POLLS: Final = 100  # wait at most this many times 10 ms for END_STREAMs to be flushed


class _Worker(ServerShape):
    """The backend-neutral part: the server shape (``graceful._core.shape``) filled in for
    hypercorn's connections — idle ones, HTTP/2 GOAWAY, hypercorn's own shutdown.

    Subclasses provide the listeners, the connection tasks and lifespan for asyncio
    (and uvloop) or trio.
    """

    _on_trio = False  # the backend: trio, or asyncio

    def __init__(
        self,
        app: AppWrapper | GracefulMiddleware,
        config: Config,
        *,
        coordinator: ShutdownCoordinator,
        sockets: Sockets | None,
        shutdown_trigger: Callable[[], Awaitable[object]] | None,
        quick_signals: tuple[int, ...],
        idle_grace_s: float,
    ) -> None:
        super().__init__(coordinator, idle_grace_s=idle_grace_s)
        self._config = config
        self._c = coordinator
        self._sockets = sockets
        self._trigger = shutdown_trigger
        self._quick_signals = quick_signals
        self._connections: set[_Connection] = set()
        #: The hot path (``graceful.hypercorn._hot``), for an ASGI app behind the middleware.
        self.hot: HotPath | None = None
        if isinstance(app, GracefulMiddleware):
            self.hot = HotPath(app, self._connections, config, trio=self._on_trio)
            try:
                coordinator.add_request_source(self.hot.requests)
            except RuntimeError:  # another server counts for this coordinator
                self.hot.on = False
            if coordinator.shutdown_requested:
                self.hot.on = False
            app = self.hot.app
        self._app: AppWrapper = app
        self._lifespan_state: dict[str, Any] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self.started = False
        #: Shutdown was requested: connections report busy/idle changes (``on_updated``).
        self.watching = False

    # ----------------------------------------------------------- per backend

    async def _start_lifespan(self) -> None:
        raise NotImplementedError

    async def _listen(self, sockets: Sockets) -> None:
        raise NotImplementedError

    async def _cut(self, timeout_s: float) -> None:
        raise NotImplementedError

    @property
    def _context(self) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------- serve

    async def serve(self) -> None:
        with held_while_starting(HANDLED_SIGNALS, wanted=self._trigger is None) as handle_signals:
            await self._start_lifespan()
            self.started = True
            sockets = self._sockets if self._sockets is not None else self._config.create_sockets()
            if sockets.quic_sockets:
                logger.warning("graceful.hypercorn does not serve HTTP/3: QUIC sockets ignored")
            await self._listen(sockets)
            unsubscribe = self._c.subscribe(self.on_phase)
            self._c.add_stopping_step(self.finish)
            if self._c.shutdown_requested and self.hot is not None:
                self.hot.on = False  # requested while starting: nothing ran hot yet
            self.listeners_opened()
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    with contextlib.ExitStack() as stack:
                        if handle_signals:
                            stack.enter_context(catch_signals(HANDLED_SIGNALS, self._on_signal))
                        tg.start_soon(self._watch_max_requests)
                        await tg.start(self._run_coordinator)
                        await self._c.wait_for_phase(Phase.STOPPED)
                    tg.cancel_scope.cancel()
            finally:
                self._tg = None
                unsubscribe()
        if self._c.phase is Phase.STOPPED:
            self._c.exit_soon()

    async def _run_coordinator(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        # Signals reach the coordinator through this worker (quick signals differ per
        # caller), so it gets a trigger in any case and installs no handler itself.
        await self._c.run(shutdown_trigger=self._trigger or _never, task_status=task_status)

    def _on_signal(self, signum: int) -> None:
        self._c.signal_received(signum, quick=self._quick_signals)

    async def _watch_max_requests(self) -> None:
        await self._context.terminate.wait()
        logger.info("max requests reached")
        self._c.request_shutdown("max requests", escalate=False, drain_now=True)

    def _log_running(self, sock: socket.socket, scheme: str) -> Awaitable[None]:
        bind = repr_socket_addr(sock.family, sock.getsockname())
        return self._config.log.info(f"Running on {scheme}://{bind} (CTRL + C to quit)")

    def _max_requests(self) -> int | None:
        if self._config.max_requests is None:
            return None
        return self._config.max_requests + randint(0, self._config.max_requests_jitter)

    # ------------------------------------------------------------ connections

    def _opened(self, server: _TCPServer) -> _Connection:
        c = self._c
        conn = _Connection(server, now=self._now(), during_drain=c.draining)
        server.graceful_connection = conn
        self._connections.add(conn)
        if c.draining:
            self._watch(conn)  # accepted late: the same window for its first request
        return conn

    def _closed(self, conn: _Connection) -> None:
        self._connections.discard(conn)

    def _now(self) -> float:
        """The event loop's clock (also from loop callbacks, where anyio cannot tell)."""
        raise NotImplementedError

    async def on_updated(self, conn: _Connection, idle: bool) -> None:
        """hypercorn reported the connection busy (``idle=False``) or idle (``busy`` is
        already set).

        Runs inside hypercorn's own send path, so whatever may wait (flushing, closing)
        runs in a task of ours instead.
        """
        c = self._c
        if not c.shutdown_requested:
            return
        proto = conn.h2()
        if not idle:
            if proto is None:
                return
            highest = proto.connection.highest_inbound_stream_id
            if highest <= conn.seen_stream:
                return  # a stream closed, others still run
            conn.seen_stream = highest
            if c.accepting:
                c.report_activity()  # a new stream: the client still routes to us
            elif (
                c.draining
                and conn.goaway_last is None
                and len(proto.streams) > 1
                and not proto.closed
            ):
                # Still opening streams while others run: tell it now (raw frame, so the
                # streams in flight finish), it may never be idle.
                await self._send_goaway(conn, proto, last=highest, through_h2=False)
            return
        conn.idle_since = self._now()
        if self._tg is None or c.cutting:
            return
        if c.draining:
            self._tg.start_soon(self._drain_idle, conn)
        elif (
            proto is not None
            and c.nudging
            and not conn.goaway_closed
            and (conn.before_nudge or proto.connection.highest_inbound_stream_id > 0)
        ):
            self._tg.start_soon(self._goaway_when_flushed, conn, proto)

    async def _goaway_when_flushed(self, conn: _Connection, proto: H2Protocol) -> None:
        """GOAWAY through h2 once no stream is open and every END_STREAM went out (h2
        refuses to send anything after its own GOAWAY)."""
        for _ in range(_FLUSH_POLLS):
            if proto.closed or conn.goaway_closed or conn.closing or proto.streams:
                return  # gone, done, or busy again: the next idle moment decides
            if not proto.stream_buffers:
                break
            await anyio.sleep(0.01)
        else:
            return
        last = conn.goaway_last
        if last is None:
            last = proto.connection.highest_inbound_stream_id
        await self._send_goaway(conn, proto, last=last, through_h2=True)

    async def _send_goaway(
        self, conn: _Connection, proto: H2Protocol, *, last: int, through_h2: bool
    ) -> None:
        if through_h2:
            try:
                proto.connection.close_connection(last_stream_id=last)
            except h2.exceptions.ProtocolError:  # h2 closed the connection already
                conn.goaway_closed = True
                return
            conn.goaway_closed = True
            data = proto.connection.data_to_send()
        else:
            data = GoAwayFrame(stream_id=0, last_stream_id=last, error_code=0).serialize()
        conn.goaway_last = last
        logger.debug("HTTP/2 GOAWAY, last stream %d, to %s", last, getattr(proto, "client", None))
        with contextlib.suppress(Exception):  # the connection is gone: nothing to tell
            await conn.server.graceful_send(RawData(data=data))

    async def _drain_idle(self, conn: _Connection) -> None:
        """An idle connection while draining: HTTP/2 gets GOAWAY and is closed; HTTP/1.1
        (and a connection that has not sent anything yet) first gets ``idle_grace_s``."""
        proto = conn.h2()
        if proto is not None and (not conn.during_drain or conn.seen_stream > 0):
            if not conn.goaway_closed:
                await self._goaway_when_flushed(conn, proto)
            if conn.goaway_closed and conn.idle():
                await self._close(conn)
                return
        self._watch(conn)

    def _watch(self, conn: _Connection) -> None:
        if conn.watched or self._tg is None:
            return
        conn.watched = True
        self._tg.start_soon(self._close_when_idle, conn)

    async def _close_when_idle(self, conn: _Connection) -> None:
        try:
            while conn in self._connections and not conn.closing and conn.idle():
                left = conn.idle_since + self.idle_grace_s - self._now()
                if left <= 0:
                    proto = conn.h2()
                    if proto is not None and not conn.goaway_closed:
                        await self._goaway_when_flushed(conn, proto)
                    if conn.idle():
                        await self._close(conn)
                    return
                await anyio.sleep(left)
        finally:
            conn.watched = False

    async def _close(self, conn: _Connection) -> None:
        if conn.closing or conn not in self._connections:
            return
        conn.closing = True
        with contextlib.suppress(Exception):  # already closed by the peer
            await conn.server.graceful_close()

    # ---------------------------------------------- the shape, for hypercorn

    def shutdown_requested(self) -> None:
        self.watching = True
        hot = self.hot
        if hot is not None and hot.adopt(self._c) and self._tg is not None:
            self._tg.start_soon(hot.poll_finished, self._c)
        for conn in self._connections:  # new streams from here on are activity
            proto = conn.h2()
            if proto is not None:
                conn.seen_stream = proto.connection.highest_inbound_stream_id

    def nudge(self) -> None:
        """HTTP/2 connections get GOAWAY once idle (HTTP/1.1 responses are nudged by
        the middleware, and by hypercorn for requests adopted from the hot path); at
        draining ``close_idle`` sees to them instead."""
        for conn in self._connections:
            conn.before_nudge = True
        if self.hot is not None:
            self.hot.nudge()
        tg = self._tg
        if tg is None or self._c.draining:
            return
        for conn in list(self._connections):
            proto = conn.h2()
            if proto is not None and conn.idle():
                tg.start_soon(self._goaway_when_flushed, conn, proto)

    def close_idle(self, grace_s: float) -> None:
        tg = self._tg
        if tg is None:
            return
        now = self._now()
        for conn in list(self._connections):
            if conn.idle():
                conn.idle_since = max(conn.idle_since, now)
                tg.start_soon(self._drain_idle, conn)

    async def cut(self, timeout_s: float) -> None:
        """hypercorn's own shutdown semantics from here — idle connections close at
        once, HTTP/1.1 connections are not recycled, new HTTP/2 streams are refused —
        then what still runs is cut (requests adopted from the hot path whose response
        has not started are answered 503 first)."""
        hot = self.hot
        answer = [] if hot is None else hot.to_answer()
        if hot is not None and answer:
            await hot.answer_cut(answer, timeout_s / 2)
            timeout_s /= 2
        await self._context.terminated.set()
        busy = sum(conn.busy and not conn.closing for conn in self._connections)
        if busy:
            logger.warning("cutting %d busy connection(s)", busy)
        await self._cut(timeout_s)


async def _never() -> None:
    await anyio.sleep_forever()
