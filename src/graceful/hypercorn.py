"""hypercorn that follows a ``graceful.ShutdownCoordinator``, on asyncio, uvloop and trio.

::

    import graceful.hypercorn
    from hypercorn.config import Config

    config = Config()
    config.bind = ["0.0.0.0:8000"]
    graceful.hypercorn.run(app, config, policy=graceful.AcceptUntilIdle(idle_s=2))
    # or, in a running loop (asyncio, uvloop or trio):
    await graceful.hypercorn.serve(app, config, coordinator=coordinator)

What changes against stock hypercorn
------------------------------------
Stock hypercorn (0.18), when its ``shutdown_trigger`` fires or a signal arrives, closes its
listeners at once (the accept backlog is reset), sets its ``terminated`` event — idle
keep-alive connections are closed, HTTP/2 connections without GOAWAY, new HTTP/2 streams
are reset — waits ``graceful_timeout`` for the rest and runs lifespan shutdown.  On
asyncio with Python ≥ 3.12.1 it first awaits ``Server.wait_closed()``, which waits for
every connection (pgjones/hypercorn#308): one open websocket keeps the process alive
until SIGKILL.  Here the coordinator decides instead:

* *accepting*: the listeners stay open and every new connection counts as activity;
  HTTP/1.1 responses carry ``Connection: close`` if the policy nudges, and HTTP/2
  connections get a GOAWAY (see below); readiness answers 503;
* *draining*: the listeners close without resetting the backlog (it is accepted and
  served); idle HTTP/1.1 connections get ``idle_grace_s`` to send one more request, idle
  HTTP/2 connections get GOAWAY and are closed; in-flight requests finish; websockets
  get a close frame with code 1001 after the middleware's grace;
* *stopping* (drain deadline, second signal, SIGQUIT): what is left is cancelled — a
  request whose response had not started gets a 503 — and lifespan shutdown runs,
  everything bounded by the coordinator's deadlines on every Python version and event
  loop.  ``Server.wait_closed()`` is never awaited and ``config.graceful_timeout`` is not
  used: the coordinator's drain deadline replaces it.

Which parts of hypercorn, and why not ``hypercorn.asyncio.serve``
-----------------------------------------------------------------
``hypercorn.asyncio.serve(app, config, shutdown_trigger=…)`` is hypercorn's public entry
point, and firing its trigger only when draining begins would keep the listener open
while accepting.  It cannot do the rest: the trigger closes the listeners with the
backlog still in them; the connections and their tasks are local variables of
``worker_serve``, so nothing can send a GOAWAY, count a connection on uvloop or trio, or
cut a websocket at our deadline (the #308 hang is inside ``serve``); and
``hypercorn.trio.serve`` without a trigger installs no signal handler at all.  So this
module assembles hypercorn's worker from the same parts
``worker_serve`` uses — ``hypercorn.asyncio.tcp_server.TCPServer`` /
``hypercorn.trio.tcp_server.TCPServer`` (one per connection), ``WorkerContext``,
``Lifespan``, ``hypercorn.utils.wrap_app``/``load_application`` and the public
``Config`` (``create_sockets``, ``create_ssl_context``, ``log``) — and owns what
``worker_serve`` keeps local: the listeners, the connection tasks and lifespan's order.
These are public names of hypercorn's modules, not underscored internals, but they are
not documented API either, which is why the extra pins ``hypercorn>=0.17,<0.19``.
Three narrower reaches, each needed for one behaviour:

* **Connection state** — each connection's ``TCPServer`` is a subclass that overrides
  its public ``protocol_send``: hypercorn's protocols send an ``Updated(idle=…)`` event
  through it whenever a connection becomes busy or idle (HTTP/1.1 request start and
  keep-alive recycling, every HTTP/2 stream opened or closed).  That is how idle
  connections are found at draining without polling.  Closing one uses the same method
  with hypercorn's own ``Closed`` event, holding the ``TCPServer``'s ``send_lock`` so
  that no other task of the connection is mid-send when the stream shuts down (on trio
  that task would otherwise get ``BusyResourceError``).  A connection whose task fails
  anyway is logged and ends alone: on trio an exception would otherwise cancel every
  other connection of the nursery.
* **HTTP/2** — the ``H2Protocol`` behind a connection (``tcp_server.protocol.protocol``)
  and its public ``connection`` (the ``h2`` state machine), ``streams`` and
  ``stream_buffers``.
* **Listening sockets** (asyncio) — ``graceful._listeners`` counts accepts on
  ``asyncio.Server``'s socket list and removes the loop's reader before closing; see
  its essay.  On trio this module runs its own accept loop on the stdlib sockets
  (``trio.lowlevel.wait_readable`` then ``accept()``), so a connection counts in the
  same step the kernel handed it over and the backlog is accepted before the close.

HTTP/2: GOAWAY when the connection has no response in flight
------------------------------------------------------------
HTTP/2 has no ``Connection: close``; GOAWAY with a last-stream-id tells the client which
streams were accepted and that new ones must go to a new connection.  By RFC 9113 the
streams up to that id still complete.  Two library facts shape when it is sent:

* ``h2``'s state machine closes the connection when *it* sends GOAWAY
  (python-hyper/h2#1181), so a GOAWAY sent through it while a response is in flight
  loses the rest of that response.  A GOAWAY sent as a raw frame leaves h2 open and the
  response finishes — for the server.
* A client built on ``h2`` — httpx/httpcore among them — has the same state machine on
  its side: after it reads a GOAWAY every further frame is a protocol error, so a
  response still in flight fails there (tried: httpx raises ``RemoteProtocolError``).

So while *accepting* (the nudge) a connection gets its GOAWAY at the first moment it has
no stream in flight and every END_STREAM is flushed: right away if it is idle, else just
after its last response — the HTTP/2 counterpart of ``Connection: close`` on the last
response.  It goes through h2 (``close_connection``), so its last-stream-id is the
highest stream accepted, and a stream the client sent before reading it makes h2 fail
and hypercorn close the connection without running it: the client, which read the
GOAWAY first, retries it elsewhere.  Connections opened while nudging get theirs after
their first stream, so a client is never sent away before it was served.  While
*draining* the same holds, but a client that still opens new streams on a connection
that is busy with others gets a raw GOAWAY at once (last-stream-id: the stream just
opened), so a multiplexing client that is never idle still moves; its in-flight streams
finish (for clients that implement RFC 9113's graceful GOAWAY).  Idle HTTP/2 connections
are closed right after their GOAWAY once draining.  New streams on an existing
connection restart *accept until idle*'s window like new connections do: a proxy that
multiplexes requests over a pooled connection is still routing to this backend.

Once h2 sent its GOAWAY, any frame from the client — also a ``WINDOW_UPDATE`` or ``PING``
it sent before reading the GOAWAY — is a protocol error to h2, which answers with a
second GOAWAY (``PROTOCOL_ERROR``, the same last-stream-id) before hypercorn closes the
connection.  It only happens to connections with no stream in flight, so nothing is
lost; a raw GOAWAY would avoid it, but would let a stream that crossed it run.

Signals
-------
Without a ``shutdown_trigger``, SIGTERM and SIGINT request shutdown (a second one
escalates), SIGQUIT stops at once; handlers are installed with
``graceful._signals.catch_signals`` (``signal.signal``, previous handlers restored),
and signals that arrive before the listeners are up are kept until they are.  With a
``shutdown_trigger`` (hypercorn's convention) no handler is installed and the trigger
starts the shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import functools
import logging
import signal
import socket
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from random import randint
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, cast

import anyio
import anyio.abc
import h2.exceptions
from hypercorn.config import Config, Sockets
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.typing import AppWrapper, ASGIReceiveCallable, ASGISendCallable, Scope
from hypercorn.utils import load_application, repr_socket_addr
from hypercorn.utils import wrap_app as hypercorn_wrap_app
from hyperframe.frame import GoAwayFrame
from typing_extensions import final

from . import _logging
from ._coordinator import ShutdownCoordinator
from ._listeners import Handovers, close_keeping_backlog, count_accepts
from ._policy import Phase, Policy, _check_seconds
from ._shape import ServerShape
from ._signals import QUICK_SIGNALS, catch_signals, defer_signals, take_deferred, teardown_guard
from .asgi import GracefulMiddleware

if TYPE_CHECKING:
    import trio

__all__ = ("run", "serve")

logger = logging.getLogger("graceful")

#: The signals ``serve`` handles when it is given no ``shutdown_trigger``.
HANDLED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, *QUICK_SIGNALS)

WorkerClass = Literal["asyncio", "uvloop", "trio"]
WORKER_CLASSES: Final = ("asyncio", "uvloop", "trio")

_STREAM_LIMIT: Final = 2**16  # hypercorn's MAX_RECV
_FLUSH_POLLS: Final = 100  # wait at most this many times 10 ms for END_STREAMs to be flushed


# ------------------------------------------------------------------------ the app


@final
class _GracefulApp:
    """hypercorn's app wrapper (ASGI or WSGI) behind ``GracefulMiddleware``.

    hypercorn calls apps with two extra arguments (``sync_spawn``, ``call_soon``) that
    differ per connection; the middleware speaks plain ASGI.  The extras travel through
    a context variable set for the duration of the call, so WSGI apps (whose wrapper
    needs them) are tracked like ASGI ones.
    """

    __slots__ = ("_extras", "_inner", "_middleware")

    def __init__(self, inner: AppWrapper, middleware: Callable[[Any], GracefulMiddleware]) -> None:
        self._inner = inner
        self._extras: contextvars.ContextVar[tuple[Callable[..., Any], Callable[..., Any]]] = (
            contextvars.ContextVar("graceful_hypercorn_extras")
        )
        self._middleware = middleware(self._call_inner)

    async def _call_inner(self, scope: Any, receive: Any, send: Any) -> None:
        sync_spawn, call_soon = self._extras.get()
        await self._inner(scope, receive, send, sync_spawn, call_soon)

    async def __call__(
        self,
        scope: Scope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        sync_spawn: Callable[..., Any],
        call_soon: Callable[..., Any],
    ) -> None:
        token = self._extras.set((sync_spawn, call_soon))
        try:
            await self._middleware(cast(Any, scope), cast(Any, receive), cast(Any, send))
        finally:
            self._extras.reset(token)


# --------------------------------------------------------------- one connection


@final
class _Connection:
    """What this module knows about one connection (see the module docs).

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


