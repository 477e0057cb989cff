"""``graceful.gunicorn.SyncWorker`` and ``ThreadWorker``: gunicorn's ``sync`` and
``gthread`` workers with a shutdown policy.

gunicorn's workers stop accepting at SIGTERM: connections that kube-proxy or an
ingress still sends for a second or more are refused once every worker is gone, and
those queued in the listener's backlog are reset; ``gthread`` answers a kept-alive
connection once more for at most 2 s and closes the rest.  These workers, configured
with the ``GRACEFUL_*`` variables of the other graceful workers (checked in the master):

* at SIGTERM keeps accepting and serving as the policy says (accept-until-idle: until no
  new connection arrived for ``GRACEFUL_IDLE`` s; a connection carrying only a probe
  request does not count), then serves what already waits in the backlog and exits;
* answers ``/readyz`` with 503 from SIGTERM on, ``/livez``, preStop (which only starts
  the shutdown: a sync worker's one thread cannot wait in a request and serve), through
  ``graceful.wsgi.GracefulMiddleware``, and puts ``environ["graceful.drain"]``;
* keeps heartbeating while it shuts down, so gunicorn's ``--timeout`` does not kill it
  in a long request, and exits before gunicorn's ``--graceful-timeout`` whatever the
  app does: a watchdog thread ends the process ``GRACEFUL_KILL_MARGIN`` before it, and
  if the app holds the interpreter (a C extension that never releases the GIL) an
  alarm signal with its default action, armed at SIGTERM, ends it a quarter into the
  last margin (an app that holds it when SIGTERM arrives delays even that: gunicorn's
  SIGKILL ends it);
* a repeated SIGTERM (after 0.3 s: not the master's copy of a process-group signal)
  stops accepting at once; SIGINT and SIGQUIT stop at once, as gunicorn's do.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from gunicorn.arbiter import Arbiter
from gunicorn.workers.gthread import ThreadWorker as _StockThreadWorker
from gunicorn.workers.sync import SyncWorker as _StockSyncWorker

from . import _config, _logging
from ._config import ConfigError
from ._coordinator import DUPLICATE_WINDOW_S
from ._deadlines import Deadlines, plan
from ._policy import Phase, Policy, PolicyInput
from .wsgi import GracefulMiddleware, ShutdownState

logger = logging.getLogger("graceful")

_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED)


class _GracefulWSGIWorker:
    """What the graceful WSGI workers share: the options checked in the master, the
    middleware around the app, SIGTERM, the deadlines and the watchdog.  A worker class
    puts it before gunicorn's and says how accepting stops (``_stop_accepting``)."""

    cfg: Any
    log: Any
    wsgi: Any
    timeout: float
    notify: Any

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        """Check the ``GRACEFUL_*`` variables in the master, before any worker boots."""
        try:
            values = _config.gunicorn_values(
                cfg.graceful_timeout, warn=log.warning, workers=cfg.workers
            )
            _check_supported(values)
        except ConfigError as exc:
            raise RuntimeError(f"graceful: {exc}") from None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _logging.to_gunicorn(self.log.error_log)
        self.shutdown_state = ShutdownState()
        self._deadlines: Deadlines | None = None
        self._last_connection_at: float | None = None
        self._signalled_at: float | None = None
        self._served = 0  # requests since the shutdown request
        self._accepted_at = 0.0  # sync worker: when the connection being served came
        self._loaded = False

    # ----------------------------------------------------------------- set-up

    def load_wsgi(self) -> None:
        try:
            values = _config.gunicorn_values(self.cfg.graceful_timeout)
            _check_supported(values)
        except ConfigError as exc:  # checked in the master: only if the environment changed
            self.log.error("graceful: %s", exc)
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
        coordinator = _config.coordinator_kwargs(values)
        self._policy: Policy = coordinator["policy"]
        self._drain_timeout_s: float = coordinator["drain_timeout_s"]
        self._kill_margin_s: float = coordinator["kill_margin_s"]
        self.shutdown_state.nudge_clients = getattr(self._policy, "nudge_clients", True)
        self.shutdown_state.on_request = lambda reason: self._request_shutdown(
            time.monotonic(), reason
        )
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # see _request_shutdown
        middleware = _config.middleware_kwargs(values)
        super().load_wsgi()  # type: ignore[misc]
        app: Any = self.wsgi
        self.middleware = GracefulMiddleware(
            app,
            self.shutdown_state,
            readiness_path=middleware["readiness_path"],
            liveness_path=middleware["liveness_path"],
            prestop_path=middleware["prestop_path"],
            readiness_on_shutdown=middleware["readiness_on_shutdown"],
            prestop_waits=self._prestop_waits(),
        )
        self.wsgi = self._closing(self.middleware)
        logger.info(
            "policy %s; kill deadline: --graceful-timeout %g s",
            self._policy.describe(),
            self.cfg.graceful_timeout,
        )
        self._loaded = True

    # ---------------------------------------------------------------- signals

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM: start the policy; a deliberate repeat stops accepting at once."""
        now = time.monotonic()
        if self._signalled_at is None:
            self._signalled_at = now
            if self._loaded:  # else run() starts the shutdown once the app is imported
                self._request_shutdown(now, "SIGTERM")
        elif now - self._signalled_at >= DUPLICATE_WINDOW_S and not self.shutdown_state.draining:
            self._begin_draining("SIGTERM (escalated)")

    def _request_shutdown(self, now: float, reason: str) -> None:
        """Start the policy (a SIGTERM, or the preStop endpoint from a request's thread)."""
        if self._deadlines is not None:  # started already
            return
        self._deadlines = plan(
            requested_at=now,
            grace_period_s=float(self.cfg.graceful_timeout),
            kill_at=None,
            kill_source=None,
            drain_timeout_s=self._drain_timeout_s,
            kill_margin_s=self._kill_margin_s,
        )
        self.shutdown_state.request_shutdown(reason)
        logger.info("serving -> accepting: %s", reason)
        threading.Thread(target=self._watchdog, name="graceful-watchdog", daemon=True).start()
        exit_by, kill = self._deadlines.exit_by, self._deadlines.kill
        # Last resort for an app that holds the interpreter: SIGALRM, whose action is
        # the default (load_wsgi), ends the process a quarter into the last margin (the
        # watchdog, at its start, cannot run while the app holds the GIL).
        alarm_at = exit_by + (kill - exit_by) / 4
        signal.setitimer(signal.ITIMER_REAL, max(0.001, alarm_at - time.monotonic()))

    def _begin_draining(self, reason: str) -> None:
        deadlines = self._deadlines
        drain_by = None if deadlines is None else deadlines.stop_by
        if self.shutdown_state.begin_draining(reason, drain_deadline=drain_by):
            served = f"{self._served} request{'' if self._served == 1 else 's'}"
            logger.info("accepting -> draining: %s (%s served since SIGTERM)", reason, served)
            self._stop_accepting()

    def _closing(self, app: Any) -> Any:
        """``app``, whose responses close their connection while the policy nudges
        clients.  gunicorn drops a ``Connection`` header the app sets (hop-by-hop) and
        decides itself: its response's ``force_close()`` is the way to ask."""
        state = self.shutdown_state

        def closing(environ: dict[str, Any], start_response: Any) -> Any:
            if state.nudging:
                force_close = getattr(
                    getattr(start_response, "__self__", None), "force_close", None
                )
                if force_close is not None:
                    force_close()
            return app(environ, start_response)

        return closing

    def _stop_accepting(self) -> None:
        """Draining began: stop accepting (the worker class says how)."""

    def _prestop_waits(self) -> bool:
        """Whether a preStop request may wait for draining (not with one thread)."""
        return False

    def _stopped(self) -> None:
        self.shutdown_state.advance(Phase.STOPPING, "drained")
        self.shutdown_state.advance(Phase.STOPPED, "shutdown complete")
        logger.info("stopping -> stopped: shutdown complete")

    def _start_if_signalled(self) -> None:
        """At the start of ``run``: a SIGTERM that came while the app was imported."""
        if self._signalled_at is not None and not self.shutdown_state.shutdown_requested:
            self._request_shutdown(self._signalled_at, "SIGTERM (while the app was imported)")

    def _decide(self) -> float | None:
        """Ask the policy; begin draining if it says so.  Returns when to ask again."""
        deadlines, requested_at = self._deadlines, self.shutdown_state.requested_at
        assert deadlines is not None
        assert requested_at is not None
        decision = self._policy.decide(
            PolicyInput(
                now=time.monotonic(),
                requested_at=requested_at,
                last_connection_at=self._last_connection_at,
                accept_deadline=deadlines.accept_by,
            )
        )
        if decision.stop_accepting:
            self._begin_draining(decision.reason)
        return decision.recheck_at

    def _arrived(self, at: float, path: str) -> None:
        """A new connection's first request, for path ``path``, arrived at ``at``:
        traffic for accept-until-idle unless it is a probe."""
        if path not in self.middleware.probe_paths:
            last = self._last_connection_at
            if last is None or at > last:
                self._last_connection_at = at

    def _watchdog(self) -> None:
        """Heartbeat while shutting down; end the process at the exit deadline."""
        deadlines = self._deadlines
        assert deadlines is not None
        beat = max(0.05, min(1.0, (self.timeout or 2) / 4))
        while (left := deadlines.exit_by - time.monotonic()) > 0:
            self.notify()
            if self.shutdown_state.wait_for(Phase.STOPPED, min(beat, left)):
                return
        logger.error(
            "the kill deadline is %.3g s away and a request still runs: exiting now",
            deadlines.kill - time.monotonic(),
        )
        logging.shutdown()
        os._exit(1)


class SyncWorker(_GracefulWSGIWorker, _StockSyncWorker):  # type: ignore[misc]
    """gunicorn's ``sync`` worker following graceful's shutdown policy
    (``-k graceful.gunicorn.SyncWorker``)."""

    def run(self) -> None:
        self._start_if_signalled()
        for listener in self.sockets:
            listener.setblocking(False)
        heartbeat = self.timeout or 0.5
        while self.alive and not self.shutdown_state.draining:
            self.notify()
            wait = heartbeat
            if self.shutdown_state.shutdown_requested:
                # Connections that queued while a request ran arrived: serve them before
                # asking the policy whether traffic stopped.
                for listener in self._ready(0):
                    self._accept(listener)
                recheck = self._decide()
                if self.shutdown_state.draining:
                    break
                if recheck is not None:
                    wait = max(0.0, min(wait, recheck - time.monotonic()))
            for listener in self._ready(wait):
                self._accept(listener)
            if not self.is_parent_alive():
                break
        if self.shutdown_state.shutdown_requested:
            self._drain_backlog()
            self._stopped()

    def _ready(self, timeout: float) -> list[Any]:
        try:
            ready, _, _ = select.select(self.wait_fds, [], [], timeout)
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.EBADF):
                return []
            raise
        if self.PIPE[0] in ready:
            try:
                while os.read(self.PIPE[0], 4096):
                    pass
            except BlockingIOError:
                pass
        return [fd for fd in ready if not isinstance(fd, int)]  # the listeners, not the pipe

    def _accept(self, listener: Any) -> bool:
        """Accept and serve one connection; ``False`` if none was waiting."""
        try:
            client, address = listener.accept()
        except OSError as exc:
            if exc.errno in _AGAIN:
                return False
            raise
        self._accepted_at = time.monotonic()
        client.setblocking(True)
        self.handle(listener, client, address)
        return True

    def handle_request(self, listener: Any, req: Any, client: Any, addr: Any) -> None:
        if self.shutdown_state.shutdown_requested:
            self._served += 1
            self._arrived(self._accepted_at, req.path)
        super().handle_request(listener, req, client, addr)

    def _drain_backlog(self) -> None:
        """Serve the connections the kernel queued before we stopped accepting, then
        close our copy of the listeners."""
        deadlines = self._deadlines
        for listener in self.sockets:
            while deadlines is None or time.monotonic() < deadlines.stop_by:
                self.notify()
                if not self._accept(listener):
                    break
        for listener in self.sockets:
            listener.close()


