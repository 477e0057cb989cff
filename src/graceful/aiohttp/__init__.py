"""aiohttp that follows a ``graceful.ShutdownCoordinator``.

::

    import graceful.aiohttp
    graceful.aiohttp.run_app(app, host="0.0.0.0", port=8080,
                             grace_period_s=30, idle_s=2)  # graceful's options by name

or, with a runner of your own::

    coordinator = graceful.ShutdownCoordinator()
    runner = graceful.aiohttp.AppRunner(app, coordinator=coordinator)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", 8080).start()
    runner.adopt_sites()             # count connections from accept() from now on
    await coordinator.run()          # SIGTERM/SIGINT/SIGQUIT handled; returns when stopped
    await runner.cleanup()

``run_app`` is ``aiohttp.web.run_app`` built from two pieces: ``AppRunner``, a drop-in
for ``aiohttp.web.AppRunner``, is the connection side (listeners, connections,
``on_shutdown`` and ``on_cleanup``); ``setup`` installs the request side
(``Middleware``, the health routes and
``DRAIN_SIGNAL_KEY``), and the runner calls it if you did not.  What each phase changes
against stock aiohttp, and the few aiohttp private attributes read (nothing is
patched): ``docs/aiohttp.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, cast

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.log import access_logger
from aiohttp.typedefs import PathLike
from aiohttp.web_log import AccessLogger

from .. import _options as _config
from .._core import logging as _logging
from .._core.coordinator import ShutdownCoordinator
from .._core.drain_signal import DrainSignal as DrainSignal
from .._core.policy import Phase, Policy, _check_seconds
from .._core.signals import teardown_guard
from ._middleware import Middleware as Middleware
from ._runner import AppRunner as AppRunner
from ._setup import DRAIN_SIGNAL_KEY as DRAIN_SIGNAL_KEY
from ._setup import drain_signal as drain_signal
from ._setup import setup as setup

__all__ = (
    "DRAIN_SIGNAL_KEY",
    "AppRunner",
    "DrainSignal",
    "Middleware",
    "drain_signal",
    "load_app",
    "run_app",
    "serve_target",
    "setup",
)

logger = logging.getLogger("graceful")


# ------------------------------------------------------------------- run_app


#: aiohttp's default ``shutdown_timeout``: the longest drain, unless told otherwise.
_DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 60.0


async def _never() -> None:
    await asyncio.Event().wait()


def _make_sites(
    runner: web.BaseRunner,
    *,
    host: str | Iterable[str] | None,
    port: int | None,
    path: PathLike | Iterable[PathLike] | None,
    sock: socket.socket | Iterable[socket.socket] | None,
    ssl_context: Any,
    backlog: int,
    reuse_address: bool | None,
    reuse_port: bool | None,
) -> list[web.BaseSite]:
    """The sites ``aiohttp.web.run_app`` would make for these arguments."""
    sites: list[web.BaseSite] = []
    tcp = {
        "ssl_context": ssl_context,
        "backlog": backlog,
        "reuse_address": reuse_address,
        "reuse_port": reuse_port,
    }
    if host is not None:
        hosts = [host] if isinstance(host, str) else list(host)
        sites.extend(web.TCPSite(runner, h, port, **tcp) for h in hosts)
    elif (path is None and sock is None) or port is not None:
        sites.append(web.TCPSite(runner, port=port, **tcp))
    if path is not None:
        paths = [path] if isinstance(path, (str, bytes)) or hasattr(path, "__fspath__") else path
        for p in cast(Iterable[PathLike], paths):
            sites.append(web.UnixSite(runner, p, ssl_context=ssl_context, backlog=backlog))
    if sock is not None:
        socks = [sock] if isinstance(sock, socket.socket) or hasattr(sock, "fileno") else sock
        for s in cast(Iterable[socket.socket], socks):
            sites.append(web.SockSite(runner, s, ssl_context=ssl_context, backlog=backlog))
    return sites


async def _serve(
    app: web.Application | Awaitable[web.Application],
    coordinator: ShutdownCoordinator,
    *,
    handle_signals: bool,
    print: Callable[..., None] | None,
    sites: dict[str, Any],
    runner_options: dict[str, Any],
) -> None:
    if inspect.isawaitable(app):
        app = await app
    if not isinstance(app, web.Application):
        raise TypeError(f"expected an aiohttp.web.Application, got {app!r}")
    runner = AppRunner(app, coordinator=coordinator, **runner_options)
    await runner.setup()
    try:
        for site in _make_sites(runner, **sites):
            await site.start()
        runner.adopt_sites()
        names = sorted(str(s.name) for s in runner.sites)
        if print is not None:  # aiohttp's banner, as web.run_app prints it
            print(
                "======== Running on {} ========\n(Press CTRL+C to quit)".format(", ".join(names))
            )
        else:
            for name in names:
                logger.info("aiohttp running on %s", name)
        await coordinator.run(shutdown_trigger=None if handle_signals else _never)
    finally:
        await runner.cleanup()
    if coordinator.phase is Phase.STOPPED:
        coordinator.exit_soon()


def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception during run_app() shutdown",
                    "exception": task.exception(),
                    "task": task,
                }
            )


def run_app(
    app: web.Application | Awaitable[web.Application],
    *,
    coordinator: ShutdownCoordinator | None = None,
    policy: Policy | str | None = None,
    host: str | Iterable[str] | None = None,
    port: int | None = None,
    path: PathLike | Iterable[PathLike] | None = None,
    sock: socket.socket | Iterable[socket.socket] | None = None,
    shutdown_timeout: float = _DEFAULT_SHUTDOWN_TIMEOUT_S,
    keepalive_timeout: float = 75.0,
    ssl_context: Any = None,
    print: Callable[..., None] | None = print,
    backlog: int = 128,
    access_log_class: type[AbstractAccessLogger] = AccessLogger,
    access_log_format: str = AccessLogger.LOG_FORMAT,
    access_log: logging.Logger | None = access_logger,
    handle_signals: bool = True,
    reuse_address: bool | None = None,
    reuse_port: bool | None = None,
    handler_cancellation: bool = False,
    loop: asyncio.AbstractEventLoop | None = None,
    idle_grace_s: float = 1.0,
    readiness_path: str | None = "/readyz",
    liveness_path: str | None = "/livez",
    prestop_path: str | None = None,
    websocket_close_grace_s: float = 1.0,
    metrics_path: str | None = None,
    readiness_on_shutdown: str = "fail",
    management_port: int | None = None,
    management_host: str | None = None,
    health_on_app_port: bool = False,
    **kwargs: Any,
) -> None:
    """Like ``aiohttp.web.run_app``, with graceful shutdown.

    The parameters are aiohttp's, except:

    Args:
        coordinator: The process's coordinator; by default a new one from ``policy``,
            ``shutdown_timeout`` and graceful's options in ``kwargs``.
        policy: When accepting ends: a ``graceful.Policy``, or a policy's name
            (``"serve-until-killed"``, as ``graceful run --policy``); only without
            ``coordinator``.
        shutdown_timeout: The longest drain (the coordinator's ``drain_timeout_s``,
            ``graceful run --drain-timeout``), itself bounded by the kill deadline;
            ignored with ``coordinator``.
        handle_signals: ``True``: SIGTERM and SIGINT request shutdown (a second one
            escalates), SIGQUIT stops at once; the previous handlers are restored on
            return.  ``False``: shutdown only through the coordinator's API (or the
            preStop route).
        idle_grace_s: See ``AppRunner``.
        readiness_path: See ``setup``.
        liveness_path: See ``setup``.
        prestop_path: See ``setup``.
        websocket_close_grace_s: See ``setup``.
        metrics_path: See ``setup``.
        readiness_on_shutdown: See ``setup``.
        management_port: See ``setup``.
        management_host: See ``setup``; by default ``host`` (``127.0.0.1`` without one).
        health_on_app_port: See ``setup``.
        kwargs: graceful's options that configure a new coordinator, by their Python
            names (``grace_period_s``, ``kill_margin_s``, ``idle_s``, ``min_wait_s``,
            ``max_wait_s``, ``nudge_clients``, ``drain_timeout_s`` instead of
            ``shutdown_timeout``, ``kubernetes``, ``wait_for_endpoints``), checked as
            ``graceful run``'s are; the rest is passed to the ``AppRunner`` (and on to
            aiohttp's request handler).

    Raises:
        TypeError: a value of the wrong type (the message names the keyword, the value
            and what is allowed).
        ValueError: a bad value, likewise.

    graceful's own lines (the policy, the phases) go to standard error unless the
    application configured logging (a handler on the ``graceful`` or the root logger).
    """
    caller = "graceful.aiohttp.run_app"
    ours, kwargs = _config.split_python(kwargs)
    if coordinator is None:
        _check_seconds("shutdown_timeout", shutdown_timeout)
        if "drain_timeout_s" not in ours:
            ours["drain_timeout_s"] = shutdown_timeout
        elif shutdown_timeout != _DEFAULT_SHUTDOWN_TIMEOUT_S:
            raise ValueError(
                f"{caller}: shutdown_timeout and drain_timeout_s are the same setting "
                "(the longest drain); give one"
            )
    # The middleware's options are run_app's own arguments: none is left in ``ours``.
    coordinator, _ = _config.python_setup(caller, ours, coordinator=coordinator, policy=policy)
    if loop is None:
        loop = asyncio.new_event_loop()
    # graceful's phase lines on standard error, unless the application configured logging.
    _logging.to_stderr()
    # As aiohttp: configure the access log in debug mode only, and only the default one.
    if loop.get_debug() and access_log is not None and access_log.name == "aiohttp.access":
        if access_log.level == logging.NOTSET:
            access_log.setLevel(logging.DEBUG)
        if not access_log.hasHandlers():
            access_log.addHandler(logging.StreamHandler())
    main_task = loop.create_task(
        _serve(
            app,
            coordinator,
            handle_signals=handle_signals,
            print=print,
            sites={
                "host": host,
                "port": port,
                "path": path,
                "sock": sock,
                "ssl_context": ssl_context,
                "backlog": backlog,
                "reuse_address": reuse_address,
                "reuse_port": reuse_port,
            },
            runner_options={
                "idle_grace_s": idle_grace_s,
                "readiness_path": readiness_path,
                "liveness_path": liveness_path,
                "prestop_path": prestop_path,
                "websocket_close_grace_s": websocket_close_grace_s,
                "metrics_path": metrics_path,
                "readiness_on_shutdown": readiness_on_shutdown,
                "management_port": management_port,
                "management_host": management_host or _one_host(host),
                "health_on_app_port": health_on_app_port,
                "keepalive_timeout": keepalive_timeout,
                "access_log_class": access_log_class,
                "access_log_format": access_log_format,
                "access_log": access_log,
                "handler_cancellation": handler_cancellation,
                **kwargs,
            },
        )
    )
    # Signals are recorded before the coordinator runs and after it ran, until the loop
    # is closed: the teardown (cleanup, cancelling left-over tasks) is no place for a
    # shutdown signal's default action.
    with teardown_guard(lambda: coordinator.shutdown_requested, enabled=handle_signals):
        try:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(main_task)
        except (web.GracefulExit, KeyboardInterrupt):
            pass
        finally:
            try:
                if not main_task.done():
                    main_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        loop.run_until_complete(main_task)
            finally:
                _cancel_tasks(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()


# ---------------------------------------------------------------------- targets


def load_app(target: str) -> web.Application | Awaitable[web.Application]:
    """Import ``MODULE:APP``: an ``aiohttp.web.Application``, or a factory (sync or
    async, without arguments) returning one.

    A factory is called here; an async one's coroutine is returned for ``run_app``
    to await in its event loop.

    Raises:
        ValueError: if ``target`` is not ``MODULE:APP`` or ``APP`` is missing.
        TypeError: if ``target`` is not a string, or ``APP`` is neither an
            application nor a factory.
    """
    if not isinstance(target, str):
        raise TypeError(f"target must be a str 'package.module:app', got {target!r}")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"MODULE:APP must look like 'package.module:app', got {target!r}")
    module = importlib.import_module(module_name)
    try:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, web.Application):
        return obj
    if callable(obj):
        result = obj()
        if isinstance(result, web.Application) or inspect.isawaitable(result):
            return cast("web.Application | Awaitable[web.Application]", result)
        raise TypeError(f"{target} returned {result!r}, not an aiohttp.web.Application")
    raise TypeError(f"{target} is {obj!r}, not an aiohttp.web.Application or a factory")


def serve_target(target: str, **options: Any) -> None:
    """Import ``MODULE:APP`` (see ``load_app``) and serve it with ``run_app``
    (``options`` are its keyword arguments)."""
    run_app(load_app(target), **options)


def _one_host(host: object) -> str:
    """The management listener's default address: ``run_app``'s ``host`` (the first of
    several), ``127.0.0.1`` without one (a UNIX socket, a socket of the caller's)."""
    if isinstance(host, str) and host:
        return host
    if isinstance(host, (list, tuple)) and host and isinstance(host[0], str):
        return host[0]
    return "127.0.0.1"
