"""WSGI: the health endpoints and the drain state for Flask, Django or any WSGI app.

``GracefulMiddleware`` wraps a WSGI app::

    from graceful.wsgi import GracefulMiddleware

    app = GracefulMiddleware(flask_app)          # Flask
    application = GracefulMiddleware(get_wsgi_application())   # Django's wsgi.py

and answers, before the app sees them:

* the readiness endpoint (``/readyz``): 200, then 503 from the shutdown request on (a
  load balancer stops sending new connections while the worker still accepts them);
* the liveness endpoint (``/livez``): 200 until the worker stopped;
* the preStop endpoint, if set: starts the shutdown and answers once draining began.

Each request's environ carries a ``DrainSignal`` under ``"graceful.drain"`` (the WSGI
twin of ``graceful.asgi.DrainSignal``): a streaming response or a long poll checks
``signal.draining`` and ends early.  While shutting down with a nudging policy, every
response gets ``Connection: close``, so that a kept-alive client opens its next
connection elsewhere.

The state is a ``ShutdownState``, which ``graceful.gunicorn.SyncWorker`` drives (the
worker wraps its app in this middleware itself, from the ``GRACEFUL_*`` variables); an
app served by another WSGI server can drive one itself with ``request_shutdown`` and
``begin_draining``.  Only the standard library is needed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from ._policy import Phase, _check_readiness_on_shutdown

__all__ = ("ENVIRON_KEY", "DrainSignal", "GracefulMiddleware", "ShutdownState", "drain_signal")

#: Where ``GracefulMiddleware`` puts the ``DrainSignal`` in each request's environ.
ENVIRON_KEY: Final = "graceful.drain"

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


class ShutdownState:
    """The phase of one WSGI worker process, thread-safe, moving forward only.

    Args:
        nudge_clients: Send ``Connection: close`` once shutdown was requested.
    """

    def __init__(self, *, nudge_clients: bool = True) -> None:
        self.nudge_clients = nudge_clients
        self._phase = Phase.SERVING
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.requested_at: float | None = None
        self.drain_deadline: float | None = None
        self.reason = ""
        #: Called with the reason when shutdown is first requested (by the preStop
        #: endpoint, say): the server starts its policy there.
        self.on_request: Callable[[str], object] | None = None

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def shutdown_requested(self) -> bool:
        return self._phase >= Phase.ACCEPTING

    @property
    def accepting(self) -> bool:
        return self._phase <= Phase.ACCEPTING

    @property
    def draining(self) -> bool:
        return self._phase >= Phase.DRAINING

    @property
    def nudging(self) -> bool:
        return self.nudge_clients and self.shutdown_requested

    def advance(self, phase: Phase, reason: str, *, drain_deadline: float | None = None) -> bool:
        """Move to ``phase`` (``False`` if already there or past it)."""
        with self._changed:
            if phase <= self._phase:
                return False
            if self.requested_at is None:
                self.requested_at = time.monotonic()
            if drain_deadline is not None:
                self.drain_deadline = drain_deadline
            self._phase = phase
            self.reason = reason
            self._changed.notify_all()
            return True

    def request_shutdown(self, reason: str = "requested") -> bool:
        """Shutdown was requested: stop being ready (``False`` if it was already).
        ``on_request``, if set, is called with ``reason`` the first time."""
        advanced = self.advance(Phase.ACCEPTING, reason)
        if advanced and self.on_request is not None:
            self.on_request(reason)
        return advanced

    def begin_draining(self, reason: str, *, drain_deadline: float | None = None) -> bool:
        """No new connections from now on; in-flight requests finish."""
        return self.advance(Phase.DRAINING, reason, drain_deadline=drain_deadline)

    def wait_for(self, phase: Phase, timeout_s: float | None = None) -> bool:
        """Wait until ``phase`` is reached; ``False`` if ``timeout_s`` elapsed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._phase >= phase, timeout_s)


class DrainSignal:
    """What a request handler may know about the shutdown: ``environ["graceful.drain"]``.

    A streaming response typically does::

        signal = graceful.wsgi.drain_signal(environ)
        while signal is None or not signal.draining:
            yield next_chunk()
    """

    __slots__ = ("state",)

    def __init__(self, state: ShutdownState) -> None:
        self.state: Final = state

    @property
    def draining(self) -> bool:
        """``True`` once draining began: finish the current piece of work and end."""
        return self.state.draining

    @property
    def shutdown_requested(self) -> bool:
        """``True`` once shutdown was requested (still accepting, perhaps)."""
        return self.state.shutdown_requested

    def wait(self, *, timeout_s: float | None = None) -> bool:
        """Block until draining begins; ``False`` if ``timeout_s`` elapsed first."""
        return self.state.wait_for(Phase.DRAINING, timeout_s)

    def time_left_s(self) -> float | None:
        """Seconds until the drain deadline (``None`` before draining or without one)."""
        deadline = self.state.drain_deadline
        if deadline is None or not self.state.draining:
            return None
        return max(0.0, deadline - time.monotonic())


