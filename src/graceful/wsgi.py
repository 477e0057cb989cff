"""WSGI: the health endpoints and the drain state for Flask, Django or any WSGI app.

A WSGI server's requests run in threads (or one thread) that block: they cannot await
the ``ShutdownCoordinator``.  ``CoordinatorThread`` runs the coordinator in a thread of
its own, with its own event loop, and hands it what the server's threads report;
``GracefulMiddleware`` wraps the app::

    import graceful, graceful.wsgi

    coordinator = graceful.wsgi.CoordinatorThread(
        graceful.ShutdownCoordinator(policy=graceful.AcceptUntilIdle(idle_s=2))
    )
    app = graceful.wsgi.GracefulMiddleware(flask_app, coordinator)
    coordinator.start()  # after the middleware (its metrics hook into the coordinator)
    # the server calls coordinator.request_shutdown("SIGTERM") at SIGTERM,
    # stops accepting once coordinator.coordinator.draining, and exits at STOPPED

``graceful.gunicorn.SyncWorker`` and ``ThreadWorker`` do all of that themselves, from the
``GRACEFUL_*`` variables.  The middleware answers, before the app sees them:

* the readiness endpoint (``/readyz``): 200, then 503 from the shutdown request on (a
  load balancer stops sending new connections while the worker still accepts them);
* the liveness endpoint (``/livez``): 200 until the coordinator stopped;
* the preStop endpoint, if set: starts the shutdown and answers once the drain is done
  (no request of the app left), as ``graceful.asgi``'s;
* the metrics endpoint, if set: ``graceful.metrics`` (the ``metrics`` extra).

It counts every other request as in flight until the server closes its response
iterable, reports each connection's first request while accepting (*probes are not
traffic*: a health path, or a ``kube-probe/`` user agent, does not hold
accept-until-idle), puts a ``DrainSignal`` in ``environ["graceful.drain"]`` (the WSGI
twin of ``graceful.asgi.DrainSignal``: a stream or a long poll checks
``signal.draining``), and adds ``Connection: close`` to responses while the policy nudges
clients.  Only the standard library and anyio are needed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from typing import Any, Final

import anyio

from ._core import health as _health
from ._core.coordinator import ShutdownCoordinator
from ._core.policy import Phase, _check_readiness_on_shutdown
from ._core.signals import current_schedule, leave_signals_to_main_thread
from ._core.tracking import is_probe

__all__ = (
    "ENVIRON_KEY",
    "CoordinatorThread",
    "DrainSignal",
    "GracefulMiddleware",
    "drain_signal",
)

#: Where ``GracefulMiddleware`` puts the ``DrainSignal`` in each request's environ.
ENVIRON_KEY: Final = "graceful.drain"

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

_TEXT: Final = ("Content-Type", "text/plain; charset=utf-8")
_CLOSE: Final = ("Connection", "close")


class CoordinatorThread:
    """A ``ShutdownCoordinator`` running in a daemon thread of its own (asyncio), for a
    server whose threads block.

    Args:
        coordinator: The coordinator; shutdown is requested through its thread-safe
            ``request_shutdown`` (no signal handlers are installed for it).
    """

    def __init__(self, coordinator: ShutdownCoordinator) -> None:
        if not isinstance(coordinator, ShutdownCoordinator):
            raise TypeError(f"coordinator must be a ShutdownCoordinator, got {coordinator!r}")
        self.coordinator: Final = coordinator
        self._schedule: Callable[[Callable[[], object]], object] | None = None
        self._ready = threading.Event()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        coordinator.subscribe(self._on_phase)

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the thread; returns once the coordinator runs.

        Raises:
            RuntimeError: started already, or not running within ``timeout_s``.
        """
        if self._thread is not None:
            raise RuntimeError("CoordinatorThread.start(): started already")
        self._thread = threading.Thread(target=self._main, name="graceful-coordinator")
        self._thread.daemon = True
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the coordinator did not start within {timeout_s:g} s")

    @property
    def running(self) -> bool:
        """Whether the coordinator runs in its thread (``start`` returned, not stopped)."""
        return self._ready.is_set() and self._thread is not None and self._thread.is_alive()

    def _main(self) -> None:
        leave_signals_to_main_thread()
        anyio.run(self._run)

    async def _run(self) -> None:
        self._schedule = current_schedule()
        async with anyio.create_task_group() as tg:
            run = functools.partial(self.coordinator.run, shutdown_trigger=anyio.sleep_forever)
            await tg.start(run)
            self._ready.set()

    def call(self, function: Callable[..., object], *args: Any) -> None:
        """Run ``function(*args)`` in the coordinator's thread, in the order of the
        calls (thread-safe; every reporting call of the adapter API goes through here).
        Before ``start`` it runs at once; after the coordinator stopped, not at all."""
        schedule = self._schedule
        if schedule is None:
            function(*args)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the coordinator stopped
            schedule(functools.partial(function, *args))

    def request_shutdown(self, reason: str = "requested", **options: bool) -> None:
        """``coordinator.request_shutdown(reason, **options)`` from any thread (a signal
        handler included); ignored once the coordinator stopped.

        Raises:
            RuntimeError: before ``start``.
        """
        if self._schedule is None:
            raise RuntimeError("CoordinatorThread.request_shutdown() before start()")
        self.call(functools.partial(self.coordinator.request_shutdown, reason, **options))

    def _on_phase(self, phase: Phase) -> None:
        with self._changed:
            self._changed.notify_all()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait until the coordinator's ``run()`` returned (``STOPPED``, its hooks run
        and its last line logged); ``False`` after ``timeout_s``."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def wait_for_phase(self, phase: Phase, timeout_s: float | None = None) -> bool:
        """Block until the coordinator reaches ``phase``; ``False`` after ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: self.coordinator.phase >= phase, timeout_s)


class DrainSignal:
    """What a request handler may know about the shutdown: ``environ["graceful.drain"]``.

    A streaming response typically does::

        signal = graceful.wsgi.drain_signal(environ)
        while signal is None or not signal.draining:
            yield next_chunk()
    """

    __slots__ = ("_thread",)

    def __init__(self, thread: CoordinatorThread) -> None:
        self._thread = thread

    @property
    def draining(self) -> bool:
        """``True`` once draining began: finish the current piece of work and end."""
        return self._thread.coordinator.draining

    @property
    def shutdown_requested(self) -> bool:
        """``True`` once shutdown was requested (still accepting, perhaps)."""
        return self._thread.coordinator.shutdown_requested

    def wait(self, *, timeout_s: float | None = None) -> bool:
        """Block until draining begins; ``False`` if ``timeout_s`` elapsed first."""
        return self._thread.wait_for_phase(Phase.DRAINING, timeout_s)

    def time_left_s(self) -> float | None:
        """Seconds until the drain deadline (``None`` before draining or without one)."""
        return self._thread.coordinator.drain_time_left()


def drain_signal(environ: Environ) -> DrainSignal | None:
    """The request's ``DrainSignal``, or ``None`` outside the middleware."""
    found = environ.get(ENVIRON_KEY)
    return found if isinstance(found, DrainSignal) else None