# ------------------------------------------------------------------- the worker


class _Worker(ServerShape):
    """The backend-neutral part: the server shape (``graceful._shape``) filled in for
    hypercorn's connections — idle ones, HTTP/2 GOAWAY, hypercorn's own shutdown.

    Subclasses provide the listeners, the connection tasks and lifespan for asyncio
    (and uvloop) or trio.
    """

    def __init__(
        self,
        app: AppWrapper,
        config: Config,
        *,
        coordinator: ShutdownCoordinator,
        sockets: Sockets | None,
        shutdown_trigger: Callable[[], Awaitable[object]] | None,
        quick_signals: tuple[int, ...],
        idle_grace_s: float,
    ) -> None:
        super().__init__(coordinator, idle_grace_s=idle_grace_s)
        self._app = app
        self._config = config
        self._c = coordinator
        self._sockets = sockets
        self._trigger = shutdown_trigger
        self._quick_signals = quick_signals
        self._connections: set[_Connection] = set()
        self._lifespan_state: dict[str, Any] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self.started = False

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
        with self._capture_signals() as handle_signals:
            await self._start_lifespan()
            self.started = True
            sockets = self._sockets if self._sockets is not None else self._config.create_sockets()
            if sockets.quic_sockets:
                logger.warning("graceful.hypercorn does not serve HTTP/3: QUIC sockets ignored")
            await self._listen(sockets)
            unsubscribe = self._c.subscribe(self.on_phase)
            self._c.add_stopping_step(self.finish)
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

    @contextlib.contextmanager
    def _capture_signals(self) -> Iterator[bool]:
        """Keep SIGINT/SIGTERM/SIGQUIT for later while starting (lifespan, binding);
        ``serve`` delivers them once listening.  Restores the handlers found."""
        if self._trigger is not None or threading.current_thread() is not threading.main_thread():
            yield False
            return
        previous = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
        defer_signals(HANDLED_SIGNALS)
        try:
            yield True
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            for signum in take_deferred(HANDLED_SIGNALS):
                signal.raise_signal(signum)

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
        for conn in self._connections:  # new streams from here on are activity
            proto = conn.h2()
            if proto is not None:
                conn.seen_stream = proto.connection.highest_inbound_stream_id

    def nudge(self) -> None:
        """HTTP/2 connections get GOAWAY once idle (HTTP/1.1 responses are nudged by
        the middleware); at draining ``close_idle`` sees to them instead."""
        for conn in self._connections:
            conn.before_nudge = True
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
        then what still runs is cut."""
        await self._context.terminated.set()
        busy = sum(conn.busy and not conn.closing for conn in self._connections)
        if busy:
            logger.warning("cutting %d busy connection(s)", busy)
        await self._cut(timeout_s)


# ------------------------------------------------------------------- asyncio


def _graceful_tcp_server(base: type[Any]) -> type[Any]:
    """A subclass of hypercorn's per-connection ``TCPServer`` (asyncio's or trio's: the
    same public ``protocol_send``) that reports busy/idle to the worker."""

    class GracefulTCPServer(base):  # type: ignore[misc]
        graceful_connection: _Connection

        def __init__(self, worker: _Worker, *args: Any) -> None:
            super().__init__(*args)
            self._graceful_worker = worker

        async def protocol_send(self, event: Event) -> None:
            if isinstance(event, Updated):
                self.graceful_connection.busy = not event.idle  # before anything yields
            elif isinstance(event, Closed):
                self.graceful_connection.closing = True
            await super().protocol_send(event)
            if isinstance(event, Updated):
                await self._graceful_worker.on_updated(self.graceful_connection, event.idle)

        async def graceful_send(self, event: Event) -> None:
            await super().protocol_send(event)

        async def graceful_close(self) -> None:
            # Under the send lock: no other task of the connection is mid-send when the
            # stream is shut down (trio raises BusyResourceError in that task otherwise).
            async with self.send_lock:
                await super().protocol_send(Closed())

    GracefulTCPServer.__name__ = GracefulTCPServer.__qualname__ = f"Graceful{base.__name__}"
    return GracefulTCPServer


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


# ---------------------------------------------------------------------- trio


def _trio_tcp_server() -> type[Any]:
    from hypercorn.trio.tcp_server import TCPServer

    return _graceful_tcp_server(TCPServer)


@final
class _TrioWorker(_Worker):
    """trio: our own accept loop on the stdlib sockets, one nursery for connections."""

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
            # The backlog is served, not reset: accept it all, then close.
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

    __slots__ = ("_closer", "_stream")

    def __init__(self, stream: Any, closer: _Closer) -> None:
        self._stream = stream
        self._closer = closer

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


_RESOURCE_ERRORS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def _peer(server: Any) -> object:
    protocol = getattr(server, "protocol", None)
    return getattr(protocol, "client", None)


async def _never() -> None:
    await anyio.sleep_forever()


# --------------------------------------------------------------------- public


def _current_backend() -> str:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return "trio"
    raise RuntimeError("graceful.hypercorn.serve() needs a running asyncio or trio event loop")


def _app_wrapper(
    app: Any,
    config: Config,
    coordinator: ShutdownCoordinator,
    *,
    wrap_app: bool,
    mode: Literal["asgi", "wsgi"] | None,
    middleware_options: dict[str, Any],
) -> AppWrapper:
    if isinstance(app, str):
        inner = load_application(app, config.wsgi_max_body_size)
    else:
        inner = hypercorn_wrap_app(app, config.wsgi_max_body_size, mode)
    if not wrap_app:
        return inner
    return _GracefulApp(
        inner,
        lambda asgi: GracefulMiddleware(asgi, coordinator=coordinator, **middleware_options),
    )


async def serve(
    app: Any,
    config: Config,
    *,
    coordinator: ShutdownCoordinator | None = None,
    wrap_app: bool = True,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    sockets: Sockets | None = None,
    mode: Literal["asgi", "wsgi"] | None = None,
    quick_signals: tuple[int, ...] = QUICK_SIGNALS,
    idle_grace_s: float = 1.0,
    **middleware_options: Any,
) -> None:
    """Serve ``app`` with hypercorn in the running event loop until the coordinator stops.

    Runs on whatever loop is running: asyncio (uvloop too) or trio.

    Args:
        app: An ASGI or WSGI app, or hypercorn's ``"module:app"`` path.
        config: The hypercorn configuration (``bind``, TLS, timeouts, logging).
            ``graceful_timeout`` and ``workers`` are not used: the coordinator's
            deadlines bound the drain, and this serves one process.
        coordinator: The process's coordinator (a new one with the default policy if
            omitted).  Its ``graceful.ShutdownCoordinator.run`` is run here.
        wrap_app: Wrap the app in ``graceful.asgi.GracefulMiddleware``.  Pass
            ``False`` if you added it yourself (with the same coordinator).
        shutdown_trigger: hypercorn's convention: when the awaitable it returns
            completes, shutdown is requested.  Without one, SIGTERM and SIGINT request
            shutdown (a second one escalates) and SIGQUIT stops at once.
        sockets: Listening sockets to serve instead of those ``config`` binds (a
            supervisor's, gunicorn's).
        mode: ``"asgi"`` or ``"wsgi"`` when hypercorn cannot tell.
        quick_signals: Signals that stop at once instead of starting the policy
            (gunicorn workers add SIGINT, its quick shutdown).
        idle_grace_s: When draining begins, how long an HTTP/1.1 connection with no
            request in progress may still send one (it is answered with
            ``Connection: close``); connections accepted later get the same window.
        middleware_options: Keyword arguments for the middleware (health paths,
            ``websocket_close_grace_s``).

    graceful's own lines go through hypercorn's error log (its format, at its
    ``loglevel``) unless the application configured logging.

    Raises:
        RuntimeError: outside an asyncio or trio event loop.
    """
    if coordinator is None:
        coordinator = ShutdownCoordinator()
    _logging.through("hypercorn.error", _logging.level_of(str(config.loglevel or "info").lower()))
    idle_grace_s = _check_seconds("idle_grace_s", idle_grace_s)
    wrapper = _app_wrapper(
        app,
        config,
        coordinator,
        wrap_app=wrap_app,
        mode=mode,
        middleware_options=middleware_options,
    )
    worker_type = _AsyncioWorker if _current_backend() == "asyncio" else _TrioWorker
    worker = worker_type(
        wrapper,
        config,
        coordinator=coordinator,
        sockets=sockets,
        shutdown_trigger=shutdown_trigger,
        quick_signals=quick_signals,
        idle_grace_s=idle_grace_s,
    )
    await worker.serve()


def run(
    app: Any,
    config: Config | None = None,
    *,
    worker_class: WorkerClass | None = None,
    coordinator: ShutdownCoordinator | None = None,
    policy: Policy | None = None,
    **kwargs: Any,
) -> None:
    """Run ``serve`` in a new event loop (like ``hypercorn``'s command, one process).

    Args:
        app: An ASGI or WSGI app, or ``"module:app"``.
        config: The hypercorn configuration (default: ``Config()``, port 8000).
        worker_class: ``"asyncio"``, ``"uvloop"`` or ``"trio"`` (default:
            ``config.worker_class``).
        coordinator: The coordinator (default: a new one with ``policy``).
        policy: The shutdown policy of a new coordinator.
        kwargs: Passed to ``serve``.
    """
    if coordinator is not None and policy is not None:
        raise ValueError("pass either coordinator= or policy=, not both")
    if config is None:
        config = Config()
    if coordinator is None:
        coordinator = ShutdownCoordinator(policy=policy)
    worker = worker_class if worker_class is not None else config.worker_class
    if worker not in WORKER_CLASSES:
        raise ValueError(f"worker_class must be one of {', '.join(WORKER_CLASSES)}, got {worker!r}")
    main = functools.partial(serve, app, config, coordinator=coordinator, **kwargs)
    # A signal during the teardown after the shutdown (the kubelet's SIGTERM right after
    # a preStop drain) is logged, not left to kill the process (status 143).
    with teardown_guard(lambda: coordinator.shutdown_requested):
        if worker == "trio":
            anyio.run(main, backend="trio")
        else:
            anyio.run(main, backend="asyncio", backend_options={"use_uvloop": worker == "uvloop"})
