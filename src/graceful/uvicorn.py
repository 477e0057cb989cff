"""uvicorn that follows a ``graceful.ShutdownCoordinator``.

::

    import graceful.uvicorn
    graceful.uvicorn.run("myapp:app", host="0.0.0.0", port=8000,
                         policy=graceful.AcceptUntilIdle(idle_s=2))

or, with a config of your own, ``await graceful.uvicorn.Server(config).serve()``.

What changes against stock uvicorn
----------------------------------
Stock uvicorn, at SIGTERM, closes its listener at once (connections in the accept backlog
are reset), closes idle keep-alive connections, waits for the rest and then runs lifespan
shutdown.  ``Server`` instead hands the signal to the coordinator and follows its
phases:

* *accepting*: the listener stays open, new connections count as activity, responses
  carry ``Connection: close`` if the policy nudges, readiness answers 503;
* *draining*: the listener is closed without resetting the backlog, idle keep-alive
  connections are closed, in-flight requests finish (with ``Connection: close``),
  websockets get a close frame with code 1001 after a grace period;
* *stopping* (drain deadline, second signal, SIGQUIT): requests still running are
  cancelled — a client whose response had not started gets a 503 with
  ``Connection: close``, one mid-body gets its connection closed — then lifespan shutdown
  runs (bounded by the kill deadline) and the server exits.

It uses uvicorn's public and de-facto-public surface only: ``Config(http=…)`` (tracking
subclasses of the configured protocol classes), ``Server.handle_exit``,
``capture_signals``, ``main_loop``/``on_tick``, ``shutdown``, ``servers``,
``server_state``; no uvicorn module is patched.  Works with ``http="h11"``,
``"httptools"`` and ``"auto"``, and with uvloop.

The hot path
------------
With uvicorn's ``httptools`` protocol (what ``uvicorn[standard]`` picks), a request
served while nothing shuts down does not go through the middleware at all: the protocol
class hands it straight to the app with the ``graceful.asgi.DrainSignal`` in its
scope, and counts it in one integer (the coordinator reads uvicorn's connections for the
requests in flight: ``graceful.ShutdownCoordinator.add_request_source``).  At the
shutdown request the server *adopts* the requests in flight — each is reported to the
coordinator from then on and its task's end reports its end — and every request that
starts later takes the middleware's full path (counted, timed, nudged).  When nudging
begins, every request whose response has not started gets uvicorn's own ``keep_alive =
False`` (httptools then writes ``Connection: close`` and closes after the response).  A
request adopted this way and cut at stopping gets the middleware's 503, sent by the
server before the cancellation.  Health, metrics and preStop paths, websockets and
lifespan always go to the middleware.  With ``h11``, which writes no ``Connection:
close`` for ``keep_alive = False``, every request takes the middleware's path.

The hand-over is uvicorn's ``_start_asgi_task``, replaced on graceful's protocol class
while nothing shuts down (and removed from it at the shutdown request).  Where uvicorn's
method is the one of 0.50 to 0.54 — a test tells when an installed uvicorn changes it —
its three lines (start the task, hold it in the server's task set) are inlined rather
than called; with ``--reset-contextvars`` or another uvicorn it is called.  The protocol
subclasses add no attribute to their instances (see ``_tracking_class``).

Signals: SIGTERM and SIGINT request shutdown (a second one escalates, a third exits at
once), SIGQUIT stops at once.  uvicorn re-raises captured signals after shutdown so that
the default action runs; this server does not, so the process exits 0 after a graceful
shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import signal
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import uvicorn
from typing_extensions import final

from . import _logging
from ._coordinator import ShutdownCoordinator
from ._listeners import Handovers, close_keeping_backlog, count_accepts
from ._policy import Phase, Policy, _check_seconds
from ._signals import QUICK_SIGNALS, catch_signals, teardown_guard
from .asgi import ASGIApp, GracefulMiddleware

__all__ = ("Server", "run", "serve")

logger = logging.getLogger("graceful")

#: uvicorn's httptools cycle writes ``Connection: close`` for ``keep_alive = False``
#: from 0.53 on.
_KEEP_ALIVE_WRITES_CLOSE = tuple(int(p) for p in uvicorn.__version__.split(".")[:2]) >= (0, 53)
_CLOSE_HEADER = (b"connection", b"close")

#: The signals this server handles (uvicorn's SIGINT and SIGTERM, plus SIGQUIT).
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, *QUICK_SIGNALS)


def _tracking_class(base: type[Any], server: Server, *, counts: bool) -> type[Any]:
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
    if counts and server._fastpath.on:
        server._fastpath.install(Tracking, base, server)
    return Tracking


class _CutRequestFilter(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" traceback for a request we cut.

    A request cancelled at stopping re-raises its cancellation (so that enclosing scopes
    see it) and uvicorn logs that as an application error; the middleware already logged
    one warning for it and the client got its 503.
    """

    def __init__(self, coordinator: ShutdownCoordinator) -> None:
        super().__init__()
        self._coordinator = coordinator

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            self._coordinator.cutting
            and isinstance(exc, asyncio.CancelledError)
            and record.getMessage().startswith("Exception in ASGI application")
        )


