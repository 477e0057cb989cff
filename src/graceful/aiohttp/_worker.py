"""A gunicorn worker for aiohttp apps: ``gunicorn -k graceful.aiohttp._worker.AiohttpWorker``.

A drop-in for ``aiohttp.worker.GunicornWebWorker`` in which every worker follows the
shutdown policy (``GRACEFUL_POLICY``, ``GRACEFUL_IDLE``, … — see ``graceful run --help``)
through ``graceful.aiohttp.AppRunner``:

* gunicorn's ``graceful_timeout`` is the kill deadline (the master SIGKILLs a worker that
  outlives it), so the drain ends ``kill_margin_s`` before it — not after aiohttp's
  ``shutdown_timeout`` twice over;
* the worker heartbeats (``notify()``) while accepting and draining, so the master's
  ``timeout`` never aborts a draining worker;
* SIGTERM (shutdown, HUP reload, ``TTOU``) starts the policy; a repeat is the master's
  relay of a process group's signal, however late, never an escalation;
  SIGINT and SIGQUIT — gunicorn's quick shutdown — stop at once; signals that arrive
  while the app is imported are kept and handled once the worker serves;
* ``max_requests`` recycling and a changed parent drain at once (the siblings, or the
  new master, keep serving);
* the listening socket keeps gunicorn's ``--backlog`` (aiohttp's own worker re-listens
  it with 128).

The app may be an ``aiohttp.web.Application``, or a factory (sync or async)
returning one or a ``graceful.aiohttp.AppRunner`` (whose coordinator is then used
as it is).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import re
import signal
import ssl
import sys
from types import FrameType
from typing import Any

import gunicorn.sock
from aiohttp import web
from aiohttp.web_log import AccessLogger
from gunicorn.arbiter import Arbiter
from gunicorn.config import AccessLogFormat
from gunicorn.workers.base import Worker

from .. import _options as _config
from .._core import logging as _logging
from .._core.coordinator import ShutdownCoordinator
from .._core.policy import Phase
from .._core.signals import catch_signals, defer_signals
from ..gunicorn._master import (
    check_in_master,
    master_listens,
    metrics_for_master,
    worker_values,
)
from ._runner import AppRunner

__all__ = ("AiohttpWorker",)

logger = logging.getLogger("graceful")

_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
_QUICK = (signal.SIGINT, signal.SIGQUIT)


async def _never() -> None:
    await asyncio.Event().wait()


class AiohttpWorker(Worker):  # type: ignore[misc]
    """A gunicorn worker serving an aiohttp app with a graceful ``AppRunner``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # in the master, before the fork
        self.exit_code = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    # ----------------------------------------------------------------- process

    def init_process(self) -> None:
        # graceful's log lines go where gunicorn's error log goes.
        _logging.to_gunicorn(self.log.error_log)
        # A fresh event loop after the fork (gunicorn's master runs none).
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        super().init_process()

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        """Check the ``GRACEFUL_*`` variables in the master (``check_in_master``)."""
        check_in_master(cfg, log)

    def init_signals(self) -> None:
        # SIGTERM/SIGINT/SIGQUIT are recorded until the worker serves (the app is
        # imported meanwhile), then handled by the coordinator; the rest as gunicorn's.
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        defer_signals(_HANDLED)
        signal.signal(signal.SIGWINCH, self.handle_winch)
        signal.signal(signal.SIGUSR1, self.handle_usr1)
        signal.signal(signal.SIGABRT, self.handle_abort)
        signal.siginterrupt(signal.SIGUSR1, False)

    def run(self) -> None:
        assert self.loop is not None
        # gunicorn set booted before run(); the real boot (app, sites) happens here, and a
        # worker that fails before serving must exit with WORKER_BOOT_ERROR.
        self.booted = False
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
        if not self.booted:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
        sys.exit(self.exit_code)

    # ------------------------------------------------------------------ serving

    async def _runner(self) -> AppRunner:
        """The runner of the app: made here for an Application, with a coordinator
        configured from ``GRACEFUL_*`` and gunicorn's ``graceful_timeout``; or the
        factory's own ``AppRunner`` (and its coordinator)."""
        target: Any = self.wsgi
        if not isinstance(target, web.Application) and callable(target):
            target = target()
        if inspect.isawaitable(target):
            target = await target
        if isinstance(target, AppRunner):
            return target
        if not isinstance(target, web.Application):
            raise TypeError(
                "the app must be an aiohttp.web.Application, or a factory returning one or "
                f"a graceful.aiohttp.AppRunner; got {target!r}"
            )
        values = worker_values(self.cfg)
        coordinator = _config.build_coordinator(values, hard_exit=True)  # the process is ours
        metrics_for_master(coordinator)
        access_log = self.log.access_log if self.cfg.accesslog else None
        return AppRunner(
            target,
            coordinator=coordinator,
            logger=self.log,
            keepalive_timeout=self.cfg.keepalive,
            access_log=access_log,
            access_log_format=_access_log_format(self.cfg.access_log_format),
            shutdown_timeout=self.cfg.graceful_timeout / 100 * 95,
            **_config.middleware_kwargs(values),
        )

    async def _serve(self) -> None:
        runner = await self._runner()
        coordinator = runner.coordinator
        coordinator.expect_relayed_signals(signal.SIGTERM)  # the master relays it
        coordinator.report_pod_serving(master_listens(self.ppid, self.sockets))
        await runner.setup()
        try:
            context = _ssl_context(self.cfg) if self.cfg.is_ssl else None
            backlog = int(self.cfg.backlog)
            for sock in self.sockets:
                await web.SockSite(runner, sock, ssl_context=context, backlog=backlog).start()
            runner.adopt_sites()
            self.booted = True
            names = ", ".join(sorted(str(s.name) for s in runner.sites))
            logger.info("aiohttp worker serving on %s", names)

            def on_signal(signum: int) -> None:
                if signum in _QUICK:
                    self.alive = False
                with contextlib.suppress(Exception):
                    if signum in _QUICK:
                        self.cfg.worker_int(self)
                coordinator.signal_received(signum, quick=_QUICK)

            with catch_signals(_HANDLED, on_signal):
                run = asyncio.ensure_future(coordinator.run(shutdown_trigger=_never))
                try:
                    await self._heartbeat(coordinator, runner)
                finally:
                    if not run.done():
                        run.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await run
        finally:
            await runner.cleanup()
        coordinator.exit_soon()

    async def _heartbeat(self, coordinator: ShutdownCoordinator, runner: AppRunner) -> None:
        """Notify the master until the coordinator stopped; recycle on ``max_requests``
        or a new parent (draining at once: the siblings keep serving)."""
        interval = max(0.05, min(1.0, self.timeout / 4)) if self.timeout else 1.0
        pid = os.getpid()
        while True:
            self.notify()
            if not coordinator.shutdown_requested:
                server = runner.server
                if server is not None and server.requests_count > self.max_requests:
                    self.log.info("Max requests, shutting down: %s", self)
                    coordinator.request_shutdown("max requests", drain_now=True)
                elif pid == os.getpid() and self.ppid != os.getppid():
                    self.log.info("Parent changed, shutting down: %s", self)
                    coordinator.request_shutdown("parent changed", drain_now=True)
            if await coordinator.wait_for_phase(Phase.STOPPED, timeout_s=interval):
                return

    def handle_quit(self, sig: int, frame: FrameType | None) -> None:  # pragma: no cover
        # Only reached if something reinstalled gunicorn's handler: stop at once.
        self.alive = False
        self.cfg.worker_int(self)


