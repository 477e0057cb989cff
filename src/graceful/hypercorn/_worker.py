"""gunicorn worker classes running ``graceful.hypercorn.serve``.

``gunicorn -k graceful.gunicorn.HypercornWorker app:app`` (asyncio), ``…HypercornUvloopWorker``
or ``…HypercornTrioWorker``: hypercorn no longer ships gunicorn workers, so these are
modelled on ``graceful.gunicorn.UvicornWorker``, and every worker follows the
shutdown policy (``GRACEFUL_POLICY``, ``GRACEFUL_IDLE``, … — see ``graceful run --help``):

* the worker serves gunicorn's listening sockets (TLS when gunicorn is configured for
  it), and gunicorn's ``keepalive``, ``backlog``, ``max_requests``, loggers and
  access-log format become hypercorn's;
* gunicorn's ``graceful_timeout`` is the kill deadline: the master SIGKILLs a worker that
  outlives it, so each worker's drain ends ``kill_margin_s`` before it, and a watchdog
  ends the worker at the last moment if the app will not let go (``hard_exit``);
* the worker calls ``notify()`` from its event loop the whole time — serving, accepting,
  draining, stopping — so the master's ``timeout`` aborts a worker whose loop is stuck,
  never one that is draining;
* SIGTERM (shutdown, ``HUP`` reload, ``TTOU``) starts the policy (a repeat is the
  master's relay, however late, never an escalation); SIGINT and SIGQUIT —
  gunicorn's quick shutdown — stop at once; signals that arrive while the app is still
  being imported are kept and acted on once the worker listens;
* ``max_requests`` recycling drains at once (the sibling workers keep serving);
* bad ``GRACEFUL_*`` values stop gunicorn at start-up, in the master, with one line
  (``Error: graceful: …``, status 1) before any worker boots; an app whose lifespan
  startup fails ends its worker with gunicorn's boot-error status, so the master stops
  instead of respawning workers in a loop.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, ClassVar

import anyio
from gunicorn.arbiter import Arbiter
from gunicorn.workers.base import Worker
from hypercorn.config import Config, Sockets

from .. import _options as _config
from .._core import logging as _logging
from .._core.coordinator import ShutdownCoordinator
from .._core.signals import defer_signals
from ..gunicorn._master import (
    check_in_master,
    master_listens,
    metrics_for_master,
    worker_values,
)
from . import WorkerClass, serve

__all__ = ("HypercornTrioWorker", "HypercornUvloopWorker", "HypercornWorker")

#: The heartbeat's period, at most (a quarter of gunicorn's ``timeout`` if shorter).
_HEARTBEAT_S = 1.0


class HypercornWorker(Worker):  # type: ignore[misc]
    """A gunicorn worker serving the app with graceful hypercorn on asyncio."""

    WORKER_CLASS: ClassVar[WorkerClass] = "asyncio"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _logging.to_gunicorn(self.log.error_log)
        self.config = self._hypercorn_config()
        self.coordinator: ShutdownCoordinator | None = None
        self.middleware_options: dict[str, Any] = {}

    def _hypercorn_config(self) -> Config:
        cfg = self.cfg
        config = Config()
        config.errorlog = self.log.error_log
        config.accesslog = self.log.access_log if cfg.accesslog else None
        config.access_log_format = cfg.access_log_format
        config.keep_alive_timeout = cfg.keepalive
        config.backlog = cfg.backlog
        config.graceful_timeout = cfg.graceful_timeout  # informative: the coordinator decides
        config.max_requests = self.max_requests if cfg.max_requests > 0 else None
        config.worker_class = self.WORKER_CLASS
        if cfg.is_ssl:
            options = cfg.ssl_options
            config.certfile = options.get("certfile")
            config.keyfile = options.get("keyfile")
            config.keyfile_password = options.get("password")
            config.ca_certs = options.get("ca_certs")
            if options.get("ciphers"):
                config.ciphers = options["ciphers"]
        return config

    def init_signals(self) -> None:
        # Until the server listens, SIGTERM/SIGINT/SIGQUIT are kept, not acted on (the
        # server then installs its own handlers and delivers them); the other signals
        # go back to their defaults so gunicorn does not swallow subprocess exit codes.
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        defer_signals()
        signal.signal(signal.SIGUSR1, self.handle_usr1)
        signal.siginterrupt(signal.SIGUSR1, False)

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        """Check the ``GRACEFUL_*`` variables in the master (``check_in_master``)."""
        check_in_master(cfg, log)

    def run(self) -> None:
        try:
            values = worker_values(self.cfg)  # the master warned already
            self.coordinator = _config.build_coordinator(values, hard_exit=True)
            metrics_for_master(self.coordinator)
            self.coordinator.expect_relayed_signals(signal.SIGTERM)  # the master relays it
            self.coordinator.report_pod_serving(master_listens(self.ppid, self.sockets))
        except ValueError as exc:  # checked in the master: only if the environment changed
            self.log.error("graceful: %s", exc)
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
        self.middleware_options = _config.middleware_kwargs(values)
        if self.WORKER_CLASS == "trio":
            anyio.run(self._serve, backend="trio")
        else:
            anyio.run(
                self._serve,
                backend="asyncio",
                backend_options={"use_uvloop": self.WORKER_CLASS == "uvloop"},
            )

    async def _serve(self) -> None:
        coordinator = self.coordinator
        assert coordinator is not None
        coordinator.start_background(self._heartbeat)
        secure = bool(self.cfg.is_ssl)
        listening = [getattr(s, "sock", s) for s in self.sockets]
        sockets = Sockets(
            secure_sockets=listening if secure else [],
            insecure_sockets=[] if secure else listening,
            quic_sockets=[],
        )
        try:
            await serve(
                self.wsgi,
                self.config,
                coordinator=coordinator,
                sockets=sockets,
                quick_signals=(signal.SIGQUIT, signal.SIGINT),
                **self.middleware_options,
            )
        except Exception as exc:
            if coordinator.shutdown_requested:
                raise
            self.log.error("graceful: the worker failed to start: %s", exc)
            sys.exit(Arbiter.WORKER_BOOT_ERROR)

    async def _heartbeat(self) -> None:
        """Tell the master we are alive; shut down if the master went away."""
        period = min(_HEARTBEAT_S, max(0.05, self.timeout / 4))
        coordinator = self.coordinator
        assert coordinator is not None
        while True:
            self.notify()
            if self.ppid != os.getppid() and not coordinator.shutdown_requested:
                self.log.info("Parent changed, shutting down: %s", self)
                coordinator.request_shutdown("gunicorn master gone", drain_now=True)
            await anyio.sleep(period)


class HypercornUvloopWorker(HypercornWorker):
    """``HypercornWorker`` on uvloop."""

    WORKER_CLASS: ClassVar[WorkerClass] = "uvloop"


class HypercornTrioWorker(HypercornWorker):
    """``HypercornWorker`` on trio."""

    WORKER_CLASS: ClassVar[WorkerClass] = "trio"