def _is_httptools(protocol_class: type[Any]) -> bool:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is not installed
        return False
    return issubclass(protocol_class, HttpToolsProtocol)


@final
class Server(uvicorn.Server):
    """A ``uvicorn.Server`` whose shutdown follows a coordinator's policy.

    Args:
        config: The uvicorn configuration.
        coordinator: The process's coordinator (a new one with the default policy if
            omitted).
        wrap_app: Wrap the app in ``graceful.asgi.GracefulMiddleware``.  Pass
            ``False`` if you added it yourself (with the same coordinator).
        quick_signals: Signals that stop at once instead of starting the policy
            (gunicorn workers add SIGINT, its "quick shutdown").
        idle_grace_s: When draining begins, how long a connection with no request in
            progress (idle keep-alive, or accepted but not yet sent its request) may
            still send one; it is answered with ``Connection: close``.  Connections
            accepted later get the same window from their arrival.
        middleware_options: Keyword arguments for the middleware (health paths,
            ``websocket_close_grace_s``).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        coordinator: ShutdownCoordinator | None = None,
        wrap_app: bool = True,
        quick_signals: tuple[int, ...] = QUICK_SIGNALS,
        idle_grace_s: float = 1.0,
        **middleware_options: Any,
    ) -> None:
        super().__init__(config)
        self._quick_signals = quick_signals
        self.coordinator = coordinator if coordinator is not None else ShutdownCoordinator()
        self.idle_grace_s = _check_seconds("idle_grace_s", idle_grace_s)
        self._wrap_app = wrap_app
        self._middleware_options = middleware_options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Future[None] | None = None  # main_loop's tick, while it sleeps
        self._transports: set[asyncio.BaseTransport] = set()
        self._handovers = Handovers(self.coordinator)
        self._http_class: type[Any] | None = None
        self._listening = True
        self._closing: asyncio.Future[Any] | None = None
        self._signals_captured = False
        self._fastpath = _FastPath()
        self._nudged = False
        self.coordinator.subscribe(self._on_phase)

    # -------------------------------------------------------------- setting up

    def _prepare(self) -> None:
        config = self.config
        if not config.loaded:
            config.load()
        if self._wrap_app:
            middleware = GracefulMiddleware(
                config.loaded_app, coordinator=self.coordinator, **self._middleware_options
            )
            config.loaded_app = middleware
            c = self.coordinator
            protocol = config.http_protocol_class
            if (
                _is_httptools(protocol)
                and hasattr(protocol, "_start_asgi_task")  # uvicorn 0.50 to 0.54 have it
                and not c.shutdown_requested
            ):
                self._fastpath.prepare(middleware)
                c.add_request_source(self._fast_requests)
        self._http_class = _tracking_class(config.http_protocol_class, self, counts=True)
        config.http_protocol_class = self._http_class
        if config.ws_protocol_class is not None:
            config.ws_protocol_class = _tracking_class(config.ws_protocol_class, self, counts=False)

    async def serve(self, sockets: list[Any] | None = None) -> None:
        """Serve until the coordinator stops (see ``uvicorn.Server.serve``).

        graceful's own lines go through uvicorn's log handlers (its format and colours,
        at its log level) unless the application configured logging.
        """
        self._loop = asyncio.get_running_loop()
        _logging.through("uvicorn")
        # Signals first: a SIGTERM while the app is imported or its lifespan starts begins
        # the shutdown instead of killing the process. super().serve() nests
        # capture_signals.
        with self.capture_signals():
            self._prepare()
            self.coordinator.add_stopping_step(self._finish)
            # Signals reach the coordinator through this server, so give it a trigger
            # that never fires: it must not install handlers of its own.
            task = asyncio.ensure_future(self.coordinator.run(shutdown_trigger=_never))
            cut_filter = _CutRequestFilter(self.coordinator)
            uvicorn_errors = logging.getLogger("uvicorn.error")
            uvicorn_errors.addFilter(cut_filter)
            try:
                await super().serve(sockets)
            finally:
                uvicorn_errors.removeFilter(cut_filter)
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.coordinator.phase is Phase.STOPPED:
            self.coordinator.exit_soon()

    async def startup(self, sockets: list[Any] | None = None) -> None:
        """uvicorn's startup, then: count accepts, and close the listener at once if
        draining began while the app was starting (a SIGTERM during lifespan startup)."""
        await super().startup(sockets=sockets)
        for server in getattr(self, "servers", []):
            count_accepts(server, self._handovers)
        if not self._listening:  # draining began before the listener existed
            self._listening = True
            self._stop_listening()

    # ----------------------------------------------------------------- signals

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Route SIGINT, SIGTERM and SIGQUIT to the coordinator; restore on exit.

        From the first moment of ``serve``: a signal during the app's import or its
        lifespan startup starts the shutdown (and its deadlines) at once; signals
        recorded earlier by ``graceful._signals.defer_signals`` (the gunicorn worker,
        ``graceful run``'s start-up) are delivered first.  On exit the previous handlers
        are back and a signal not yet delivered is re-raised to them.
        """
        if self._signals_captured or self._loop is None:
            yield
            return
        with catch_signals(
            HANDLED_SIGNALS, self._request_shutdown, schedule=self._loop.call_soon_threadsafe
        ) as installed:
            self._signals_captured = installed
            try:
                yield
            finally:
                self._signals_captured = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal entry point: request shutdown from the coordinator."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self._request_shutdown, sig)

    def _request_shutdown(self, sig: int) -> None:
        self.coordinator.signal_received(sig, quick=self._quick_signals)

    # -------------------------------------------------------------- the phases

    def _transport_made(self, protocol: Any, transport: asyncio.BaseTransport) -> None:
        if transport in self._transports:
            return  # a websocket upgrade: same connection
        self._transports.add(transport)
        if not getattr(protocol, "_graceful_counted", False):
            self.coordinator.connection_opened()
        if self.coordinator.draining and self._loop is not None:
            # Accepted late (backlog, or just before the listener closed): it gets the
            # same window for its first request as the idle ones at draining.
            self._loop.call_later(self.idle_grace_s, self._shutdown_connection, protocol)

    def _transport_of(self, protocol: Any) -> asyncio.BaseTransport | None:
        # uvicorn's protocols (HTTP and websocket) keep theirs as ``transport``; no
        # attribute of our own on them (see _tracking_class).
        transport = getattr(protocol, "transport", None)
        return transport if transport in self._transports else None

    def _transport_closed(self, transport: asyncio.BaseTransport) -> None:
        if transport in self._transports:
            self._transports.discard(transport)
            self.coordinator.connection_closed()

    def _reap_transports(self) -> None:
        """Count the connections whose transport is closed but no protocol of ours saw
        it go: a protocol that hands its transport to another one (uvicorn's
        ``--http2`` dispatcher gives it to zttp's HTTP/1.1 or HTTP/2 protocol)."""
        for transport in [t for t in self._transports if _closed(t)]:
            self._transport_closed(transport)

    def _is_http(self, connection: Any) -> bool:
        return self._http_class is None or isinstance(connection, self._http_class)

    def _shutdown_connection(self, connection: Any) -> None:
        """Close ``connection`` if idle, else after its response (uvicorn's shutdown)."""
        if connection in self.server_state.connections and self._is_http(connection):
            connection.shutdown()

    def _on_phase(self, phase: Phase) -> None:
        fp = self._fastpath
        if fp.on:
            fp.uninstall()
            self._adopt_fast_requests()
        if fp.middleware is not None and self.coordinator.nudging and not self._nudged:
            self._nudged = True
            self._nudge_in_flight()
        if phase >= Phase.DRAINING:
            self._stop_listening()
            if phase is Phase.DRAINING and self._loop is not None:
                # Busy connections close after their response (Connection: close);
                # connections with no request in progress get idle_grace_s to send one,
                # then close.  Websockets are left to the middleware (1001 after a grace).
                connection: Any
                for connection in list(self.server_state.connections):
                    if not self._is_http(connection):
                        continue
                    if getattr(connection, "cycle", None) is not None and not getattr(
                        connection.cycle, "response_complete", True
                    ):
                        connection.shutdown()
                    else:
                        self._loop.call_later(
                            self.idle_grace_s, self._shutdown_connection, connection
                        )
        if phase >= Phase.STOPPING:
            self.should_exit = True
            if self._wake is not None and not self._wake.done():
                self._wake.set_result(None)

    def _fast_tasks(self) -> list[tuple[asyncio.Task[Any], Any]]:
        """The running request tasks the fast path started, with their cycles."""
        found = []
        app = self._fastpath.app
        for task in self.server_state.tasks:
            if task.done():
                continue
            # uvicorn's task runs ``cycle.run_asgi(app)``: its frame holds both.
            frame = getattr(task.get_coro(), "cr_frame", None)
            if frame is not None and frame.f_locals.get("app") is app:
                found.append((task, frame.f_locals.get("self")))
        return found

    def _fast_requests(self) -> tuple[int, int]:
        """The coordinator's request source (in flight, started) for the fast path."""
        fp = self._fastpath
        return (len(self._fast_tasks()) if fp.on else 0), fp.started

    def _adopt_fast_requests(self) -> None:
        """Shutdown was requested: report the fast path's requests still running to the
        coordinator, each until its task ends (a response may be complete while the app
        still runs, e.g. a background task); every later request takes the middleware.
        """
        c = self.coordinator
        running = self._fast_tasks()
        for task, cycle in running:
            if cycle is not None:
                cycle.graceful_adopted = True
            task.add_done_callback(_finisher(c, c.request_started()))
        self._fastpath.started -= len(running)  # counted by the coordinator from now on

    def _nudge_in_flight(self) -> None:
        """Nudging began: requests whose response has not started close their
        connection after it, with ``Connection: close``.

        uvicorn 0.53+ writes the header for ``keep_alive = False``; before, its httptools
        cycle writes it only when the *request* carried it, so there the header joins the
        request's header list too (a hop-by-hop header, meant for this connection).
        """
        connection: Any
        for connection in self.server_state.connections:
            cycle = getattr(connection, "cycle", None) if self._is_http(connection) else None
            if cycle is not None and not cycle.response_started:
                cycle.keep_alive = False
                if not _KEEP_ALIVE_WRITES_CLOSE:
                    headers = cycle.scope["headers"]
                    if _CLOSE_HEADER not in headers:
                        headers.append(_CLOSE_HEADER)

    def _stop_listening(self) -> None:
        if not self._listening or self._loop is None:
            return
        self._listening = False
        servers, self.servers = list(getattr(self, "servers", [])), []
        self._closing = close_keeping_backlog(
            servers, self._protocol_factory, self._loop, self._handovers, ssl=self.config.ssl
        )

    def _protocol_factory(self) -> asyncio.Protocol:
        cls: Any = self.config.http_protocol_class  # uvicorn types it as asyncio.Protocol
        protocol: asyncio.Protocol = cls(
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )
        return protocol

    async def _tick_until(self, phase: Phase) -> None:
        """Keep uvicorn's housekeeping (date header, gunicorn heartbeat) going."""
        counter = 0
        while not await self.coordinator.wait_for_phase(phase, timeout_s=0.1):
            counter = (counter + 1) % 864000
            self._reap_transports()
            await self.on_tick(counter)

    async def main_loop(self) -> None:
        """uvicorn's loop, but woken at once when the coordinator starts stopping."""
        loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            # asyncio.sleep(0.1), cut short when stopping begins: a future and a timer,
            # as cheap as uvicorn's own tick (wait_for would make a task per tick).
            self._wake = wake = loop.create_future()
            timer = loop.call_later(0.1, _resolve, wake)
            try:
                await wake
            finally:
                timer.cancel()
                self._wake = None
            if counter % 10 == 0:
                self._reap_transports()
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        """Wait for the coordinator to stop, keeping uvicorn's housekeeping going.

        The cut of what is left and lifespan shutdown run as the coordinator's first
        stopping step (``_finish``), so they share stopping's budget.
        """
        c = self.coordinator
        # uvicorn's on_tick logs "Maximum request limit exceeded" at every tick once it is
        # reached; it has done its job, so stop checking while we drain.
        self.limit_max_requests = None
        if c.phase < Phase.STOPPING and not c.shutdown_requested:
            # uvicorn decided to exit by itself (max requests, should_exit set by a
            # supervisor): drain at once rather than wait for an idle listener.
            c.request_shutdown("server exit", drain_now=True)
        await self._tick_until(Phase.STOPPED)

    async def _answer_adopted_cut(self, timeout_s: float) -> None:
        """Before the cut: a request adopted from the fast path has no middleware around
        it to answer 503, so the server sends it (as the middleware would) when its
        response has not started; the app's task is cancelled right after."""
        middleware = self._fastpath.middleware
        if middleware is None:
            return
        cycles = [
            cycle
            for cycle in self._fast_cycles_adopted()
            if not cycle.response_started and not cycle.disconnected
        ]
        if cycles:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(middleware.cut(cy.scope, cy.send) for cy in cycles)),
                    max(0.001, timeout_s),
                )

    def _fast_cycles_adopted(self) -> list[Any]:
        connection: Any
        cycle: Any
        cycles = []
        for connection in self.server_state.connections:
            cycle = getattr(connection, "cycle", None)
            if getattr(cycle, "graceful_adopted", False) and not cycle.response_complete:
                cycles.append(cycle)
        return cycles

    async def _finish(self) -> None:
        """Stopping: let websockets close with 1001, cut requests, run lifespan shutdown.

        Each part gets a share of what is left of stopping's budget, so lifespan
        shutdown always gets its turn.
        """
        c = self.coordinator
        d = c.deadlines
        exit_by = None if d is None else d.exit_by
        self._stop_listening()
        if self._closing is not None:
            await asyncio.wait((self._closing,), timeout=c.time_left_s(exit_by, at_most_s=0.5))
        # Sessions were told to end when stopping began; their 1001 goes out first
        # (uvicorn's own websocket shutdown would send 1012).
        left = c.time_left_s(exit_by, at_most_s=1.0)
        await c.wait_drained(
            include_connections=False,
            include_requests=False,
            until_stopping=False,
            timeout_s=left / 3,
        )
        tasks = [t for t in self.server_state.tasks if not t.done()]
        if tasks:
            logger.warning("cutting %d request(s) still running", len(tasks))
            await self._answer_adopted_cut(c.time_left_s(exit_by, at_most_s=1.0) / 2)
            for task in tasks:
                task.cancel(msg="graceful: stopping")
            left = c.time_left_s(exit_by, at_most_s=1.0)
            await asyncio.wait(tasks, timeout=left / 2)
        for connection in list(self.server_state.connections):
            connection.shutdown()
        for transport in list(self._transports):
            transport.close()
        if not self.force_exit:
            # Just short of exit_by, so that its own timeout is the one that reports.
            left = max(0.0, c.time_left_s(exit_by) - 0.05)
            try:
                await asyncio.wait_for(self.lifespan.shutdown(), left)
            except asyncio.TimeoutError:
                logger.error("lifespan shutdown did not finish within %.3g s; abandoned", left)


