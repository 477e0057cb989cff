"""aiohttp that follows a ``graceful.ShutdownCoordinator``.

::

    import graceful.aiohttp
    graceful.aiohttp.run_app(app, host="0.0.0.0", port=8080,
                             policy=graceful.AcceptUntilIdle(idle_s=2))

or, with a runner of your own::

    coordinator = graceful.ShutdownCoordinator()
    runner = graceful.aiohttp.AppRunner(app, coordinator=coordinator)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", 8080).start()
    runner.adopt_sites()             # count connections from accept() from now on
    await coordinator.run()          # SIGTERM/SIGINT/SIGQUIT handled; returns when stopped
    await runner.cleanup()

What changes against stock aiohttp
----------------------------------
Stock ``web.run_app`` turns the first SIGTERM into ``GracefulExit``: the sites stop (the
listener is closed and the kernel resets the accept backlog), idle keep-alive connections
are closed, ``on_shutdown`` runs once the listener is already gone, in-flight responses do
not say ``Connection: close``, and handlers get ``shutdown_timeout`` twice over (60 s by
default: once to finish, once after being cancelled) — a websocket that is never closed
holds the process for all of it.  Here the coordinator decides:

* *accepting*: the listener stays open, new connections count as activity, responses
  carry ``Connection: close`` if the policy nudges, readiness answers 503;
* *draining*: the listener is closed without resetting the backlog, ``on_shutdown``
  runs (so the app can end its websockets and streams), responses carry ``Connection:
  close``, connections with no request in progress get ``idle_grace_s`` to send one,
  websockets get a close frame with ``WSCloseCode.GOING_AWAY`` (1001) after
  ``websocket_close_grace_s``;
* *stopping* (drain deadline, second signal, SIGQUIT): requests still running are
  cancelled — a client whose response had not started gets a 503 with ``Connection:
  close`` — connections are closed and ``on_cleanup`` runs, all before the kill deadline.

The pieces
----------
``setup`` installs the request side on an application: ``Middleware`` (counts
requests and websocket sessions, nudges returned responses, closes websockets with 1001,
answers a cut request with 503), an ``on_response_prepare`` hook (nudges responses the
handler prepared itself: streams, file responses, ``HTTPException``), the health routes
and ``DRAIN_SIGNAL_KEY``.  ``AppRunner`` — a drop-in for
``aiohttp.web.AppRunner`` — adds the connection side: it counts connections from the
kernel's hand-over, closes its sites' listeners at *draining* without resetting their
backlog (``graceful._listeners``), closes idle keep-alive connections, and runs
``on_shutdown`` and ``on_cleanup`` at the moments above.  ``run_app`` is
``aiohttp.web.run_app`` built from the two.

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
* The ``aiohttp.web.Server`` the runner creates is given a subclass that overrides
  two *public* methods (``__call__`` and ``connection_lost``): its class is switched
  after aiohttp built it, as ``graceful._listeners`` does for listening sockets,
  because ``AppRunner`` offers no way to choose the class.
No aiohttp module or class is patched.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import inspect
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, cast

import anyio
from aiohttp import WSCloseCode, hdrs, web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.log import access_logger
from aiohttp.typedefs import PathLike
from aiohttp.web_log import AccessLogger
from aiohttp.web_protocol import RequestHandler
from typing_extensions import final

from . import _logging
from ._coordinator import ShutdownCoordinator
from ._listeners import Handovers, close_keeping_backlog, count_accepts
from ._policy import Phase, Policy, _check_readiness_on_shutdown, _check_seconds
from ._shape import ServerShape
from ._signals import (
    teardown_guard,
)
from ._tracking import is_probe
from .asgi import DrainSignal

__all__ = (
    "DRAIN_SIGNAL_KEY",
    "AppRunner",
    "DrainSignal",
    "Middleware",
    "drain_signal",
    "load_app",
    "run_app",
    "serve_target",
    "setup",
)

logger = logging.getLogger("graceful")

#: Where ``setup`` puts the ``graceful.asgi.DrainSignal``:
#: ``request.config_dict[DRAIN_SIGNAL_KEY]`` (also from sub-applications).
DRAIN_SIGNAL_KEY: Final = web.AppKey("graceful.drain_signal", DrainSignal)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CUT_SEND_S: Final = 1.0  # the longest a cut request's 503 may take to send
_WS_CLOSE_WAIT_S: Final = 1.0  # how long a closing handshake may finish after the handler
_RECHECK_S: Final = 0.25  # draining: how often a busy connection is checked for idleness
_PREPARE_TRIES: Final = 100  # loop iterations a websocket handshake may take to finish


class _RequestState:
    """What the middleware and the prepare hook share about one request."""

    __slots__ = ("closing", "ready", "started", "websocket")

    def __init__(self, ready: asyncio.Event | None = None) -> None:
        self.started = False  # the response (headers) went out, or is going out
        self.websocket: web.WebSocketResponse | None = None
        self.ready = ready  # websocket requests: set when the handshake is prepared
        self.closing = False  # the middleware sent the websocket's 1001


# The prepare hook runs in the request's task (or a child of it): a context variable finds
# the request's state however the handler cloned or wrapped the request.
_STATE: contextvars.ContextVar[_RequestState | None] = contextvars.ContextVar(
    "graceful_aiohttp_request", default=None
)


def _check_path(name: str, value: str | None) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.startswith("/")):
        raise ValueError(f"{name} must be a path starting with '/' or None, got {value!r}")
    return value


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text)


@final
class Middleware:
    """An aiohttp middleware that reports to and obeys a coordinator.

    Prefer ``setup``, which also installs ``on_response_prepare`` (without it a
    response the handler prepared itself is not nudged) and the health routes.

    * HTTP requests count as in-flight requests; a returned response gets ``Connection:
      close`` while the coordinator nudges.
    * Websocket upgrades count as sessions; once draining began the app has
      ``websocket_close_grace_s`` to close by itself, then the middleware closes with
      ``WSCloseCode.GOING_AWAY`` (1001).
    * ``cut`` (the ``AppRunner`` calls it when stopping) cancels what still runs;
      a request whose response had not started gets a 503 with ``Connection: close``,
      sent shielded and bounded, and the cancellation is re-raised.

    Args:
        coordinator: The process's coordinator.
        websocket_close_grace_s: How long a websocket may stay open after draining began
            before it is closed with 1001.
    """

    __middleware_version__: Final = 1  # aiohttp's marker of a new-style middleware

    def __init__(
        self,
        coordinator: ShutdownCoordinator,
        *,
        websocket_close_grace_s: float = 1.0,
        readiness_on_shutdown: str = "fail",
    ) -> None:
        if not isinstance(coordinator, ShutdownCoordinator):
            raise TypeError(f"coordinator must be a ShutdownCoordinator, got {coordinator!r}")
        _check_seconds("websocket_close_grace_s", websocket_close_grace_s)
        #: ``"fail"`` or ``"keep"``: see ``graceful.asgi.GracefulMiddleware``.
        self.readiness_on_shutdown = _check_readiness_on_shutdown(readiness_on_shutdown)
        self.coordinator: Final = coordinator
        self.websocket_close_grace_s = float(websocket_close_grace_s)
        #: Route handlers that are not counted as requests (the health endpoints).
        self.uncounted: set[Callable[..., object]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._request_started = coordinator.request_started
        self._request_finished = coordinator.request_finished
        self._nudging = coordinator.nudging
        # Probes are not traffic (graceful._tracking): while accepting, each
        # connection's first request says whether it counts as activity.
        coordinator.classify_connections()
        self._classifying = False
        coordinator.subscribe(self._on_phase)

    def _on_phase(self, phase: Phase) -> None:
        self._nudging = self.coordinator.nudging
        self._classifying = phase is Phase.ACCEPTING

    def _first_request(self, request: web.Request) -> None:
        probe = request.match_info.handler in self.uncounted or is_probe(
            request.headers.get(hdrs.USER_AGENT)
        )
        transport = request.transport
        peer = None if transport is None else transport.get_extra_info("peername")
        key = tuple(peer[:2]) if isinstance(peer, tuple) else None
        self.coordinator.first_request(key, probe=probe)

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._classifying:
            self._first_request(request)
        if self.uncounted and request.match_info.handler in self.uncounted:
            return await handler(request)
        if request.headers.get(hdrs.UPGRADE, "").lower() == "websocket":
            return await self._websocket(request, handler)
        c = self.coordinator
        state = _RequestState()
        token = _STATE.set(state)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        sampled = self._request_started()
        try:
            response = await handler(request)
            if self._nudging and isinstance(response, web.StreamResponse) and not response.prepared:
                response.force_close()
            return response
        except asyncio.CancelledError:
            if c.cutting and not _started(request, state):
                await self._cut(request)
            raise
        finally:
            self._request_finished(sampled)
            if task is not None:
                self._tasks.discard(task)
            _STATE.reset(token)

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """For ``app.on_response_prepare``: nudge responses prepared by the handler.

        aiohttp computes the ``Connection`` header before this signal runs, so the
        header is set here as well as the response's keep-alive flag (which makes the
        server close the connection after the response).
        """
        state = _STATE.get()
        if isinstance(response, web.WebSocketResponse):
            if state is not None:
                state.started = True
                state.websocket = response
                if state.ready is not None:
                    state.ready.set()
            return
        if state is not None:
            state.started = True
        if self._nudging and response.keep_alive:
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    async def cut(self, *, timeout_s: float) -> None:
        """Cancel the requests and sessions still running; wait ``timeout_s`` for them."""
        tasks = [t for t in self._tasks if not t.done()]
        if not tasks:
            return
        logger.warning("cutting %d request(s) still running", len(tasks))
        for task in tasks:
            task.cancel(msg="graceful: stopping")
        await asyncio.wait(tasks, timeout=max(timeout_s, 0.001))

    async def _cut(self, request: web.Request) -> None:
        """Answer a request cancelled while stopping with 503 + ``Connection: close``.

        Shielded from the cancellation being delivered, bounded by the time stopping has
        left; the caller re-raises the cancellation (then aiohttp closes the connection).
        """
        c = self.coordinator
        logger.warning("request %s cut: %s", request.path, c.statistics().reason)
        d = c.deadlines
        limit = c.time_left_s(None if d is None else d.exit_by, at_most_s=_CUT_SEND_S)
        with anyio.CancelScope(shield=True), anyio.move_on_after(limit):
            try:
                response = web.Response(
                    status=503, text="server shutting down\n", headers={"Retry-After": "0"}
                )
                response.force_close()
                await response.prepare(request)
                await response.write_eof()
            except Exception:  # the client is gone: nothing to do
                logger.debug("could not answer the cut request %s", request.path)

    # ----------------------------------------------------------------- websockets

    async def _websocket(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        c = self.coordinator
        state = _RequestState(ready=asyncio.Event())
        drain = asyncio.Event()
        token = _STATE.set(state)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        closer = asyncio.ensure_future(self._close_going_away(request, state, drain))
        try:
            with c.track_session(drain.set):
                try:
                    return await handler(request)
                except asyncio.CancelledError:
                    if c.cutting and not _started(request, state):
                        await self._cut(request)
                    raise
                finally:
                    if state.closing and not closer.done():
                        # Our close frame is out: let the closing handshake finish.
                        await asyncio.wait((closer,), timeout=_WS_CLOSE_WAIT_S)
        finally:
            closer.cancel()
            if task is not None:
                self._tasks.discard(task)
            _STATE.reset(token)

    async def _close_going_away(
        self, request: web.Request, state: _RequestState, drain: asyncio.Event
    ) -> None:
        """Once draining began and the grace passed, close the websocket with 1001.

        ``drain`` is set by the session's ``on_drain`` (which may run from a loop
        callback, so it only signals); the grace is cut short when stopping begins.
        """
        c = self.coordinator
        await drain.wait()
        await c.wait_for_phase(Phase.STOPPING, timeout_s=self.websocket_close_grace_s)
        assert state.ready is not None
        await state.ready.wait()
        ws = state.websocket
        assert ws is not None
        # The prepare hook runs before the handshake's last step (the websocket writer);
        # closing earlier raises RuntimeError("Call .prepare() first").
        for _ in range(_PREPARE_TRIES):
            if ws.closed:
                return
            try:
                state.closing = True
                await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
                return
            except RuntimeError:
                state.closing = False
                await asyncio.sleep(0)
            except Exception:  # the connection went away meanwhile
                logger.debug("could not close websocket %s with 1001", request.path)
                return

    # --------------------------------------------------------------------- health

    def _respond(self, status: int, text: str) -> web.Response:
        response = _text(status, text)
        if self.coordinator.nudging:
            response.force_close()
        return response

    async def readiness(self, request: web.Request) -> web.Response:
        """200 while serving, 503 from the moment shutdown is requested (with
        ``readiness_on_shutdown="keep"``: from draining on)."""
        c = self.coordinator
        if c.shutdown_requested and (self.readiness_on_shutdown == "fail" or not c.accepting):
            return self._respond(503, f"shutting down ({c.phase})\n")
        return self._respond(200, "ready\n")

    async def liveness(self, request: web.Request) -> web.Response:
        """200 until stopped."""
        c = self.coordinator
        if c.phase is Phase.STOPPED:
            return self._respond(503, "stopped\n")
        return self._respond(200, f"alive ({c.phase})\n")

    async def prestop(self, request: web.Request) -> web.Response:
        """Request shutdown; answer once the drain is done (or at its deadline)."""
        c = self.coordinator
        c.request_shutdown("preStop", escalate=False)
        # The asking connection stays open, so wait for requests and sessions only.
        await c.wait_for_phase(Phase.DRAINING)
        await c.wait_drained(include_connections=False)
        s = c.statistics()
        return self._respond(200, f"{s.phase}: {s.requests} requests, {s.sessions} sessions left\n")


def _started(request: web.Request, state: _RequestState) -> bool:
    if state.started:
        return True
    try:
        return request.writer.output_size > 0
    except (AttributeError, RuntimeError):
        return False


_MIDDLEWARE_KEY: Final = web.AppKey("graceful.middleware", Middleware)


def setup(
    app: web.Application,
    *,
    coordinator: ShutdownCoordinator,
    readiness_path: str | None = "/readyz",
    liveness_path: str | None = "/livez",
    prestop_path: str | None = None,
    websocket_close_grace_s: float = 1.0,
    metrics_path: str | None = None,
    readiness_on_shutdown: str = "fail",
) -> Middleware:
    """Install graceful's request side on ``app`` (before it starts).

    Adds ``Middleware`` as the outermost middleware (or reuses one already in
    ``app.middlewares``), its ``on_response_prepare`` hook, the health routes and
    ``DRAIN_SIGNAL_KEY``.  Calling it again returns the same middleware.

    Args:
        app: The (root) application.
        coordinator: The process's coordinator.
        readiness_path: Readiness route (``None``: none): 200 while serving, 503 once
            shutdown was requested.
        liveness_path: Liveness route (``None``: none): 200 until stopped.
        prestop_path: preStop route (``None``: none, the default — anyone who can reach
            it can stop the server): requests shutdown and answers once drained, for
            Kubernetes ``lifecycle.preStop.httpGet``.
        websocket_close_grace_s: See ``Middleware``.
        metrics_path: Prometheus metrics route (``None``: none, the default): the
            coordinator's metrics and everything else in ``prometheus_client``'s
            registry, see ``graceful.metrics`` (needs ``graceful-drain[metrics]``).
        readiness_on_shutdown: ``"fail"`` or ``"keep"``: see
            ``graceful.asgi.GracefulMiddleware``.

    Raises:
        ValueError: if ``app`` was set up with another coordinator, or for a bad path.
        RuntimeError: if ``app`` is already frozen (started).
    """
    existing = app.get(_MIDDLEWARE_KEY)
    if existing is not None:
        if existing.coordinator is not coordinator:
            raise ValueError("the application was set up with another coordinator")
        return existing
    paths = {
        "readiness_path": _check_path("readiness_path", readiness_path),
        "liveness_path": _check_path("liveness_path", liveness_path),
        "prestop_path": _check_path("prestop_path", prestop_path),
        "metrics_path": _check_path("metrics_path", metrics_path),
    }
    used = [p for p in paths.values() if p is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"health paths must differ, got {paths!r}")
    if app.frozen:
        raise RuntimeError("graceful.aiohttp.setup() must run before the application starts")
    middleware = next(
        (m for m in app.middlewares if isinstance(m, Middleware)),
        None,
    )
    if middleware is None:
        middleware = Middleware(
            coordinator,
            websocket_close_grace_s=websocket_close_grace_s,
            readiness_on_shutdown=readiness_on_shutdown,
        )
        app.middlewares.insert(0, middleware)
    elif middleware.coordinator is not coordinator:
        raise ValueError("the application's graceful Middleware has another coordinator")
    if middleware.on_response_prepare not in app.on_response_prepare:
        app.on_response_prepare.append(middleware.on_response_prepare)
    for name, path, handler in (
        ("readiness", paths["readiness_path"], middleware.readiness),
        ("liveness", paths["liveness_path"], middleware.liveness),
        ("prestop", paths["prestop_path"], middleware.prestop),
        ("metrics", paths["metrics_path"], _metrics_handler(middleware, metrics_path)),
    ):
        if path is not None and handler is not None:
            app.router.add_get(path, handler, name=f"graceful-{name}")
            middleware.uncounted.add(handler)
    app[DRAIN_SIGNAL_KEY] = DrainSignal(coordinator)
    app[_MIDDLEWARE_KEY] = middleware
    return middleware


def _metrics_handler(middleware: Middleware, path: str | None) -> Handler | None:
    """The metrics route's handler; ``graceful.metrics`` (and prometheus_client) is
    imported only when the route is wanted."""
    if path is None:
        return None
    from . import metrics

    exposition = metrics.Exposition(middleware.coordinator)

    async def serve_metrics(request: web.Request) -> web.StreamResponse:
        status, body, content_type = await exposition.render_retrying(
            request.headers.get(hdrs.ACCEPT, ""), request.query.getall("name[]", [])
        )
        response = web.Response(status=status, body=body, headers={hdrs.CONTENT_TYPE: content_type})
        if middleware.coordinator.nudging:
            response.force_close()
        return response

    return serve_metrics


def drain_signal(request: web.BaseRequest) -> DrainSignal | None:
    """The ``graceful.asgi.DrainSignal`` of ``request``'s application chain, or
    ``None`` if ``setup`` did not run on it."""
    config = getattr(request, "config_dict", None)
    if config is None:
        return None
    found = config.get(DRAIN_SIGNAL_KEY)
    return found if isinstance(found, DrainSignal) else None


# ------------------------------------------------------------------- the runner


class _TrackingServer(web.Server):
    """aiohttp's protocol factory, reporting each connection to its ``AppRunner``.

    Only public methods of ``aiohttp.web.Server`` are overridden: ``__call__`` (a
    connection's protocol is created) and ``connection_lost``.  Instances are
    never constructed: the runner switches the class of the server aiohttp built.
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
        )
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

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        self._loop = asyncio.get_running_loop()
        server.__class__ = _TrackingServer
        tracking = cast(_TrackingServer, server)
        tracking._graceful_runner = self
        return tracking

    def adopt_sites(self) -> None:
        """Count accepts on every started site's listener (and close it at once if the
        drain began already).  Idempotent; called at every phase change."""
        late: list[tuple[asyncio.AbstractServer, Any]] = []
        for site in self.sites:
            server = getattr(site, "_server", None)  # aiohttp: the site's asyncio.Server
            if not isinstance(server, asyncio.AbstractServer) or site in self._adopted:
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
    """The phases and stopping for aiohttp (``graceful._shape``): the runner's adopted
    sites, its connections (aiohttp's request handlers), ``on_shutdown`` and the
    middleware's cut.  ``on_cleanup`` is a stopping step of its own, the last."""

    def __init__(self, runner: AppRunner) -> None:
        super().__init__(runner.coordinator, idle_grace_s=runner.idle_grace_s)
        self.runner = runner

    def on_phase(self, phase: Phase) -> None:
        self.runner.adopt_sites()  # sites started since the last phase change
        super().on_phase(phase)

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
        await self.runner.middleware.cut(timeout_s=timeout_s)

    def close_connections(self) -> None:
        for handler in list(self.runner._open):
            handler.force_close()