class ThreadWorker(_GracefulWSGIWorker, _StockThreadWorker):  # type: ignore[misc]
    """gunicorn's ``gthread`` worker following graceful's shutdown policy
    (``-k graceful.gunicorn.ThreadWorker``).

    gunicorn's loop, thread pool and keep-alive handling are kept.  At SIGTERM the worker
    keeps accepting while a policy thread asks the policy; responses carry ``Connection:
    close`` (kept-alive clients reconnect, to a new pod once the load balancer knows).
    Once the policy says so gunicorn's own stop runs: the connections already queued are
    accepted first (gunicorn 24+), in-flight requests finish, idle kept-alive
    connections are closed.
    """

    def _prestop_waits(self) -> bool:
        return int(self.cfg.threads) > 1

    def run(self) -> None:
        self._start_if_signalled()
        try:
            super().run()
        finally:
            if self.shutdown_state.shutdown_requested:
                self._stopped()

    def handle_quit(self, sig: int, frame: Any) -> None:
        """SIGINT, SIGQUIT: stop at once.  gunicorn's ``sys.exit`` here would wait for
        the pool's threads, so a request that runs on would hold the worker."""
        self.cfg.worker_int(self)
        logging.shutdown()
        os._exit(0)

    def _request_shutdown(self, now: float, reason: str) -> None:
        if self._deadlines is not None:  # started already
            return
        super()._request_shutdown(now, reason)
        threading.Thread(
            target=self._decide_until_draining, name="graceful-policy", daemon=True
        ).start()

    def _decide_until_draining(self) -> None:
        while not self.shutdown_state.draining:
            recheck = self._decide()
            wait = 1.0 if recheck is None else max(0.0, recheck - time.monotonic())
            self.shutdown_state.wait_for(Phase.DRAINING, wait)

    def _stop_accepting(self) -> None:
        self.alive = False  # gunicorn's loop stops accepting and drains
        wake = getattr(getattr(self, "method_queue", None), "defer", None)
        if wake is not None:  # gunicorn 25+: wake the loop now, not within 1 s
            wake(lambda: None)

    def set_accept_enabled(self, enabled: bool) -> None:
        """gunicorn 24+: before the listeners leave the loop at the stop, accept what
        already waits in the backlog (the stock worker leaves it to be reset)."""
        if not enabled and self.shutdown_state.draining:
            for listener in self.sockets:
                for _ in range(self.cfg.worker_connections):
                    if self.nr_conns >= self.cfg.worker_connections:
                        break
                    before = self.nr_conns
                    self.accept(listener)
                    if self.nr_conns == before:  # nothing was waiting
                        break
        super().set_accept_enabled(enabled)

    def enqueue_req(self, conn: Any) -> None:
        if not hasattr(conn, "graceful_arrived_at"):  # a new connection, not a kept-alive one
            conn.graceful_arrived_at = time.monotonic()
            conn.graceful_first = True
        super().enqueue_req(conn)

    def handle_request(self, req: Any, conn: Any) -> Any:
        if self.shutdown_state.shutdown_requested:
            self._served += 1
            if getattr(conn, "graceful_first", False):
                self._arrived(conn.graceful_arrived_at, req.path)
        conn.graceful_first = False
        return super().handle_request(req, conn)


def _check_supported(values: _config.Values) -> None:
    if values["kubernetes"]:
        raise ConfigError(
            f"{values.label('kubernetes')}: not supported by the WSGI workers "
            "yet (the ASGI workers have it); the policy's idle window and "
            "--graceful-timeout apply"
        )
    if values["metrics_path"] is not None:
        raise ConfigError(
            f"{values.label('metrics_path')}: not supported by the WSGI workers "
            "yet (the ASGI workers have it)"
        )