def _access_log_format(source: str) -> str:
    """gunicorn's default access log format means aiohttp's default; a gunicorn-style
    format (``%(h)s``) cannot be used by aiohttp's access logger."""
    if source == AccessLogFormat.default:
        return AccessLogger.LOG_FORMAT
    if re.search(r"%\([^\)]+\)", source):
        raise ValueError(
            "gunicorn-style access log formats (%(name)s) are not supported by aiohttp's "
            "access logger; use aiohttp's format (https://docs.aiohttp.org/en/stable/"
            "logging.html#format-specification)"
        )
    return source


def _ssl_context(cfg: Any) -> ssl.SSLContext:
    """The server TLS context of gunicorn's ``--certfile``/``--keyfile`` options (and
    its ``ssl_context`` hook, where gunicorn has one)."""
    make = getattr(gunicorn.sock, "ssl_context", None)
    if make is not None:
        context: ssl.SSLContext = make(cfg)
        return context
    context = ssl.SSLContext(cfg.ssl_version)
    context.load_cert_chain(cfg.certfile, cfg.keyfile)
    context.verify_mode = cfg.cert_reqs
    if cfg.ca_certs:
        context.load_verify_locations(cfg.ca_certs)
    if cfg.ciphers:
        context.set_ciphers(cfg.ciphers)
    return context
