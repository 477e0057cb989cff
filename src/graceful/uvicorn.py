"""uvicorn that follows a :class:`~graceful.ShutdownCoordinator`.

::

    import graceful.uvicorn
    graceful.uvicorn.run("myapp:app", host="0.0.0.0", port=8000,
                         policy=graceful.AcceptUntilIdle(idle_s=2))

or, with a config of your own, ``await graceful.uvicorn.Server(config).serve()``.

What changes against stock uvicorn
----------------------------------
Stock uvicorn, at SIGTERM, closes its listener at once (connections in the accept backlog
are reset), closes idle keep-alive connections, waits for the rest and then runs lifespan
shutdown.  :class:`Server` instead hands the signal to the coordinator and follows its
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

Signals: SIGTERM and SIGINT request shutdown (a second one escalates, a third exits at
once), SIGQUIT stops at once.  uvicorn re-raises captured signals after shutdown so that
the default action runs; this server does not, so the process exits 0 after a graceful
shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn
from typing_extensions import final

from ._coordinator import ShutdownCoordinator
from ._listeners import close_keeping_backlog
from ._policy import Phase, Policy
from .asgi import ASGIApp, GracefulMiddleware

__all__ = ("Server", "run", "serve")

logger = logging.getLogger("graceful")

#: The signals this server handles (uvicorn's SIGINT and SIGTERM, plus SIGQUIT).
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)


def _tracking_class(base: type[Any], server: Server) -> type[Any]:
    """A subclass of a uvicorn protocol class that reports its transport to ``server``.

    Connections are tracked per transport: a websocket upgrade hands the transport from
    the HTTP protocol to a websocket protocol without calling the HTTP protocol's
    ``connection_lost``, so the websocket protocol reports the close.
    """
    base = getattr(base, "_graceful_base", base)

    class Tracking(base):  # type: ignore[misc]
        _graceful_base = base

        def connection_made(self, transport: asyncio.BaseTransport, *args: Any) -> None:
            self._graceful_transport = transport
            server._transport_opened(transport)
            super().connection_made(transport, *args)

        def connection_lost(self, exc: Exception | None) -> None:
            try:
                super().connection_lost(exc)
            finally:
                transport = getattr(self, "_graceful_transport", None)
                if transport is not None:
                    server._transport_closed(transport)

    Tracking.__name__ = Tracking.__qualname__ = f"Graceful{base.__name__}"
    return Tracking


@final
class Server(uvicorn.Server):
    """A :class:`uvicorn.Server` whose shutdown follows a coordinator's policy.

    Args:
        config: The uvicorn configuration.
        coordinator: The process's coordinator (a new one with the default policy if
            omitted).
        wrap_app: Wrap the app in :class:`~graceful.asgi.GracefulMiddleware`.  Pass
            ``False`` if you added it yourself (with the same coordinator).
        quick_signals: Signals that stop at once instead of starting the policy
            (gunicorn workers add SIGINT, its "quick shutdown").
        middleware_options: Keyword arguments for the middleware (health paths,
            ``websocket_close_grace_s``).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        coordinator: ShutdownCoordinator | None = None,
        wrap_app: bool = True,
        quick_signals: tuple[int, ...] = (signal.SIGQUIT,),
        **middleware_options: Any,
    ) -> None:
        super().__init__(config)
        self._quick_signals = quick_signals
        self.coordinator = coordinator if coordinator is not None else ShutdownCoordinator()
        self._wrap_app = wrap_app
        self._middleware_options = middleware_options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._transports: set[asyncio.BaseTransport] = set()
        self._http_class: type[Any] | None = None
        self._listening = True
        self._signals_captured = False
        self.coordinator.subscribe(self._on_phase)

    # -------------------------------------------------------------- setting up

    def _prepare(self) -> None:
        config = self.config
        if not config.loaded:
            config.load()
        if self._wrap_app:
            config.loaded_app = GracefulMiddleware(
                config.loaded_app, coordinator=self.coordinator, **self._middleware_options
            )
        self._http_class = _tracking_class(config.http_protocol_class, self)
        config.http_protocol_class = self._http_class
        if config.ws_protocol_class is not None:
            config.ws_protocol_class = _tracking_class(config.ws_protocol_class, self)

    async def serve(self, sockets: list[Any] | None = None) -> None:
        """Serve until the coordinator stops (see :meth:`uvicorn.Server.serve`)."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        # Handlers first: a SIGTERM while the app is imported starts the shutdown once it
        # is up, instead of killing the process. super().serve() nests capture_signals.
        with self.capture_signals():
            self._prepare()
            self.coordinator._add_cleanup(self._finish)
            # Signals reach the coordinator through handle_exit, so give it a trigger that
            # never fires: it must not install handlers of its own.
            task = asyncio.ensure_future(self.coordinator.run(shutdown_trigger=_never))
            try:
                await super().serve(sockets)
            finally:
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # ----------------------------------------------------------------- signals

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Route SIGINT, SIGTERM and SIGQUIT to the coordinator; restore on exit."""
        if self._signals_captured or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        self._signals_captured = True
        try:
            yield
        finally:
            self._signals_captured = False
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: request shutdown from the coordinator (in the loop)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self._request_shutdown, sig)

    def _request_shutdown(self, sig: int) -> None:
        name = signal.Signals(sig).name
        self.coordinator.request_shutdown(name, immediate=sig in self._quick_signals)

    # -------------------------------------------------------------- the phases

    def _transport_opened(self, transport: asyncio.BaseTransport) -> None:
        if transport not in self._transports:
            self._transports.add(transport)
            self.coordinator.connection_opened()

    def _transport_closed(self, transport: asyncio.BaseTransport) -> None:
        if transport in self._transports:
            self._transports.discard(transport)
            self.coordinator.connection_closed()

    def _on_phase(self, phase: Phase) -> None:
        if phase >= Phase.DRAINING:
            self._stop_listening()
            if phase is Phase.DRAINING:
                # Idle keep-alive connections close now, busy ones after their response.
                # Websockets are left to the middleware (close code 1001 after a grace).
                for connection in list(self.server_state.connections):
                    if self._http_class is None or isinstance(connection, self._http_class):
                        connection.shutdown()
        if phase >= Phase.STOPPING:
            self.should_exit = True
            if self._wake is not None:
                self._wake.set()

    def _stop_listening(self) -> None:
        if not self._listening or self._loop is None:
            return
        self._listening = False
        servers, self.servers = list(getattr(self, "servers", [])), []
        close_keeping_backlog(servers, self._protocol_factory, self._loop, self.coordinator)

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
            await self.on_tick(counter)

    async def main_loop(self) -> None:
        """uvicorn's loop, but woken at once when the coordinator starts stopping."""
        assert self._wake is not None
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        """Wait for the coordinator to stop, keeping uvicorn's housekeeping going.

        The cut of what is left and lifespan shutdown run as the coordinator's first
        STOPPING hook (:meth:`_finish`), so they are bounded like every hook.
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

    async def _finish(self) -> None:
        """Cancel requests still running, close what is left, run lifespan shutdown."""
        self._stop_listening()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        tasks = list(self.server_state.tasks)
        if tasks:
            logger.warning("cancelling %d request(s) still running", len(tasks))
            for task in tasks:
                task.cancel(msg="graceful: drain deadline reached")
            await asyncio.wait(tasks, timeout=self._time_left(1.0))
        for transport in list(self._transports):
            transport.close()
        if not self.force_exit:
            await self.lifespan.shutdown()

    def _time_left(self, at_most_s: float) -> float:
        """``at_most_s``, or less if the kill deadline comes sooner."""
        kill_in = self.coordinator.statistics().kill_deadline_in_s
        if kill_in is None:
            return at_most_s
        return max(0.0, min(at_most_s, kill_in - 0.1))


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
        for key in ("readiness_path", "liveness_path", "prestop_path", "websocket_close_grace_s")
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
    """Serve ``app`` with a graceful :class:`Server` in the running event loop.

    Keyword arguments go to :class:`uvicorn.Config`, except the middleware's
    (``readiness_path``, ``liveness_path``, ``prestop_path``, ``websocket_close_grace_s``)
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
    """Like :func:`uvicorn.run` (single process), with graceful shutdown; see :func:`serve`."""
    _make_server(app, coordinator, policy, kwargs).run()