@final
class _FastPath:
    """The hot path (see "The hot path" in the module docs).

    While it is on, the HTTP protocol class has a ``_start_asgi_task`` of its own that
    hands a request straight to the app; the first phase change removes it from the
    class, so that uvicorn's own method runs again and every later request takes the
    middleware.  Everything that method reads is bound in its closure: no flag tested
    and no attribute looked up per request (``on`` is for the server's cold paths).
    """

    __slots__ = ("_classes", "app", "drain_signal", "middleware", "on", "special_paths", "started")

    def __init__(self) -> None:
        self.on = False  # while nothing shuts down, with httptools
        self.middleware: GracefulMiddleware | None = None
        self.app: ASGIApp | None = None  # what the middleware wraps
        self.special_paths: Any = frozenset()  # health, metrics, preStop
        self.drain_signal: Any = None
        self.started = 0  # requests it started (less those adopted)
        self._classes: list[type[Any]] = []

    def prepare(self, middleware: GracefulMiddleware) -> None:
        self.middleware, self.app = middleware, middleware.app
        self.special_paths = middleware.health_endpoints
        self.drain_signal = middleware.drain_signal
        self.on = True

    def install(self, cls: type[Any], base: type[Any], server: Server) -> None:
        """Give ``cls`` (a tracking subclass of uvicorn's httptools protocol) the fast
        ``_start_asgi_task``.

        Where uvicorn's own method is the one of 0.50 to 0.54 (the same source text)
        and ``reset_contextvars`` is off, its three lines — create the task, let
        the server's task set hold it until it ends — are inlined, with everything
        they look up bound once: the call through to it costs more than the rest of
        the fast path.  Otherwise the fast path calls uvicorn's method.
        """
        start_asgi_task = base._start_asgi_task  # httptools, uvicorn 0.50+ (see _prepare)
        middleware, app, special_paths = self.middleware, self.app, self.special_paths
        drain_signal, fp = self.drain_signal, self
        fast: Callable[[Any, Any, Any], None]
        if (
            _is_uvicorns_start_asgi_task(start_asgi_task)
            and not getattr(server.config, "reset_contextvars", False)
            and server._loop is not None
        ):
            create_task = server._loop.create_task
            add, discard = server.server_state.tasks.add, server.server_state.tasks.discard

            def fast(protocol: Any, cycle: Any, asgi_app: Any) -> None:
                scope = cycle.scope
                # uvicorn's limit_concurrency answer (another app) is left alone.
                if asgi_app is not middleware or scope["path"] in special_paths:
                    return start_asgi_task(protocol, cycle, asgi_app)  # type: ignore[no-any-return]
                scope["extensions"] = {"graceful": drain_signal}
                fp.started += 1
                task = create_task(cycle.run_asgi(app))
                task.add_done_callback(discard)
                add(task)
                return None

        else:

            def fast(protocol: Any, cycle: Any, asgi_app: Any) -> None:
                scope = cycle.scope
                if asgi_app is middleware and scope["path"] not in special_paths:
                    scope["extensions"] = {"graceful": drain_signal}
                    fp.started += 1
                    asgi_app = app
                start_asgi_task(protocol, cycle, asgi_app)

        cls._start_asgi_task = fast
        self._classes.append(cls)

    def uninstall(self) -> None:
        """Shutdown was requested: uvicorn's own method from now on."""
        self.on = False
        for cls in self._classes:
            with contextlib.suppress(AttributeError):
                del cls._start_asgi_task
        self._classes.clear()


