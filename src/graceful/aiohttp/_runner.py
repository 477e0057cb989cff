"""graceful.aiohttp's connection side: ``AppRunner``, and the shape filled in for aiohttp.

``AppRunner``, a drop-in for ``aiohttp.web.AppRunner``, counts connections from the
kernel's hand-over, closes its sites' listeners at *draining* without resetting their
backlog (``graceful._core.listeners``), closes idle keep-alive connections, and runs
``on_shutdown`` and ``on_cleanup`` when the phases say; ``_Shape`` is how it follows
them (``graceful._core.shape``).  It installs the request side,
``graceful.aiohttp._middleware``, if the application was not set up, and takes the
middleware out of the application's chain for its hot path (``graceful.aiohttp._hot``:
the server's public ``request_handler`` is a dispatcher).

Reaches below aiohttp's public API
----------------------------------
* ``BaseSite._server`` and ``_ssl_context``, read with ``getattr``: a site's
  ``asyncio.Server``, which aiohttp exposes nowhere else (its own
  ``BaseRunner.addresses`` reads it the same way); needed to count accepts and to close
  the listener keeping the backlog.
* ``RequestHandler._waiter``, read with ``getattr``: whether a connection waits for its
  next request — the check aiohttp's own keep-alive timer makes
  (``_process_keepalive``).  aiohttp's public ``RequestHandler.close()`` leaves an idle
  connection open, and its ``shutdown()`` drops the rest of a request body being
  uploaded, so neither can be used.
* ``BaseRunner._make_server`` and ``_cleanup_server``, overridden: the first is where
  the server aiohttp built is taken over (below), the second runs ``on_cleanup`` once,
  as the last stopping step.
* The ``aiohttp.web.Server`` the runner creates is copied into an instance of a
  subclass that overrides two *public* methods (``__call__`` and ``connection_lost``),
  because ``AppRunner`` offers no way to choose the class (``_tracking_copy``); and the
  hot path's dispatcher is its public ``request_handler``.
* The hot path (``graceful.aiohttp._hot``) relies on how aiohttp runs a request: in a
  task of its own, awaiting the ``request_handler``'s coroutine; the request is found
  among that task's coroutines' locals, by type.
No aiohttp module or class is patched.  ``docs/adapters.md`` ("Private names each
adapter reads") lists these names with the releases they were checked against.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final, TypeGuard, cast

import anyio
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from typing_extensions import final

from .._core.coordinator import ShutdownCoordinator
from .._core.listeners import Handovers, close_keeping_backlog, count_accepts
from .._core.policy import Phase, _check_seconds
from .._core.shape import ServerShape
from ._hot import HotPath
from ._middleware import Middleware
from ._setup import setup

__all__ = ("AppRunner",)

logger = logging.getLogger("graceful")

_RECHECK_S: Final = 0.25  # draining: how often a busy connection is checked for idleness


class _TrackingServer(web.Server):
    """aiohttp's protocol factory, reporting each connection to its ``AppRunner``.

    Only public methods of ``aiohttp.web.Server`` are overridden: ``__call__`` (a
    connection's protocol is created) and ``connection_lost``.  Instances are
    never constructed: the runner copies the server aiohttp built into one
    (``_tracking_copy``).
    """

    _graceful_runner: AppRunner

    def __call__(self) -> RequestHandler:
        runner = self._graceful_runner
        # Counts from here on uvloop, takes over the accept()'s count on asyncio.
        runner._handovers.protocol_created()
        try:
            handler = super().__call__()
        except BaseException:
            runner.coordinator.connection_closed()
            raise
        runner._connection_created(handler)
        return handler

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        try:
            super().connection_lost(handler, exc)
        finally:
            self._graceful_runner._connection_lost(handler)


def _tracking_copy(server: web.Server) -> _TrackingServer:
    """``server`` as a ``_TrackingServer``: its attributes set one by one on a new
    instance, in their order.  Not a switch of its class: CPython's fast path for
    instance attributes does not survive one, and aiohttp increments the server's
    ``requests_count`` for every request (about 400 instructions more a request,
    by ``benchmarks/server_instructions.py --server aiohttp``).  A server without a
    ``__dict__`` has its class switched."""
    try:
        attributes = vars(server)
    except TypeError:
        server.__class__ = _TrackingServer
        return cast(_TrackingServer, server)
    tracking = _TrackingServer.__new__(_TrackingServer)
    for name, value in attributes.items():
        setattr(tracking, name, value)
    return tracking


def _is_listener(server: Any) -> TypeGuard[asyncio.AbstractServer]:
    """An event loop's server (asyncio's or uvloop's)."""
    return callable(getattr(server, "close", None)) and hasattr(server, "sockets")


def _is_idle(handler: RequestHandler) -> bool:
    """``True`` if ``handler`` waits for its next request (see the module docs)."""
    waiter = getattr(handler, "_waiter", None)
    return isinstance(waiter, asyncio.Future) and not waiter.done()


@final
class AppRunner(web.AppRunner):
    """A ``aiohttp.web.AppRunner`` whose sites and connections follow a coordinator.

    Create sites on it as usual (``web.TCPSite(runner, …)``, ``SockSite``, ``UnixSite``)
    and run the coordinator (``await coordinator.run()``); call ``cleanup`` after
    it returned.  The runner installs ``setup`` on the application if it was not.

    * A site's listening socket counts connections from the kernel's hand-over once the
      runner adopted it: right away for sites made by ``run_app`` and the gunicorn
      worker, otherwise when shutdown is requested (call ``adopt_sites`` after
      starting your sites to count from the start).
    * At *draining* the listeners close without resetting their backlog, ``on_shutdown``
      runs (a ``DRAINING`` hook of the coordinator, bounded by ``hook_timeout_s``), and
      connections with no request in progress get ``idle_grace_s`` to send one.
    * At *stopping* ``on_shutdown`` runs if draining was skipped, websockets get their
      1001, what still runs is cut, connections are closed, then ``on_cleanup`` runs.

    Args:
        app: The application.
        coordinator: The process's coordinator.
        idle_grace_s: When draining begins, how long a connection with no request in
            progress (idle keep-alive, or accepted but silent) may still send one; it
            is answered with ``Connection: close``.  Connections accepted later get the
            same window from their arrival.
        readiness_path: Passed to ``setup`` if the application was not set up yet.
        liveness_path: Passed to ``setup`` if the application was not set up yet.
        prestop_path: Passed to ``setup`` if the application was not set up yet.
        websocket_close_grace_s: Passed to ``setup`` if the application was not set up yet.
        metrics_path: Passed to ``setup`` if the application was not set up yet.
        readiness_on_shutdown: Passed to ``setup`` if the application was not set up
            yet.
        management_port: Passed to ``setup`` if the application was not set up yet.
        management_host: Passed to ``setup`` if the application was not set up yet.
        health_on_app_port: Passed to ``setup`` if the application was not set up yet.
        kwargs: ``aiohttp.web.AppRunner``'s (``access_log``, ``keepalive_timeout``,
            ``shutdown_timeout`` — which bounds only ``cleanup`` of what the
            coordinator left, …).  ``handle_signals`` must stay ``False``: signals go to
            the coordinator.
    """

    def __init__(
        self,
        app: web.Application,
        *,
        coordinator: ShutdownCoordinator,
        idle_grace_s: float = 1.0,
        readiness_path: str | None = "/readyz",
        liveness_path: str | None = "/livez",
        prestop_path: str | None = None,
        websocket_close_grace_s: float = 1.0,
        metrics_path: str | None = None,
        readiness_on_shutdown: str = "fail",
        management_port: int | None = None,
        management_host: str = "127.0.0.1",
        health_on_app_port: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs.pop("handle_signals", False):
            raise ValueError(
                "handle_signals must be False: the coordinator handles signals "
                "(coordinator.run() without a shutdown_trigger)"
            )
        super().__init__(app, handle_signals=False, **kwargs)
        self.coordinator: Final = coordinator
        self.idle_grace_s = _check_seconds("idle_grace_s", idle_grace_s)
        self.middleware: Final = setup(
            app,
            coordinator=coordinator,
            readiness_path=readiness_path,
            liveness_path=liveness_path,
            prestop_path=prestop_path,
            websocket_close_grace_s=websocket_close_grace_s,
            metrics_path=metrics_path,
            readiness_on_shutdown=readiness_on_shutdown,
            management_port=management_port,
            management_host=management_host,
            health_on_app_port=health_on_app_port,
        )
        self._hot: HotPath | None = None
        self._hot_wanted = _take_out_of_chain(app, self.middleware, self._hot_requests)
        self._handovers = Handovers(coordinator)
        self._open: set[RequestHandler] = set()
        self._adopted: dict[web.BaseSite, asyncio.AbstractServer] = {}
        self._tls: dict[web.BaseSite, Any] = {}  # TLS sites and their SSL contexts
        self._closing: asyncio.Future[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown_started = False
        self._cleaned_up = False
        self._shape = _Shape(self)
        self._shape.attach()
        self._shape.listeners_opened()  # sites listen once started: adopt_sites
        coordinator.add_hook(self._on_shutdown, phase=Phase.DRAINING)
        coordinator.add_stopping_step(self._cleanup_app)

    # -------------------------------------------------------------- setting up

    def _hot_requests(self) -> tuple[int, int]:
        """The coordinator's request source: the hot path's requests."""
        return (0, 0) if self._hot is None else self._hot.requests()

    async def _make_server(self) -> web.Server:
        tracking = _tracking_copy(await super()._make_server())
        tracking._graceful_runner = self
        self._loop = asyncio.get_running_loop()
        if self._hot_wanted:
            # Each connection reads the server's request_handler when it is made.
            self._hot = HotPath(self.middleware, tracking, self._open, self._loop)
            self._hot.on = not self.coordinator.shutdown_requested
            tracking.request_handler = self._hot.request_handler
            self.middleware.hot = self._hot
        return tracking

    def adopt_sites(self) -> None:
        """Count accepts on every started site's listener (and close it at once if the
        drain began already).  Idempotent; called at every phase change."""
        late: list[tuple[asyncio.AbstractServer, Any]] = []
        for site in self.sites:
            server = getattr(site, "_server", None)  # aiohttp: the site's asyncio.Server
            # uvloop's Server is no asyncio.AbstractServer subclass (an isinstance test
            # would leave uvloop's listeners open while draining): a listener is what
            # has sockets and closes.
            if not _is_listener(server) or site in self._adopted:
                continue
            self._adopted[site] = server
            ssl_context = getattr(site, "_ssl_context", None)  # aiohttp: the site's TLS
            if ssl_context is not None:
                self._tls[site] = ssl_context
            count_accepts(server, self._handovers)
            if not self._shape.listening:
                late.append((server, ssl_context))
        if late:
            self._close_listeners(late)

    # ------------------------------------------------------------- connections

    def _connection_created(self, handler: RequestHandler) -> None:
        self._open.add(handler)
        if self.coordinator.draining and self._loop is not None:
            # Accepted late (backlog, or just before the listener closed): it gets the
            # same window for its first request as the idle ones at draining.
            self._loop.call_later(self.idle_grace_s, self._close_if_idle, handler)

    def _connection_lost(self, handler: RequestHandler) -> None:
        if handler in self._open:
            self._open.discard(handler)
            self.coordinator.connection_closed()

    def _close_if_idle(self, handler: RequestHandler) -> None:
        """Close ``handler`` if it waits for a request; else look again soon (a busy
        connection normally closes after its response, which says ``Connection:
        close``; one whose response started before the nudge may stay open)."""
        if handler not in self._open or self.coordinator.cutting or self._loop is None:
            return
        if _is_idle(handler):
            handler.force_close()
        else:
            self._loop.call_later(_RECHECK_S, self._close_if_idle, handler)

    # -------------------------------------------------------------- the phases

    def _close_listeners(self, listeners: list[tuple[asyncio.AbstractServer, Any]]) -> None:
        """Close each ``(listener, ssl_context)``, serving its backlog (with TLS if it
        has a context)."""
        server, loop = self.server, self._loop
        if server is None or loop is None:  # cleaned up already: nothing left to serve
            for listener, _ in listeners:
                listener.close()
            return
        closing = [
            close_keeping_backlog([listener], server, loop, self._handovers, ssl=ssl_context)
            for listener, ssl_context in listeners
        ]
        if closing:
            self._closing = asyncio.gather(*closing)

    async def _on_shutdown(self) -> None:
        """``on_shutdown``, as draining begins (a coordinator hook)."""
        if self._shutdown_started or self.server is None:
            return
        self._shutdown_started = True
        await self.app.shutdown()

    async def shutdown(self) -> None:
        """``on_shutdown`` (aiohttp's ``cleanup`` calls it), unless it ran already."""
        if not self._shutdown_started:
            self._shutdown_started = True
            await super().shutdown()

    async def _cleanup_server(self) -> None:
        if not self._cleaned_up:
            self._cleaned_up = True
            await super()._cleanup_server()

    async def _cleanup_app(self) -> None:
        """``on_cleanup``, the last stopping step."""
        if self.server is not None:
            await self._cleanup_server()


@final
class _Shape(ServerShape):
    """The phases and stopping for aiohttp (``graceful._core.shape``): the runner's adopted
    sites, its connections (aiohttp's request handlers), ``on_shutdown`` and the
    middleware's cut.  ``on_cleanup`` is a stopping step of its own, the last."""

    def __init__(self, runner: AppRunner) -> None:
        super().__init__(runner.coordinator, idle_grace_s=runner.idle_grace_s)
        self.runner = runner

    def on_phase(self, phase: Phase) -> None:
        self.runner.adopt_sites()  # sites started since the last phase change
        super().on_phase(phase)

    def shutdown_requested(self) -> None:
        hot = self.runner._hot
        if hot is not None:
            hot.adopt(self.coordinator)

    def close_listeners(self) -> None:
        runner = self.runner
        runner._close_listeners([(s, runner._tls.get(site)) for site, s in runner._adopted.items()])

    async def listeners_closed(self, timeout_s: float) -> None:
        closing = self.runner._closing
        if closing is not None and not closing.done():
            await asyncio.wait((closing,), timeout=timeout_s)

    def close_idle(self, grace_s: float) -> None:
        runner, loop = self.runner, self.runner._loop
        if loop is not None:
            for handler in list(runner._open):
                loop.call_later(grace_s, runner._close_if_idle, handler)

    async def before_cut(self, exit_by: float | None) -> None:
        """``on_shutdown``, if draining was skipped (its hook did not run), with a third
        of the hooks' budget: websockets and streams are closed there."""
        runner, c = self.runner, self.coordinator
        if runner._shutdown_started or runner.server is None:
            return
        limit = c.time_left_s(exit_by, at_most_s=c.hook_timeout_s) / 3
        with anyio.move_on_after(limit) as scope:
            try:
                await runner._on_shutdown()
            except Exception:
                logger.exception("on_shutdown failed")
        if scope.cancelled_caught:
            logger.error("on_shutdown timed out after %.3g s, abandoned", limit)

    async def cut(self, timeout_s: float) -> None:
        """The adopted requests' 503s (if any), then the middleware's cut."""
        hot = self.runner._hot
        if hot is not None and any(not task.done() for task, _ in hot.adopted):
            await hot.answer_cut(timeout_s / 2)
            timeout_s /= 2
        await self.runner.middleware.cut(timeout_s=timeout_s)

    def close_connections(self) -> None:
        for handler in list(self.runner._open):
            handler.force_close()


def _take_out_of_chain(app: web.Application, middleware: Middleware, source: Any) -> bool:
    """Take ``middleware`` out of ``app``'s chain for the hot path
    (``graceful.aiohttp._hot``), if it is the outermost and the coordinator takes the
    hot path's request source; ``False`` leaves it where it is."""
    chain = app.middlewares
    inside = middleware in chain
    if inside and (app.frozen or chain[0] is not middleware):
        return False  # another middleware runs before it: keep the order
    try:
        middleware.coordinator.add_request_source(source)
    except RuntimeError:  # another server counts for this coordinator
        if not inside:
            raise RuntimeError(
                "the application's graceful middleware was taken out of its chain by "
                "another runner of the same coordinator"
            ) from None
        return False
    if inside:
        chain.remove(middleware)
    return True
