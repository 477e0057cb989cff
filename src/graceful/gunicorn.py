"""gunicorn worker classes: ``gunicorn -k graceful.gunicorn.UvicornWorker app:app``.

A drop-in for ``uvicorn_worker.UvicornWorker`` in which every worker follows the
shutdown policy (chosen with ``GRACEFUL_POLICY``, ``GRACEFUL_IDLE``, … — see
``graceful run --help``):

* gunicorn's ``graceful_timeout`` is the kill deadline: the master SIGKILLs a worker that
  outlives it, so each worker's drain ends ``kill_margin_s`` before it;
* the worker keeps heartbeating (``notify()``) while accepting and draining, so the
  master's ``timeout`` never aborts a draining worker;
* SIGTERM (shutdown, HUP reload, ``TTOU``) starts the policy; SIGINT and SIGQUIT —
  gunicorn's quick shutdown — stop at once;
* ``max_requests`` recycling drains at once (the sibling workers keep serving).
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any, ClassVar

from gunicorn.arbiter import Arbiter
from gunicorn.workers.base import Worker
from uvicorn._compat import asyncio_run  # what uvicorn-worker uses, too
from uvicorn.config import Config

from ._run import coordinator_from_environment
from .uvicorn import Server

__all__ = ("UvicornH11Worker", "UvicornWorker")


class UvicornWorker(Worker):  # type: ignore[misc]
    """A gunicorn worker running a graceful :class:`graceful.uvicorn.Server`."""

    CONFIG_KWARGS: ClassVar[dict[str, Any]] = {"loop": "auto", "http": "auto"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, source in (
            ("uvicorn.error", self.log.error_log),
            ("uvicorn.access", self.log.access_log),
        ):
            target = logging.getLogger(name)
            target.handlers = source.handlers
            target.setLevel(source.level)
            target.propagate = False
        graceful_logger = logging.getLogger("graceful")
        graceful_logger.handlers = self.log.error_log.handlers
        graceful_logger.setLevel(logging.INFO)
        graceful_logger.propagate = False
        config_kwargs: dict[str, Any] = {
            "app": None,
            "log_config": None,
            "timeout_keep_alive": self.cfg.keepalive,
            "timeout_notify": self.timeout,
            "callback_notify": self.callback_notify,
            "limit_max_requests": self.max_requests or None,
            "forwarded_allow_ips": self.cfg.forwarded_allow_ips,
        }
        if self.cfg.is_ssl:
            options = self.cfg.ssl_options
            config_kwargs.update(
                ssl_keyfile=options.get("keyfile"),
                ssl_certfile=options.get("certfile"),
                ssl_keyfile_password=options.get("password"),
                ssl_version=options.get("ssl_version"),
                ssl_cert_reqs=options.get("cert_reqs"),
                ssl_ca_certs=options.get("ca_certs"),
                ssl_ciphers=options.get("ciphers"),
            )
        if self.cfg.settings["backlog"].value:
            config_kwargs["backlog"] = self.cfg.settings["backlog"].value
        config_kwargs.update(self.CONFIG_KWARGS)
        self.config = Config(**config_kwargs)

    def init_signals(self) -> None:
        # The server installs SIGTERM/SIGINT/SIGQUIT handlers itself; reset the rest so
        # gunicorn does not swallow subprocess exit codes (uvicorn#894).
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, self.handle_usr1)
        signal.siginterrupt(signal.SIGUSR1, False)

    async def _serve(self) -> None:
        self.config.app = self.wsgi
        coordinator = coordinator_from_environment(grace_period_s=self.cfg.graceful_timeout)
        server = Server(
            self.config,
            coordinator=coordinator,
            quick_signals=(signal.SIGQUIT, signal.SIGINT),
        )
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)

    def run(self) -> None:
        asyncio_run(self._serve(), loop_factory=self.config.get_loop_factory())

    async def callback_notify(self) -> None:
        self.notify()


class UvicornH11Worker(UvicornWorker):
    """:class:`UvicornWorker` with the pure-Python h11 parser and the asyncio loop."""

    CONFIG_KWARGS: ClassVar[dict[str, Any]] = {"loop": "asyncio", "http": "h11"}
