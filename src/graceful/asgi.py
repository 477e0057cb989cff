"""Pure ASGI middleware: tracks requests and sessions, nudges clients, serves health checks.

::

    coordinator = graceful.ShutdownCoordinator()
    app = GracefulMiddleware(app, coordinator=coordinator)
    # Starlette:  Middleware(GracefulMiddleware, coordinator=coordinator)
    # FastAPI:    app.add_middleware(GracefulMiddleware, coordinator=coordinator)

``http`` scopes count as in-flight requests, and HTTP/1.x responses get ``Connection:
close`` while the coordinator nudges (never on HTTP/2 or 3, where the server sends
GOAWAY); ``websocket`` scopes count as sessions, closed with 1001 once draining has
lasted ``websocket_close_grace_s``; ``lifespan`` passes through, readiness answering 503
until startup completed.  Streaming handlers find the ``DrainSignal`` with
``drain_signal(scope)`` (the lifespan ``state`` servers copy into every request's scope,
and ``scope["extensions"]["graceful"]``, deprecated for direct reading).

Health endpoints (``None`` disables one): readiness (``/readyz``: 200 while serving, 503
from the shutdown request on), liveness (``/livez``: 200 until stopped), metrics (off:
``graceful.metrics``), preStop (off: requests shutdown and answers once drained, for
``lifecycle.preStop.httpGet`` — anyone who can reach it can stop the server, so serve it
with ``management_port``, on a port the Service and the ingress do not expose:
``graceful._core.management``).  docs/asgi.md has the details.

Health and metrics requests are not counted as in-flight requests.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import anyio
from typing_extensions import final

from ._core import health as _health
from ._core.coordinator import ShutdownCoordinator, _check_coordinator
from ._core.drain_signal import DrainSignal
from ._core.drain_signal import in_scope as drain_signal
from ._core.management import Management, check_management
from ._core.policy import Phase, _check_readiness_on_shutdown, _check_seconds
from ._core.tracking import is_probe

__all__ = ("DrainSignal", "GracefulMiddleware", "drain_signal")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("graceful")

_CLOSE: Final = (b"connection", b"close")
_TEXT: Final = [(b"content-type", b"text/plain; charset=utf-8")]
_CUT_SEND_S: Final = 1.0  # the longest a cut request's 503 may take to send
#: How long after lifespan startup the coordinator must run, or a warning says it does not.
RUN_CHECK_S: Final = 1.0


def _with_connection_close(message: Message) -> Message:
    """``http.response.start`` with any connection header replaced by ``close``."""
    headers = [
        (k, v)
        for k, v in message.get("headers", ())
        if k.lower() not in (b"connection", b"keep-alive")
    ]
    headers.append(_CLOSE)
    return {**message, "headers": headers}


#: The middleware's options: its keyword arguments besides ``app`` and ``coordinator``,
#: which ``graceful.uvicorn.Server`` and ``graceful.hypercorn.serve`` pass on to it.
OPTIONS: Final = (
    "readiness_path",
    "liveness_path",
    "prestop_path",
    "websocket_close_grace_s",
    "metrics_path",
    "readiness_on_shutdown",
    "management_port",
    "management_host",
    "health_on_app_port",
)


def check_options(caller: str = "GracefulMiddleware", /, **options: Any) -> None:
    """Check the middleware's options as ``GracefulMiddleware`` does, without building
    one: for servers that take them now and build the middleware when they serve.

    Raises:
        TypeError: an unknown option, or a value of the wrong type.
        ValueError: a bad value (a path not starting with ``/``, a negative grace, two
            endpoints on one path); the message names the option and the value.
    """
    for name in options:
        if name not in OPTIONS:
            raise TypeError(
                f"{caller}() got an unexpected keyword argument {name!r} (the middleware's "
                f"options are {', '.join(OPTIONS)})"
            )
    defaults = inspect.signature(GracefulMiddleware).parameters
    options = {name: options.get(name, defaults[name].default) for name in OPTIONS}
    _check_seconds("websocket_close_grace_s", options["websocket_close_grace_s"])
    _check_readiness_on_shutdown(options["readiness_on_shutdown"])
    check_management(
        options["management_port"], options["management_host"], options["health_on_app_port"]
    )
    names = ("readiness_path", "liveness_path", "prestop_path", "metrics_path")
    _health.check_paths({name: options[name] for name in names})


def _check_app(app: object) -> None:
    if not callable(app):
        raise TypeError(f"app must be an ASGI application (a callable), got {app!r}")


@final
class GracefulMiddleware:
    """ASGI middleware that reports to and obeys a ``graceful.ShutdownCoordinator``.

    Args:
        app: The ASGI application.
        coordinator: The process's coordinator.
        readiness_path: Readiness endpoint (``None``: none).
        liveness_path: Liveness endpoint (``None``: none).
        prestop_path: preStop endpoint (``None``: none; see the module docs).
        metrics_path: Prometheus metrics endpoint (``None``: none), served by
            ``graceful.metrics.asgi_app`` from the default registry (needs the
            ``metrics`` extra, ``prometheus-client``; see ``graceful.metrics``).
        websocket_close_grace_s: How long a websocket may stay open after draining began
            before the middleware closes it with code 1001.
        readiness_on_shutdown: ``"fail"``: readiness answers 503 from the shutdown
            request on (health-checking load balancers deprogram the pod); ``"keep"``:
            200 while still accepting, 503 from draining on (the pod stays ``serving``
            in its EndpointSlice, so kube-proxy's fallback to terminating endpoints
            still routes here when no other endpoint is ready, KEP-1669).
        management_port: Serve the four endpoints on a listener of their own on this
            port (``graceful._core.management``), not on the app's: while the
            coordinator runs, closed last.
        management_host: The management listener's address.
        health_on_app_port: With ``management_port``: answer the endpoints on the app's
            port too.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        coordinator: ShutdownCoordinator,
        readiness_path: str | None = "/readyz",
        liveness_path: str | None = "/livez",
        prestop_path: str | None = None,
        websocket_close_grace_s: float = 1.0,
        metrics_path: str | None = None,
        readiness_on_shutdown: str = "fail",
        management_port: int | None = None,
        management_host: str = "127.0.0.1",
        health_on_app_port: bool = False,
    ) -> None:
        _check_app(app)
        _check_coordinator(coordinator)
        check_options(
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
        self.readiness_on_shutdown: Final = readiness_on_shutdown
        self.app = app
        self.coordinator = coordinator
        self.websocket_close_grace_s = float(websocket_close_grace_s)
        self._health: dict[str, ASGIApp] = {}
        renderer = None
        if management_port is not None and metrics_path is not None:
            from . import metrics as _metrics  # the metrics extra, only when asked for

            renderer = _metrics.Exposition(coordinator).render_retrying
        #: The management listener (``management_port``), or ``None``.
        self.management: Final = Management.for_options(
            coordinator,
            port=management_port,
            host=management_host,
            paths=(readiness_path, liveness_path, prestop_path, metrics_path),
            readiness_on_shutdown=readiness_on_shutdown,
            starting=lambda: self._lifespan_seen and not self._started,
            metrics=renderer,
        )
        if self.management is not None and not health_on_app_port:
            readiness_path = liveness_path = prestop_path = metrics_path = None
        metrics: ASGIApp | None = None
        if metrics_path is not None:
            from . import metrics as _metrics  # the metrics extra, only when asked for

            metrics = _metrics.asgi_app(coordinator)
        for path, handler in (
            (readiness_path, self._readiness),
            (liveness_path, self._liveness),
            (prestop_path, self._prestop),
            (metrics_path, metrics),
        ):
            if path is not None:
                assert handler is not None
                self._health[path] = handler
        self._signal = DrainSignal(coordinator)
        #: Each health (and metrics) path's handler (read-only; hot-path servers send here).
        self.health_endpoints: Final = self._health
        #: The ``DrainSignal`` put in every request's scope.
        self.drain_signal: Final = self._signal
        self._request_started = coordinator.request_started
        self._request_finished = coordinator.request_finished
        # Probes are not traffic (graceful._core.tracking): while accepting, each
        # connection's first request says whether it counts as activity.
        coordinator.classify_connections()
        self._classifying = False
        # The hot path reads our own copy of the coordinator's nudging flag, kept
        # current by a phase listener (a property read per response costs more).
        self._nudging = coordinator.nudging
        coordinator.subscribe(self._on_phase)
        self._lifespan_seen = False
        self._started = False
        self._run_checked = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if self._classifying:
            self._first_request(scope)
        if kind == "http":
            if scope["path"] in self._health:
                await self._health[scope["path"]](scope, receive, send)
                return
            if "extensions" in scope and scope["extensions"] is not None:
                scope["extensions"]["graceful"] = self._signal  # the server's dict
            else:
                scope["extensions"] = {"graceful": self._signal}
            # The hot path, kept flat.  The send wrapper is needed even while serving: a
            # request that started before SIGTERM must still nudge its client, and a cut
            # request must know whether its response started.
            started = False

            async def wrapped_send(message: Message) -> None:
                nonlocal started
                if not started and message["type"] == "http.response.start":
                    started = True
                    if self._nudging and scope.get("http_version", "1.1") not in ("2", "3"):
                        message = _with_connection_close(message)
                await send(message)

            sampled = self._request_started()
            try:
                await self.app(scope, receive, wrapped_send)
            except BaseException as exc:
                if (
                    not started
                    and self.coordinator.cutting
                    and isinstance(exc, anyio.get_cancelled_exc_class())
                ):
                    await self.cut(scope, send)
                raise
            finally:
                self._request_finished(sampled)
        elif kind == "websocket":
            self._add_extension(scope)
            await self._websocket(scope, receive, send)
        elif kind == "lifespan":
            state = scope.get("state")
            if state is not None:  # servers copy it into every request's scope
                state["graceful"] = self._signal
            await self.app(scope, self._observe_lifespan(receive), self._observe_send(send))
        else:
            await self.app(scope, receive, send)

    def _on_phase(self, phase: Phase) -> None:
        self._nudging = self.coordinator.nudging
        self._classifying = phase is Phase.ACCEPTING

    def _first_request(self, scope: Scope) -> None:
        """While accepting: tell the coordinator whether this request's connection is
        traffic or a probe (only its first request counts)."""
        probe = scope["type"] == "http" and scope["path"] in self._health
        if not probe:
            for name, value in scope.get("headers") or ():
                if name == b"user-agent":
                    probe = is_probe(value)
                    break
        client = scope.get("client")
        self.coordinator.first_request(tuple(client) if client else None, probe=probe)

    def _add_extension(self, scope: Scope) -> None:
        extensions = scope.get("extensions")
        if extensions is None:
            scope["extensions"] = {"graceful": self._signal}
        else:
            extensions["graceful"] = self._signal

    async def cut(self, scope: Scope, send: Send) -> None:
        """A request cancelled while stopping (drain deadline, escalation) whose
        response had not started: answer 503 with ``Connection: close`` rather than a
        500 or nothing.  The send runs shielded from the cancellation being delivered
        (an anyio scope would cancel it again at once) and bounded by the time stopping
        has left; the caller re-raises the cancellation."""
        c = self.coordinator
        logger.warning("request %s cut: %s", scope.get("path"), c.statistics().reason)
        d = c.deadlines
        limit = c.time_left_s(None if d is None else d.exit_by, at_most_s=_CUT_SEND_S)
        with anyio.CancelScope(shield=True), anyio.move_on_after(limit):
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 503,
                        "headers": [*_TEXT, _CLOSE, (b"retry-after", b"0")],
                    }
                )
                await send({"type": "http.response.body", "body": _health.CUT_BODY})
            except Exception:  # the client is gone, or the server refuses: nothing to do
                logger.debug("could not answer the cut request %s", scope.get("path"))

    # ----------------------------------------------------------------- websockets

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run a websocket session; close it with 1001 once draining asks it to end.

        ``on_drain`` may run from an event-loop callback (a signal escalating to
        stopping), so it only sets an event; the closer is a task of our own.  The app
        runs in the task group's body but its exception is re-raised as itself, not as
        an ``ExceptionGroup``.  After the client disconnected nothing more is sent.
        """
        c = self.coordinator
        closed = False  # we sent a close, or the client is gone
        drain = anyio.Event()

        async def tracking_receive() -> Message:
            nonlocal closed
            message = await receive()
            if message["type"] == "websocket.disconnect":
                closed = True
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal closed
            if message["type"] in ("websocket.close", "websocket.http.response.start"):
                if closed:
                    return
                closed = True
            await send(message)

        async def close_going_away() -> None:
            await drain.wait()
            # The grace to finish by itself, cut short when stopping begins.
            await c.wait_for_phase(Phase.STOPPING, timeout_s=self.websocket_close_grace_s)
            if closed:
                return
            try:
                await tracking_send(
                    {"type": "websocket.close", "code": 1001, "reason": "server shutting down"}
                )
            except Exception:  # the connection went away meanwhile
                logger.debug("could not close websocket %s with 1001", scope.get("path"))

        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(close_going_away)
            with c.track_session(drain.set):
                try:
                    await self.app(scope, tracking_receive, tracking_send)
                except Exception as exc:
                    error = exc
            tg.cancel_scope.cancel()
        if error is not None:
            raise error

    # ------------------------------------------------------------------- lifespan

    def _observe_lifespan(self, receive: Receive) -> Receive:
        async def observed() -> Message:
            if self._started and not self._run_checked:
                # Startup is complete and the server now waits for shutdown: meanwhile,
                # say so if nothing runs the coordinator.
                self._run_checked = True
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._warn_unless_running)
                    message = await receive()
                    tg.cancel_scope.cancel()
                return message
            message = await receive()
            self._lifespan_seen = True
            return message

        return observed

    async def _warn_unless_running(self) -> None:
        """Under a server that is not graceful's (plain ``uvicorn app:app``) nothing runs
        the coordinator: the health endpoints answer, but a SIGTERM is the server's own."""
        await anyio.sleep(RUN_CHECK_S)
        c = self.coordinator
        if not c.running and not c.shutdown_requested:
            logger.warning(
                "GracefulMiddleware: no graceful server runs this app (plain uvicorn or "
                "hypercorn?): /readyz will not fail at SIGTERM and the server stops as it "
                "always does. Run it with 'graceful run', graceful.uvicorn, "
                "graceful.hypercorn or a graceful gunicorn worker — or run "
                "coordinator.run() in the app's lifespan (see the ASGI docs)"
            )

    def _observe_send(self, send: Send) -> Send:
        async def observed(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                self._started = True
            await send(message)

        return observed

    # --------------------------------------------------------------------- health

    async def _respond(self, send: Send, status: int, text: str) -> None:
        body = text.encode()
        headers = [*_TEXT, (b"content-length", str(len(body)).encode())]
        if self.coordinator.nudging:
            headers.append(_CLOSE)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _readiness(self, scope: Scope, receive: Receive, send: Send) -> None:
        starting = self._lifespan_seen and not self._started
        client = scope.get("client")
        agent = next((v for k, v in scope.get("headers", ()) if k == b"user-agent"), None)
        await self._respond(
            send,
            *_health.readiness(
                self.coordinator,
                self.readiness_on_shutdown,
                starting=starting,
                peer=str(client[0]) if client else None,
                user_agent=None if agent is None else agent.decode("latin-1"),
            ),
        )

    async def _liveness(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._respond(send, *_health.liveness(self.coordinator))

    async def _prestop(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._respond(send, *await _health.prestop_done(self.coordinator))