# ------------------------------------------------------------------- run_app


async def _never() -> None:
    await asyncio.Event().wait()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _make_sites(
    runner: web.BaseRunner,
    *,
    host: str | Iterable[str] | None,
    port: int | None,
    path: PathLike | Iterable[PathLike] | None,
    sock: socket.socket | Iterable[socket.socket] | None,
    ssl_context: Any,
    backlog: int,
    reuse_address: bool | None,
    reuse_port: bool | None,
) -> list[web.BaseSite]:
    """The sites ``aiohttp.web.run_app`` would make for these arguments."""
    sites: list[web.BaseSite] = []
    tcp = {
        "ssl_context": ssl_context,
        "backlog": backlog,
        "reuse_address": reuse_address,
        "reuse_port": reuse_port,
    }
    if host is not None:
        hosts = [host] if isinstance(host, str) else list(host)
        sites.extend(web.TCPSite(runner, h, port, **tcp) for h in hosts)
    elif (path is None and sock is None) or port is not None:
        sites.append(web.TCPSite(runner, port=port, **tcp))
    if path is not None:
        paths = [path] if isinstance(path, (str, bytes)) or hasattr(path, "__fspath__") else path
        for p in cast(Iterable[PathLike], paths):
            sites.append(web.UnixSite(runner, p, ssl_context=ssl_context, backlog=backlog))
    if sock is not None:
        socks = [sock] if isinstance(sock, socket.socket) or hasattr(sock, "fileno") else sock
        for s in cast(Iterable[socket.socket], socks):
            sites.append(web.SockSite(runner, s, ssl_context=ssl_context, backlog=backlog))
    return sites