#: The SHA-256 of the source of uvicorn's ``HttpToolsProtocol._start_asgi_task`` in
#: 0.50 to 0.54 (the same text in each), which the hot path inlines.
_START_ASGI_TASK_SHA256 = "9c08c2571ae9b0380320a24c20c3af18d165f168c21bc3aaf14754a5b0fc2b8a"


def _is_uvicorns_start_asgi_task(method: Any) -> bool:
    """``method`` is uvicorn's own ``_start_asgi_task`` as the fast path inlines it: the
    same source text, so any change in a later uvicorn turns the inlining off."""
    if getattr(method, "__module__", None) != "uvicorn.protocols.http.httptools_impl":
        return False
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):  # no source to compare: call it rather than guess
        return False
    return hashlib.sha256(source.encode()).hexdigest() == _START_ASGI_TASK_SHA256


def _finisher(
    coordinator: ShutdownCoordinator, sampled: float | None
) -> Callable[[asyncio.Task[Any]], None]:
    """A done callback that reports the end of an adopted request."""

    def finished(task: asyncio.Task[Any]) -> None:
        coordinator.request_finished(sampled)

    return finished


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _closed(transport: asyncio.BaseTransport) -> bool:
    """Whether ``transport``'s socket is closed (asyncio and uvloop alike)."""
    if not transport.is_closing():
        return False
    sock = transport.get_extra_info("socket")
    return sock is None or sock.fileno() == -1


