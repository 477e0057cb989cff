"""``graceful.uvicorn.Server``: the ``uvicorn.Server`` subclass that follows a
coordinator (what it changes against stock uvicorn: ``graceful.uvicorn``'s docstring).

It overrides uvicorn's own seams only: ``serve``/``startup`` (the app wrapped, the
protocol classes replaced by counting subclasses, accepts counted), ``capture_signals``
and ``handle_exit`` (signals go to the coordinator), ``main_loop`` and ``shutdown``
(uvicorn's housekeeping ticks on while the coordinator decides).  What each phase does
to uvicorn's connections is ``graceful.uvicorn._shape.UvicornShape``; this class is the
server it drives (the ``Server`` protocol there).

The lines that need their reason:

* signals are captured before the app is loaded (``serve``): a SIGTERM during the
  import or lifespan startup starts the shutdown instead of killing the process;
* the coordinator runs with a trigger that never fires (``_never``): signals reach it
  through this server, so it must not install handlers of its own;
* ``main_loop`` sleeps on a future and a timer, not ``asyncio.wait_for``: as cheap per
  tick as uvicorn's ``asyncio.sleep(0.1)``, yet woken at once when stopping begins;
* no method here runs per request: with httptools a request goes from uvicorn straight
  to the app, past the middleware (``_shape.HotPath``); the tracking protocol classes
  call ``_transport_made`` and ``_transport_closed`` once per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn
from typing_extensions import final

from .._core import logging as _logging
from .._core.coordinator import ShutdownCoordinator, _check_coordinator, _check_signals
from .._core.listeners import Handovers, count_accepts
from .._core.policy import Phase, _check_bool, _check_seconds
from .._core.signals import QUICK_SIGNALS, catch_signals
from ..asgi import GracefulMiddleware, check_options
from ._shape import HotPath, UvicornShape, is_httptools, tracking_class

#: The signals this server handles (uvicorn's SIGINT and SIGTERM, plus SIGQUIT).
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, *QUICK_SIGNALS)
#: The longest a connection that has not sent its first request may still send it once
#: draining began (``Server.first_request_grace_s``): uvicorn's default keep-alive timeout.
FIRST_REQUEST_GRACE_MAX_S = 5.0


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
        idle_grace_s: When draining begins, how long an idle keep-alive connection may
            still send one more request; it is answered with ``Connection: close``.  A
            connection that has not sent its first request yet (accepted before
            draining, or later: from its arrival) gets ``first_request_grace_s``: this,
            or uvicorn's ``timeout_keep_alive`` if longer, at most 5 s.
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
        if not isinstance(config, uvicorn.Config):
            raise TypeError(
                f"config must be a uvicorn.Config, got {type(config).__name__} {config!r}"
            )
        if coordinator is not None:
            _check_coordinator(coordinator)
        self._wrap_app = _check_bool("wrap_app", wrap_app)
        self._quick_signals = _check_signals("quick_signals", quick_signals)
        self.idle_grace_s = _check_seconds("idle_grace_s", idle_grace_s)
        check_options("graceful.uvicorn.Server", **middleware_options)
        super().__init__(config)
        self.coordinator = coordinator if coordinator is not None else ShutdownCoordinator()
        self._middleware_options = middleware_options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Future[None] | None = None  # main_loop's tick, while it sleeps
        self._transports: set[asyncio.BaseTransport] = set()
        self._handovers = Handovers(self.coordinator)
        self._http_class: type[Any] | None = None
        self._ws_class: type[Any] | None = None
        self._signals_captured = False
        self._hot: HotPath | None = None
        self._shape = UvicornShape(self)
        self.coordinator.subscribe(self._shape.on_phase)

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
            if is_httptools(config.http_protocol_class) and not c.shutdown_requested:
                self._hot = HotPath(middleware, self.server_state.tasks)
                config.loaded_app = self._hot.app
                c.add_request_source(self._hot.requests)
        self._shape.http2.check(config, self.server_state)  # zttp's --http2 names
        self._http_class = tracking_class(config.http_protocol_class, self, counts=True)
        config.http_protocol_class = self._http_class
        if config.ws_protocol_class is not None:
            config.ws_protocol_class = tracking_class(config.ws_protocol_class, self, counts=False)
            self._ws_class = config.ws_protocol_class

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
            self.coordinator.add_stopping_step(self._shape.finish)
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
        if self._hot is not None:
            # The DrainSignal in every request's scope["state"] (uvicorn copies the
            # lifespan state into each): the middleware put it there if the app ran
            # lifespan; with lifespan off, here.
            self.lifespan.state["graceful"] = self._hot.middleware.drain_signal
        for server in getattr(self, "servers", []):
            count_accepts(server, self._handovers)
        self._shape.listeners_opened()  # closes them if draining began meanwhile

    # ----------------------------------------------------------------- signals

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Route SIGINT, SIGTERM and SIGQUIT to the coordinator; restore on exit.

        From the first moment of ``serve``: a signal during the app's import or its
        lifespan startup starts the shutdown (and its deadlines) at once; signals
        recorded earlier by ``graceful._core.signals.defer_signals`` (the gunicorn worker,
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
            # same window for its first request as the unused ones at draining.
            self._loop.call_later(self.first_request_grace_s, self._shutdown_connection, protocol)

    @property
    def first_request_grace_s(self) -> float:
        """While draining, how long a connection that has not sent its first request
        yet may still send it: uvicorn's keep-alive timeout (how long it waits for the
        next request on a connection while serving; a silent new one it keeps for
        ever), at most ``FIRST_REQUEST_GRACE_MAX_S`` (behind a cloud balancer the
        timeout is often a minute or more, and a silent pre-opened connection would hold
        every drain that long), at least ``idle_grace_s``; the drain's deadline bounds
        it.

        Closing such a connection is not like closing an idle keep-alive one: its client
        may already be writing its first request and, on a connection that never
        answered, has no way to tell whether that request was read — the same loss
        as a reset backlog, which the drain serves for that reason.  A client stalled
        longer than ``idle_grace_s`` between its handshake and its request (a loaded
        host) lost it to the close."""
        keep_alive = min(float(self.config.timeout_keep_alive), FIRST_REQUEST_GRACE_MAX_S)
        return max(self.idle_grace_s, keep_alive)

    def grace_for(self, connection: Any) -> float:
        """The window at draining of ``connection`` with no request in progress:
        ``idle_grace_s`` once it has served a request, else ``first_request_grace_s``."""
        if getattr(connection, "cycle", None) is None:
            return self.first_request_grace_s
        return self.idle_grace_s

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
        """An HTTP connection, not a websocket: ours, or one our protocol handed its
        transport to (uvicorn's ``--http2`` dispatcher: zttp's HTTP/1.1 or HTTP/2)."""
        if self._http_class is None or isinstance(connection, self._http_class):
            return True
        return self._ws_class is None or not isinstance(connection, self._ws_class)

    def _shutdown_connection(self, connection: Any) -> None:
        """Close ``connection`` if idle, else after its response (uvicorn's shutdown)."""
        if connection in self.server_state.connections and self._is_http(connection):
            connection.shutdown()

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
            # A connection handed to zttp is counted out here: once a second while
            # serving, at every tick from the shutdown request on (the drain ends when
            # the last one is gone, not up to a second later).
            if counter % 10 == 0 or self.coordinator.shutdown_requested:
                self._reap_transports()
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        """Wait for the coordinator to stop, keeping uvicorn's housekeeping going.

        The cut of what is left and lifespan shutdown run as the coordinator's first
        stopping step (``graceful._core.shape.ServerShape.finish``), so they share stopping's
        budget.
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


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _closed(transport: asyncio.BaseTransport) -> bool:
    """Whether ``transport``'s socket is closed (asyncio and uvloop alike)."""
    if not transport.is_closing():
        return False
    try:
        sock = transport.get_extra_info("socket")
    except AttributeError:  # asyncio's TLS transport once its SSL protocol let go of it
        return True
    return sock is None or sock.fileno() == -1


async def _never() -> None:
    await asyncio.Event().wait()
