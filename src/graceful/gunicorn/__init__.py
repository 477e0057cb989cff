"""gunicorn worker classes: ``gunicorn -k graceful.gunicorn.UvicornWorker app:app``.

A drop-in for ``uvicorn_worker.UvicornWorker`` in which every worker follows the
shutdown policy, configured with the ``GRACEFUL_*`` variables of ``graceful run``
(``GRACEFUL_POLICY``, ``GRACEFUL_IDLE``, the health paths, … — see
``graceful run --help``; the settings gunicorn owns, such as the address, come from
gunicorn's own options):

* the variables are checked once, in the master, at start-up (gunicorn calls
  ``UvicornWorker.check_config`` there): a bad value stops gunicorn with one line
  instead of making every worker fail after it booted, to be respawned forever;
* gunicorn's ``graceful_timeout`` is the kill deadline: the master SIGKILLs a worker that
  outlives it, so each worker's drain ends ``GRACEFUL_KILL_MARGIN`` (1 s) before it.  A
  ``--graceful-timeout`` not above the default margin shrinks the margin to a quarter of
  it, with a warning; a ``GRACEFUL_KILL_MARGIN`` set explicitly that does not fit is
  refused;
* the worker keeps heartbeating (``notify()``) while accepting and draining, so the
  master's ``timeout`` never aborts a draining worker;
* SIGTERM (shutdown, HUP reload, ``TTOU``) starts the policy (a repeat is the master's
  relay, however late, never an escalation); SIGINT and SIGQUIT —
  gunicorn's quick shutdown — stop at once.  A signal that arrives while the app is
  imported is kept and acted on once the server runs;
* ``max_requests`` recycling drains at once (the sibling workers keep serving).

The same guarantees for the other servers, each importing only its own server:
``graceful.gunicorn.HypercornWorker`` (asyncio), ``HypercornUvloopWorker``,
``HypercornTrioWorker`` and ``AiohttpWorker``; for WSGI apps (Flask, Django),
``graceful.gunicorn.SyncWorker`` and ``ThreadWorker``, gunicorn's ``sync`` and
``gthread`` workers with the policies.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar

from gunicorn.arbiter import Arbiter
from gunicorn.workers.base import Worker

from .._core import logging as _logging
from .._core.signals import defer_signals
from .._options import ConfigError
from ._master import check_in_master, metrics_for_master, worker_values
from ._master import master_listens as master_listens

if TYPE_CHECKING:
    from ..aiohttp._worker import AiohttpWorker as AiohttpWorker
    from ..hypercorn._worker import HypercornTrioWorker as HypercornTrioWorker
    from ..hypercorn._worker import HypercornUvloopWorker as HypercornUvloopWorker
    from ..hypercorn._worker import HypercornWorker as HypercornWorker
    from ._pick import WSGIWorker as WSGIWorker
    from ._sync import SyncWorker as SyncWorker
    from ._thread import ThreadWorker as ThreadWorker

__all__ = (
    "AiohttpWorker",
    "HypercornTrioWorker",
    "HypercornUvloopWorker",
    "HypercornWorker",
    "SyncWorker",
    "ThreadWorker",
    "UvicornH11Worker",
    "UvicornWorker",
    "WSGIWorker",
    "master_listens",
)

_ELSEWHERE = {
    "SyncWorker": "graceful.gunicorn._sync",
    "ThreadWorker": "graceful.gunicorn._thread",
    "WSGIWorker": "graceful.gunicorn._pick",
    "AiohttpWorker": "graceful.aiohttp._worker",
    "HypercornWorker": "graceful.hypercorn._worker",
    "HypercornUvloopWorker": "graceful.hypercorn._worker",
    "HypercornTrioWorker": "graceful.hypercorn._worker",
}


def __getattr__(name: str) -> Any:
    """The hypercorn and aiohttp workers, imported on first use (each needs its server)."""
    module = _ELSEWHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _default_loop_factory(loop: str) -> LoopFactory:
    """uvicorn's ``auto``/``asyncio``/``uvloop`` (for uvicorn < 0.36, which has no
    ``Config.get_loop_factory``)."""
    if loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise
        else:
            factory: LoopFactory = uvloop.new_event_loop
            return factory
    return asyncio.new_event_loop


def _run_in_new_loop(main: Coroutine[Any, Any, None], loop_factory: LoopFactory | None) -> None:
    """``asyncio.run(main, loop_factory=…)`` on every supported Python."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main)
        return
    loop = (loop_factory or asyncio.new_event_loop)()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


class UvicornWorker(Worker):  # type: ignore[misc]
    """A gunicorn worker running a graceful ``graceful.uvicorn.Server``."""

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
        _logging.to_gunicorn(self.log.error_log)
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
        from uvicorn.config import Config  # here: the other workers need no uvicorn

        self.config = Config(**config_kwargs)

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        """Check the ``GRACEFUL_*`` variables in the master (``check_in_master``)."""
        check_in_master(cfg, log)

    def init_signals(self) -> None:
        # Reset gunicorn's handlers so that it does not swallow subprocess exit codes
        # (uvicorn#894).  SIGTERM, SIGINT and SIGQUIT are kept (not acted on) until the
        # server installs its handlers, which then deliver them: a signal while the app
        # is imported is neither lost nor fatal.
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        defer_signals()
        signal.signal(signal.SIGUSR1, self.handle_usr1)
        signal.siginterrupt(signal.SIGUSR1, False)

    async def _serve(self) -> None:
        self.config.app = self.wsgi
        try:
            values = worker_values(self.cfg)  # the master warned already
        except ConfigError as exc:  # checked in the master: only if the environment changed
            self.log.error("graceful: %s", exc)
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
        from ..uvicorn import build_server  # here: the other workers need no uvicorn

        server = build_server(
            values, self.config, quick_signals=(signal.SIGQUIT, signal.SIGINT), hard_exit=True
        )
        server.coordinator.expect_relayed_signals(signal.SIGTERM)  # the master relays it
        metrics_for_master(server.coordinator)
        server.coordinator.report_pod_serving(master_listens(self.ppid, self.sockets))
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)

    def run(self) -> None:
        get_loop_factory = getattr(self.config, "get_loop_factory", None)  # uvicorn >= 0.36
        if get_loop_factory is not None:
            loop_factory = get_loop_factory()
        else:
            loop_factory = _default_loop_factory(self.config.loop)
        _run_in_new_loop(self._serve(), loop_factory)

    async def callback_notify(self) -> None:
        self.notify()


class UvicornH11Worker(UvicornWorker):
    """``UvicornWorker`` with the pure-Python h11 parser and the asyncio loop."""

    CONFIG_KWARGS: ClassVar[dict[str, Any]] = {"loop": "asyncio", "http": "h11"}