async def _never() -> None:
    await asyncio.Event().wait()


def _make_server(
    app: ASGIApp | str,
    coordinator: ShutdownCoordinator | None,
    policy: Policy | None,
    kwargs: dict[str, Any],
) -> Server:
    if coordinator is not None and policy is not None:
        raise ValueError("pass either coordinator= or policy=, not both")
    if coordinator is None:
        coordinator = ShutdownCoordinator(policy=policy)
    middleware = {
        key: kwargs.pop(key)
        for key in (
            "readiness_path",
            "liveness_path",
            "prestop_path",
            "websocket_close_grace_s",
            "metrics_path",
            "readiness_on_shutdown",
        )
        if key in kwargs
    }
    wrap_app = kwargs.pop("wrap_app", True)
    config = uvicorn.Config(app, **kwargs)
    return Server(config, coordinator=coordinator, wrap_app=wrap_app, **middleware)


async def serve(
    app: ASGIApp | str,
    *,
    coordinator: ShutdownCoordinator | None = None,
    policy: Policy | None = None,
    **kwargs: Any,
) -> None:
    """Serve ``app`` with a graceful ``Server`` in the running event loop.

    Keyword arguments go to ``uvicorn.Config``, except the middleware's
    (``readiness_path``, ``liveness_path``, ``prestop_path``, ``websocket_close_grace_s``,
    ``metrics_path``, ``readiness_on_shutdown``)
    and ``wrap_app``.
    """
    await _make_server(app, coordinator, policy, kwargs).serve()


def run(
    app: ASGIApp | str,
    *,
    coordinator: ShutdownCoordinator | None = None,
    policy: Policy | None = None,
    **kwargs: Any,
) -> None:
    """Like ``uvicorn.run`` (single process), with graceful shutdown; see ``serve``.

    A signal during the teardown after the shutdown (the kubelet's SIGTERM right after a
    preStop drain) is logged, not left to kill the process with its default action.
    """
    server = _make_server(app, coordinator, policy, kwargs)
    with teardown_guard(lambda: server.coordinator.shutdown_requested):
        server.run()
