"""``graceful.gunicorn.SyncWorker``: gunicorn's ``sync`` worker with a shutdown policy.

gunicorn's sync worker stops accepting at SIGTERM: connections that kube-proxy or an
ingress still sends for a second or more are refused once every worker is gone, and
those queued in the listener's backlog are reset.  This worker, configured with the
``GRACEFUL_*`` variables of the other graceful workers (checked in the master):

* at SIGTERM keeps accepting and serving as the policy says (accept-until-idle: until no
  new connection arrived for ``GRACEFUL_IDLE`` s; a connection carrying only a probe
  request does not count), then serves what already waits in the backlog and exits;
* answers ``/readyz`` with 503 from SIGTERM on, ``/livez``, preStop (which only starts
  the shutdown: one thread cannot wait in a request and serve), through
  ``graceful.wsgi.GracefulMiddleware``, and puts ``environ["graceful.drain"]``;
* keeps heartbeating while it shuts down, so gunicorn's ``--timeout`` does not kill it
  in a long request, and exits before gunicorn's ``--graceful-timeout`` whatever the
  app does: a watchdog thread ends the process ``GRACEFUL_KILL_MARGIN`` before it, and
  if the app holds the interpreter (a C extension that never releases the GIL) an
  alarm signal with its default action ends it halfway through the margin;
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
from gunicorn.workers.sync import SyncWorker as _StockSyncWorker

from . import _config
from ._config import ConfigError
from ._coordinator import DUPLICATE_WINDOW_S
from ._deadlines import Deadlines, plan
from ._policy import Phase, Policy, PolicyInput
from .wsgi import GracefulMiddleware, ShutdownState

logger = logging.getLogger("graceful")

_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED)


class SyncWorker(_StockSyncWorker):  # type: ignore[misc]
    """gunicorn's ``sync`` worker following graceful's shutdown policy
    (``-k graceful.gunicorn.SyncWorker``)."""

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
        graceful_logger = logging.getLogger("graceful")
        graceful_logger.handlers = self.log.error_log.handlers
        graceful_logger.setLevel(logging.INFO)
        graceful_logger.propagate = False
        self._deadlines: Deadlines | None = None
        self._last_connection_at: float | None = None
        self._signalled_at: float | None = None
        self._served = 0  # requests since the shutdown request
        self._probe = False  # whether the request being handled is a probe
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
        nudge = getattr(self._policy, "nudge_clients", True)
        self.shutdown_state = ShutdownState(nudge_clients=nudge)
        middleware = _config.middleware_kwargs(values)
        super().load_wsgi()
        app: Any = self.wsgi  # type: ignore[has-type]
        self.middleware = GracefulMiddleware(
            app,
            self.shutdown_state,
            readiness_path=middleware["readiness_path"],
            liveness_path=middleware["liveness_path"],
            prestop_path=middleware["prestop_path"],
            readiness_on_shutdown=middleware["readiness_on_shutdown"],
            prestop_waits=False,
        )
        self.wsgi = self.middleware
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
        self._deadlines = plan(
            requested_at=now,
            grace_period_s=float(self.cfg.graceful_timeout),
            kill_at=None,
            kill_source=None,
            drain_timeout_s=self._drain_timeout_s,
            kill_margin_s=self._kill_margin_s,
        )
        if self.shutdown_state.request_shutdown(reason):
            logger.info("serving -> accepting: %s", reason)
        threading.Thread(target=self._watchdog, name="graceful-watchdog", daemon=True).start()
        exit_by, kill = self._deadlines.exit_by, self._deadlines.kill
        # Last resort for an app that holds the interpreter: SIGALRM's default action.
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, max(0.001, (exit_by + kill) / 2 - now))

    def _begin_draining(self, reason: str) -> None:
        deadlines = self._deadlines
        drain_by = None if deadlines is None else deadlines.stop_by
        if self.shutdown_state.begin_draining(reason, drain_deadline=drain_by):
            served = f"{self._served} request{'' if self._served == 1 else 's'}"
            logger.info("accepting -> draining: %s (%s served since SIGTERM)", reason, served)

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

    # --------------------------------------------------------------- the loop

    def run(self) -> None:
        if self._signalled_at is not None and not self.shutdown_state.shutdown_requested:
            self._request_shutdown(self._signalled_at, "SIGTERM (while the app was imported)")
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
            self.shutdown_state.advance(Phase.STOPPING, "drained")
            self.shutdown_state.advance(Phase.STOPPED, "shutdown complete")
            logger.info("stopping -> stopped: shutdown complete")

    def _decide(self) -> float | None:
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
        arrived = time.monotonic()
        client.setblocking(True)
        self._probe = False
        self.handle(listener, client, address)
        if self.shutdown_state.shutdown_requested:
            self._served += 1
            if not self._probe:
                self._last_connection_at = arrived
        return True

    def handle_request(self, listener: Any, req: Any, client: Any, addr: Any) -> None:
        self._probe = req.path in self.middleware.probe_paths
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


def _check_supported(values: _config.Values) -> None:
    if values["kubernetes"]:
        raise ConfigError(
            f"{values.label('kubernetes')}: not supported by graceful.gunicorn.SyncWorker "
            "yet (the ASGI workers have it); the policy's idle window and "
            "--graceful-timeout apply"
        )
    if values["metrics_path"] is not None:
        raise ConfigError(
            f"{values.label('metrics_path')}: not supported by graceful.gunicorn.SyncWorker "
            "yet (the ASGI workers have it)"
        )