async def _serve(
    app: web.Application | Awaitable[web.Application],
    coordinator: ShutdownCoordinator,
    *,
    handle_signals: bool,
    print: Callable[..., None] | None,
    sites: dict[str, Any],
    runner_options: dict[str, Any],
) -> None:
    if inspect.isawaitable(app):
        app = await app
    if not isinstance(app, web.Application):
        raise TypeError(f"expected an aiohttp.web.Application, got {app!r}")
    runner = AppRunner(app, coordinator=coordinator, **runner_options)
    await runner.setup()
    try:
        for site in _make_sites(runner, **sites):
            await site.start()
        runner.adopt_sites()
        names = sorted(str(s.name) for s in runner.sites)
        if print is not None:  # aiohttp's banner, as web.run_app prints it
            print(
                "======== Running on {} ========\n(Press CTRL+C to quit)".format(", ".join(names))
            )
        else:
            for name in names:
                logger.info("aiohttp running on %s", name)
        await coordinator.run(shutdown_trigger=None if handle_signals else _never)
    finally:
        await runner.cleanup()
    if coordinator.phase is Phase.STOPPED:
        coordinator.exit_soon()


def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception during run_app() shutdown",
                    "exception": task.exception(),
                    "task": task,
                }
            )


def run_app(
    app: web.Application | Awaitable[web.Application],
    *,
    coordinator: ShutdownCoordinator | None = None,
    policy: Policy | None = None,
    host: str | Iterable[str] | None = None,
    port: int | None = None,
    path: PathLike | Iterable[PathLike] | None = None,
    sock: socket.socket | Iterable[socket.socket] | None = None,
    shutdown_timeout: float = 60.0,
    keepalive_timeout: float = 75.0,
    ssl_context: Any = None,
    print: Callable[..., None] | None = print,
    backlog: int = 128,
    access_log_class: type[AbstractAccessLogger] = AccessLogger,
    access_log_format: str = AccessLogger.LOG_FORMAT,
    access_log: logging.Logger | None = access_logger,
    handle_signals: bool = True,
    reuse_address: bool | None = None,
    reuse_port: bool | None = None,
    handler_cancellation: bool = False,
    loop: asyncio.AbstractEventLoop | None = None,
    idle_grace_s: float = 1.0,
    readiness_path: str | None = "/readyz",
    liveness_path: str | None = "/livez",
    prestop_path: str | None = None,
    websocket_close_grace_s: float = 1.0,
    metrics_path: str | None = None,
    readiness_on_shutdown: str = "fail",
    **kwargs: Any,
) -> None:
    """Like ``aiohttp.web.run_app``, with graceful shutdown.

    The parameters are aiohttp's, except:

    Args:
        coordinator: The process's coordinator; by default a new one with ``policy``
            and ``drain_timeout_s=shutdown_timeout``.
        policy: When accepting ends (only without ``coordinator``).
        shutdown_timeout: The longest drain (the coordinator's ``drain_timeout_s``),
            itself bounded by the kill deadline; ignored with ``coordinator``.
        handle_signals: ``True``: SIGTERM and SIGINT request shutdown (a second one
            escalates), SIGQUIT stops at once; the previous handlers are restored on
            return.  ``False``: shutdown only through the coordinator's API (or the
            preStop route).
        idle_grace_s: See ``AppRunner``.
        readiness_path: See ``setup``.
        liveness_path: See ``setup``.
        prestop_path: See ``setup``.
        websocket_close_grace_s: See ``setup``.
        metrics_path: See ``setup``.
        readiness_on_shutdown: See ``setup``.
        kwargs: Passed to the ``AppRunner`` (and on to aiohttp's request handler).

    graceful's own lines (the policy, the phases) go to standard error unless the
    application configured logging (a handler on the ``graceful`` or the root logger).
    """
    if coordinator is not None and policy is not None:
        raise ValueError("pass either coordinator= or policy=, not both")
    if coordinator is None:
        coordinator = ShutdownCoordinator(
            policy=policy, drain_timeout_s=_check_seconds("shutdown_timeout", shutdown_timeout)
        )
    if loop is None:
        loop = asyncio.new_event_loop()
    # graceful's phase lines on standard error, unless the application configured logging.
    _logging.to_stderr()
    # As aiohttp: configure the access log in debug mode only, and only the default one.
    if loop.get_debug() and access_log is not None and access_log.name == "aiohttp.access":
        if access_log.level == logging.NOTSET:
            access_log.setLevel(logging.DEBUG)
        if not access_log.hasHandlers():
            access_log.addHandler(logging.StreamHandler())
    main_task = loop.create_task(
        _serve(
            app,
            coordinator,
            handle_signals=handle_signals,
            print=print,
            sites={
                "host": host,
                "port": port,
                "path": path,
                "sock": sock,
                "ssl_context": ssl_context,
                "backlog": backlog,
                "reuse_address": reuse_address,
                "reuse_port": reuse_port,
            },
            runner_options={
                "idle_grace_s": idle_grace_s,
                "readiness_path": readiness_path,
                "liveness_path": liveness_path,
                "prestop_path": prestop_path,
                "websocket_close_grace_s": websocket_close_grace_s,
                "metrics_path": metrics_path,
                "readiness_on_shutdown": readiness_on_shutdown,
                "keepalive_timeout": keepalive_timeout,
                "access_log_class": access_log_class,
                "access_log_format": access_log_format,
                "access_log": access_log,
                "handler_cancellation": handler_cancellation,
                **kwargs,
            },
        )
    )
    # Signals are recorded before the coordinator runs and after it ran, until the loop
    # is closed: the teardown (cleanup, cancelling left-over tasks) is no place for a
    # shutdown signal's default action.
    with teardown_guard(lambda: coordinator.shutdown_requested, enabled=handle_signals):
        try:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(main_task)
        except (web.GracefulExit, KeyboardInterrupt):
            pass
        finally:
            try:
                if not main_task.done():
                    main_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        loop.run_until_complete(main_task)
            finally:
                _cancel_tasks(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()


# ---------------------------------------------------------------------- targets


def load_app(target: str) -> web.Application | Awaitable[web.Application]:
    """Import ``MODULE:APP``: an ``aiohttp.web.Application``, or a factory (sync or
    async, without arguments) returning one.

    A factory is called here; an async one's coroutine is returned for ``run_app``
    to await in its event loop.

    Raises:
        ValueError: if ``target`` is not ``MODULE:APP`` or ``APP`` is missing.
        TypeError: if ``APP`` is neither an application nor a factory.
    """
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"MODULE:APP must look like 'package.module:app', got {target!r}")
    module = importlib.import_module(module_name)
    try:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, web.Application):
        return obj
    if callable(obj):
        result = obj()
        if isinstance(result, web.Application) or inspect.isawaitable(result):
            return cast("web.Application | Awaitable[web.Application]", result)
        raise TypeError(f"{target} returned {result!r}, not an aiohttp.web.Application")
    raise TypeError(f"{target} is {obj!r}, not an aiohttp.web.Application or a factory")


def serve_target(target: str, **options: Any) -> None:
    """Import ``MODULE:APP`` (see ``load_app``) and serve it with ``run_app``
    (``options`` are its keyword arguments)."""
    run_app(load_app(target), **options)