def _text(status: int, text: str) -> tuple[str, str, bytes]:
    """A health answer as a WSGI status line, content type and body."""
    return f"{status} {HTTPStatus(status).phrase}", _TEXT[1], text.encode()


def _endpoint(name: str, path: str | None) -> str | None:
    if path is None:
        return None
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"{name} must be a path starting with '/' or None, got {path!r}")
    return path


class _Started:
    """One request's start, as the coordinator reported it (set in its thread)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None

    def start(self, coordinator: ShutdownCoordinator) -> None:
        self.at = coordinator.request_started()

    def finish(self, coordinator: ShutdownCoordinator) -> None:
        coordinator.request_finished(self.at)


class _Tracked:
    """The app's response iterable; the request ends when the server closes it."""

    __slots__ = ("_close", "_result")

    def __init__(self, result: Iterable[bytes], close: Callable[[], None]) -> None:
        self._result = result
        self._close = close

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._result)

    def close(self) -> None:
        try:
            close = getattr(self._result, "close", None)
            if close is not None:
                close()
        finally:
            self._close()


class GracefulMiddleware:
    """Health endpoints, request tracking, the drain signal and ``Connection: close``
    while shutting down, for a WSGI app.

    Args:
        app: The WSGI app.
        coordinator: The ``CoordinatorThread`` the server runs (started or not yet).
        readiness_path: Readiness endpoint, or ``None``.
        liveness_path: Liveness endpoint, or ``None``.
        prestop_path: preStop endpoint (starts the shutdown, answers once the drain is
            done: draining began and no request of the app is left), or ``None``.
        metrics_path: Prometheus metrics endpoint (``graceful.metrics``; the ``metrics``
            extra), or ``None``.
        readiness_on_shutdown: ``"fail"`` (default): 503 from the shutdown request on;
            ``"while-accepting"``: 200 until draining begins.
        prestop_waits: Whether a preStop request waits for the drain (the kubelet
            sends SIGTERM once it is answered).  A single-threaded server cannot serve
            while one request waits: ``graceful.gunicorn.SyncWorker`` passes ``False``,
            and preStop then only starts the shutdown.
        prestop_timeout_s: The longest a preStop request waits.
    """

    def __init__(
        self,
        app: WSGIApp,
        coordinator: CoordinatorThread,
        *,
        readiness_path: str | None = "/readyz",
        liveness_path: str | None = "/livez",
        prestop_path: str | None = None,
        metrics_path: str | None = None,
        readiness_on_shutdown: str = "fail",
        prestop_waits: bool = True,
        prestop_timeout_s: float = 30.0,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be a WSGI callable, got {app!r}")
        if not isinstance(coordinator, CoordinatorThread):
            raise TypeError(f"coordinator must be a CoordinatorThread, got {coordinator!r}")
        self.app: Final = app
        self.thread: Final = coordinator
        self.coordinator: Final = coordinator.coordinator
        self.readiness_on_shutdown: Final = _check_readiness_on_shutdown(readiness_on_shutdown)
        self.prestop_waits: Final = prestop_waits
        self.prestop_timeout_s: Final = prestop_timeout_s
        self._signal = DrainSignal(coordinator)
        self._exposition: Any = None
        endpoints: dict[str | None, Callable[[Environ], tuple[str, str, bytes]]] = {
            _endpoint("readiness_path", readiness_path): self._readiness,
            _endpoint("liveness_path", liveness_path): self._liveness,
            _endpoint("prestop_path", prestop_path): self._prestop,
        }
        if _endpoint("metrics_path", metrics_path) is not None:
            from .metrics import Exposition  # the metrics extra, only when asked for

            self._exposition = Exposition(self.coordinator)
            endpoints[metrics_path] = self._metrics
        endpoints.pop(None, None)
        self._endpoints: Final = endpoints
        # The app's requests in flight, counted only for a preStop request that waits
        # for them (``_prestop``); it is woken at each phase change too.
        self._counting: Final = prestop_waits and self._endpoints.get(prestop_path) is not None
        self._running = 0
        self._idle = threading.Condition()
        if self._counting:
            self.coordinator.subscribe(self._phase_changed)

    @property
    def probe_paths(self) -> frozenset[str]:
        """The paths this middleware answers itself (not traffic, for accept-until-idle)."""
        return frozenset(path for path in self._endpoints if path is not None)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        c = self.coordinator
        endpoint = self._endpoints.get(environ.get("PATH_INFO"))
        if c.shutdown_requested and c.accepting:
            probe = endpoint is not None or is_probe(environ.get("HTTP_USER_AGENT"))
            client = (environ.get("REMOTE_ADDR"), environ.get("REMOTE_PORT"))
            self.thread.call(functools.partial(c.first_request, client, probe=probe))
        if endpoint is not None:
            status, content_type, body = endpoint(environ)
            headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
            if c.nudging:
                headers.append(_CLOSE)
            start_response(status, headers)
            return [body]
        environ[ENVIRON_KEY] = self._signal
        started = _Started()
        self.thread.call(started.start, c)
        finish = functools.partial(self.thread.call, started.finish, c)
        if self._counting:
            finish = functools.partial(self._finished, finish)
            with self._idle:
                self._running += 1

        def nudging(status: str, headers: list[tuple[str, str]], *exc_info: Any) -> Any:
            if c.nudging and not any(name.lower() == "connection" for name, _ in headers):
                headers = [*headers, _CLOSE]
            return start_response(status, headers, *exc_info)

        try:
            result = self.app(environ, nudging)
        except BaseException:
            finish()
            raise
        return _Tracked(result, finish)

    def _finished(self, report: Callable[[], None]) -> None:
        """A request counted for preStop ended: ``report`` it, and wake a preStop
        request once none is left."""
        report()
        with self._idle:
            self._running -= 1
            if not self._running:
                self._idle.notify_all()

    def _phase_changed(self, phase: Phase) -> None:
        with self._idle:
            self._idle.notify_all()

    def _readiness(self, environ: Environ) -> tuple[str, str, bytes]:
        c = self.coordinator
        shutting_down = c.shutdown_requested
        status, text = _health.readiness(c, self.readiness_on_shutdown, count=False)
        peer, agent = environ.get("REMOTE_ADDR"), environ.get("HTTP_USER_AGENT")
        self.thread.call(c.health_checkers.answered, peer, agent, status, shutting_down)
        return _text(status, text)

    def _liveness(self, environ: Environ) -> tuple[str, str, bytes]:
        return _text(*_health.liveness(self.coordinator))

    def _prestop(self, environ: Environ) -> tuple[str, str, bytes]:
        self.thread.request_shutdown("preStop", escalate=False)
        if not self.prestop_waits:
            return "200 OK", _TEXT[1], b"shutdown requested\n"
        c = self.coordinator
        until = time.monotonic() + self.prestop_timeout_s
        if self.thread.wait_for_phase(Phase.DRAINING, self.prestop_timeout_s):
            with self._idle:  # drained, or stopping cut what was left
                if self._idle.wait_for(
                    lambda: not self._running or c.phase >= Phase.STOPPING,
                    max(0.0, until - time.monotonic()),
                ):
                    # The format of graceful.asgi's answer (WSGI has no sessions).
                    left = f"{c.phase}: {self._running} requests, 0 sessions left\n"
                    return "200 OK", _TEXT[1], left.encode()
        waited = f"still {c.phase} after {self.prestop_timeout_s:g} s\n"
        return "504 Gateway Timeout", _TEXT[1], waited.encode()

    def _metrics(self, environ: Environ) -> tuple[str, str, bytes]:
        from .metrics import RENDER_RETRIES_S

        accept = environ.get("HTTP_ACCEPT", "")
        for delay_s in (*RENDER_RETRIES_S, None):
            try:
                body, content_type = self._exposition.render(accept)
            except Exception as exc:  # a multiprocess file caught while it is created
                if delay_s is None:
                    return "503 Service Unavailable", _TEXT[1], f"metrics: {exc!r}\n".encode()
                time.sleep(delay_s)  # the pause RENDER_RETRIES_S gives, as the ASGI path
                continue
            return "200 OK", content_type, body
        raise AssertionError("unreachable")  # pragma: no cover