def drain_signal(environ: Environ) -> DrainSignal | None:
    """The request's ``DrainSignal``, or ``None`` outside the middleware."""
    found = environ.get(ENVIRON_KEY)
    return found if isinstance(found, DrainSignal) else None


def _endpoint(name: str, path: str | None) -> str | None:
    if path is None:
        return None
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"{name} must be a path starting with '/' or None, got {path!r}")
    return path


class GracefulMiddleware:
    """Health endpoints, the drain signal and ``Connection: close`` while shutting down.

    Args:
        app: The WSGI app.
        state: The worker's ``ShutdownState`` (default: a new one, for a server that is
            not graceful's: then call ``state.request_shutdown`` yourself).
        readiness_path: Readiness endpoint, or ``None``.
        liveness_path: Liveness endpoint, or ``None``.
        prestop_path: preStop endpoint (starts the shutdown, answers once draining
            began), or ``None``.
        readiness_on_shutdown: ``"fail"`` (default): 503 from the shutdown request on;
            ``"while-accepting"``: 200 until draining begins.
        prestop_timeout_s: The longest a preStop request waits.
        prestop_waits: Whether a preStop request waits for draining to begin (the
            kubelet sends SIGTERM once it is answered).  A single-threaded server
            cannot serve while one request waits: ``graceful.gunicorn.SyncWorker``
            passes ``False``, and preStop then only starts the shutdown.
    """

    def __init__(
        self,
        app: WSGIApp,
        state: ShutdownState | None = None,
        *,
        readiness_path: str | None = "/readyz",
        liveness_path: str | None = "/livez",
        prestop_path: str | None = None,
        readiness_on_shutdown: str = "fail",
        prestop_timeout_s: float = 30.0,
        prestop_waits: bool = True,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be a WSGI callable, got {app!r}")
        self.app: Final = app
        self.state: Final = ShutdownState() if state is None else state
        self.readiness_on_shutdown: Final = _check_readiness_on_shutdown(readiness_on_shutdown)
        self.prestop_timeout_s: Final = prestop_timeout_s
        self.prestop_waits: Final = prestop_waits
        self._signal = DrainSignal(self.state)
        endpoints = {
            _endpoint("readiness_path", readiness_path): self._readiness,
            _endpoint("liveness_path", liveness_path): self._liveness,
            _endpoint("prestop_path", prestop_path): self._prestop,
        }
        endpoints.pop(None, None)
        self._endpoints: Final[dict[str | None, Callable[[], tuple[str, str]]]] = endpoints

    @property
    def probe_paths(self) -> frozenset[str]:
        """The paths this middleware answers itself (not traffic, for accept-until-idle)."""
        return frozenset(path for path in self._endpoints if path is not None)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        endpoint = self._endpoints.get(environ.get("PATH_INFO"))
        if endpoint is not None:
            status, text = endpoint()
            body = text.encode()
            headers = [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(body))),
            ]
            if self.state.nudging:
                headers.append(("Connection", "close"))
            start_response(status, headers)
            return [body]
        environ[ENVIRON_KEY] = self._signal
        if not self.state.nudge_clients:
            return self.app(environ, start_response)
        state = self.state

        def nudging_start_response(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            if state.nudging and not any(name.lower() == "connection" for name, _ in headers):
                headers = [*headers, ("Connection", "close")]
            return start_response(status, headers, *exc)

        return self.app(environ, nudging_start_response)

    def _readiness(self) -> tuple[str, str]:
        s = self.state
        if s.shutdown_requested and (self.readiness_on_shutdown == "fail" or not s.accepting):
            return "503 Service Unavailable", f"shutting down ({s.phase})\n"
        return "200 OK", "ready\n"

    def _liveness(self) -> tuple[str, str]:
        if self.state.phase is Phase.STOPPED:
            return "503 Service Unavailable", "stopped\n"
        return "200 OK", f"alive ({self.state.phase})\n"

    def _prestop(self) -> tuple[str, str]:
        self.state.request_shutdown("preStop")
        if not self.prestop_waits:
            return "200 OK", f"{self.state.phase}\n"
        if self.state.wait_for(Phase.DRAINING, self.prestop_timeout_s):
            return "200 OK", f"{self.state.phase}\n"
        waited = f"still {self.state.phase} after {self.prestop_timeout_s:g} s\n"
        return "504 Gateway Timeout", waited
