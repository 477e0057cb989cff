"""hypercorn that follows a ``graceful.ShutdownCoordinator``, on asyncio, uvloop and trio.

::

    import graceful.hypercorn
    from hypercorn.config import Config

    config = Config()
    config.bind = ["0.0.0.0:8000"]
    graceful.hypercorn.run(app, config, grace_period_s=30, idle_s=2)
    # or, in a running loop (asyncio, uvloop or trio):
    await graceful.hypercorn.serve(app, config, coordinator=coordinator)

Unlike stock hypercorn, the listeners stay open while the policy accepts and close at
*draining* without resetting their backlog; idle HTTP/1.1 connections get
``idle_grace_s`` to send one more request and HTTP/2 connections get a GOAWAY once no
response is in flight; at *stopping* what is left is cut (a 503 where no response had
started) and lifespan shutdown runs, all within the coordinator's deadlines, on every
Python version and loop: ``config.graceful_timeout`` is not used and
``Server.wait_closed()`` (pgjones/hypercorn#308) is never awaited.  Without a
``shutdown_trigger``, SIGTERM and SIGINT request shutdown (a second one escalates) and
SIGQUIT stops at once; with one, no handler is installed.

``docs/hypercorn.md`` has the details: what changes against stock hypercorn, HTTP/2 and
GOAWAY, and how the worker is built from hypercorn's parts (the private
modules of this package: ``_server``, ``_connection``, ``_hot``, ``_asyncio``, ``_trio``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal, cast

import anyio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config, Sockets
from hypercorn.typing import AppWrapper, ASGIReceiveCallable, ASGISendCallable, Scope
from hypercorn.utils import load_application
from hypercorn.utils import wrap_app as hypercorn_wrap_app
from typing_extensions import final

from .. import _options as _config
from .._core import logging as _logging
from .._core.coordinator import ShutdownCoordinator, _check_coordinator, _check_signals
from .._core.engine import _check_callable
from .._core.policy import Policy, _check_bool, _check_seconds
from .._core.signals import QUICK_SIGNALS, teardown_guard
from ..asgi import GracefulMiddleware, check_options
from ._asyncio import _AsyncioWorker
from ._server import HANDLED_SIGNALS as HANDLED_SIGNALS
from ._trio import _TrioWorker

__all__ = ("run", "serve")

WorkerClass = Literal["asyncio", "uvloop", "trio"]
WORKER_CLASSES: Final = ("asyncio", "uvloop", "trio")


# ------------------------------------------------------------------------ the app


@final
class _GracefulApp:
    """hypercorn's WSGI app wrapper behind ``GracefulMiddleware`` (ASGI apps:
    ``graceful.hypercorn._hot``).

    hypercorn calls apps with two extra arguments (``sync_spawn``, ``call_soon``) that
    differ per connection; the middleware speaks plain ASGI.  The extras travel through
    a context variable set for the duration of the call, so WSGI apps (whose wrapper
    needs them) are tracked like ASGI ones.
    """

    __slots__ = ("_extras", "_inner", "_middleware")

    def __init__(self, inner: AppWrapper, middleware: Callable[[Any], GracefulMiddleware]) -> None:
        self._inner = inner
        self._extras: contextvars.ContextVar[tuple[Callable[..., Any], Callable[..., Any]]] = (
            contextvars.ContextVar("graceful_hypercorn_extras")
        )
        self._middleware = middleware(self._call_inner)

    async def _call_inner(self, scope: Any, receive: Any, send: Any) -> None:
        sync_spawn, call_soon = self._extras.get()
        await self._inner(scope, receive, send, sync_spawn, call_soon)

    async def __call__(
        self,
        scope: Scope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        sync_spawn: Callable[..., Any],
        call_soon: Callable[..., Any],
    ) -> None:
        token = self._extras.set((sync_spawn, call_soon))
        try:
            await self._middleware(cast(Any, scope), cast(Any, receive), cast(Any, send))
        finally:
            self._extras.reset(token)


# --------------------------------------------------------------------- public


def _current_backend() -> str:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return "trio"
    raise RuntimeError("graceful.hypercorn.serve() needs a running asyncio or trio event loop")


def _app_wrapper(
    app: Any,
    config: Config,
    coordinator: ShutdownCoordinator,
    *,
    wrap_app: bool,
    mode: Literal["asgi", "wsgi"] | None,
    middleware_options: dict[str, Any],
) -> AppWrapper | GracefulMiddleware:
    """hypercorn's app: an ASGI app behind the middleware is returned as the middleware
    (the worker's hot path, ``graceful.hypercorn._hot``, calls it), a WSGI app wrapped
    in ``_GracefulApp``, an unwrapped app as hypercorn wraps it."""
    if isinstance(app, str):
        inner = load_application(app, config.wsgi_max_body_size)
    else:
        inner = hypercorn_wrap_app(app, config.wsgi_max_body_size, mode)
    if not wrap_app:
        return inner
    if type(inner) is ASGIWrapper:  # an ASGI app: it ignores the two extras
        app_ = cast(Any, inner.app)
        return GracefulMiddleware(app_, coordinator=coordinator, **middleware_options)
    return _GracefulApp(
        inner,
        lambda asgi: GracefulMiddleware(asgi, coordinator=coordinator, **middleware_options),
    )


async def serve(
    app: Any,
    config: Config,
    *,
    coordinator: ShutdownCoordinator | None = None,
    wrap_app: bool = True,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    sockets: Sockets | None = None,
    mode: Literal["asgi", "wsgi"] | None = None,
    quick_signals: tuple[int, ...] = QUICK_SIGNALS,
    idle_grace_s: float = 1.0,
    **middleware_options: Any,
) -> None:
    """Serve ``app`` with hypercorn in the running event loop until the coordinator stops.

    Runs on whatever loop is running: asyncio (uvloop too) or trio.

    Args:
        app: An ASGI or WSGI app, or hypercorn's ``"module:app"`` path.
        config: The hypercorn configuration (``bind``, TLS, timeouts, logging).
            ``graceful_timeout`` and ``workers`` are not used: the coordinator's
            deadlines bound the drain, and this serves one process.
        coordinator: The process's coordinator (a new one with the default policy if
            omitted).  Its ``graceful.ShutdownCoordinator.run`` is run here.
        wrap_app: Wrap the app in ``graceful.asgi.GracefulMiddleware``.  Pass
            ``False`` if you added it yourself (with the same coordinator).
        shutdown_trigger: hypercorn's convention: when the awaitable it returns
            completes, shutdown is requested.  Without one, SIGTERM and SIGINT request
            shutdown (a second one escalates) and SIGQUIT stops at once.
        sockets: Listening sockets to serve instead of those ``config`` binds (a
            supervisor's, gunicorn's).
        mode: ``"asgi"`` or ``"wsgi"`` when hypercorn cannot tell.
        quick_signals: Signals that stop at once instead of starting the policy
            (gunicorn workers add SIGINT, its quick shutdown).
        idle_grace_s: When draining begins, how long an HTTP/1.1 connection with no
            request in progress may still send one (it is answered with
            ``Connection: close``); connections accepted later get the same window.
        middleware_options: Keyword arguments for the middleware (health paths,
            ``websocket_close_grace_s``).

    graceful's own lines go through hypercorn's error log (its format, at its
    ``loglevel``) unless the application configured logging.

    Raises:
        RuntimeError: outside an asyncio or trio event loop.
    """
    _check_app(app)
    _check_config(config)
    coordinator = ShutdownCoordinator() if coordinator is None else _check_coordinator(coordinator)
    _check_bool("wrap_app", wrap_app)
    if shutdown_trigger is not None:
        _check_callable("shutdown_trigger", shutdown_trigger)
    if mode not in (None, "asgi", "wsgi"):
        raise ValueError(f"mode must be 'asgi', 'wsgi' or None, got {mode!r}")
    quick_signals = _check_signals("quick_signals", quick_signals)
    idle_grace_s = _check_seconds("idle_grace_s", idle_grace_s)
    check_options("graceful.hypercorn.serve", **middleware_options)
    if "management_port" in middleware_options and "management_host" not in middleware_options:
        middleware_options["management_host"] = _bind_host(config)  # the app's own address
    _logging.through("hypercorn.error", _logging.level_of(str(config.loglevel or "info").lower()))
    wrapper = _app_wrapper(
        app,
        config,
        coordinator,
        wrap_app=wrap_app,
        mode=mode,
        middleware_options=middleware_options,
    )
    worker_type = _AsyncioWorker if _current_backend() == "asyncio" else _TrioWorker
    worker = worker_type(
        wrapper,
        config,
        coordinator=coordinator,
        sockets=sockets,
        shutdown_trigger=shutdown_trigger,
        quick_signals=quick_signals,
        idle_grace_s=idle_grace_s,
    )
    await worker.serve()


def run(
    app: Any,
    config: Config | None = None,
    *,
    worker_class: WorkerClass | None = None,
    coordinator: ShutdownCoordinator | None = None,
    policy: Policy | str | None = None,
    **kwargs: Any,
) -> None:
    """Run ``serve`` in a new event loop (like ``hypercorn``'s command, one process).

    Args:
        app: An ASGI or WSGI app, or ``"module:app"``.
        config: The hypercorn configuration (default: ``Config()``, port 8000): the
            server's own settings (``bind``, TLS, ``keep_alive_timeout``, ``loglevel``).
        worker_class: ``"asyncio"``, ``"uvloop"`` or ``"trio"`` (default:
            ``config.worker_class``).
        coordinator: The coordinator (default: a new one, from ``policy`` and
            graceful's options below).
        policy: A ``graceful.Policy``, or a policy's name (``"serve-until-killed"``);
            only without ``coordinator``.
        kwargs: graceful's options by their Python names (``grace_period_s``,
            ``idle_s``, ``drain_timeout_s``, ``readiness_path``, …: as
            ``graceful.uvicorn.serve``), checked as ``graceful run``'s are, and
            ``serve``'s other arguments (``wrap_app``, ``shutdown_trigger``,
            ``sockets``, ``mode``, ``quick_signals``, ``idle_grace_s``).

    Raises:
        TypeError: an unknown keyword, or a value of the wrong type (the message names
            the keyword, the value and what is allowed).
        ValueError: a bad value, likewise.
    """
    caller = "graceful.hypercorn.run"
    _check_app(app)
    config = Config() if config is None else _check_config(config)
    worker = worker_class if worker_class is not None else config.worker_class
    if worker not in WORKER_CLASSES:
        raise ValueError(f"worker_class must be one of {', '.join(WORKER_CLASSES)}, got {worker!r}")
    ours, rest = _config.split_python(kwargs)
    accepted = set(inspect.signature(serve).parameters) - {"app", "config", "coordinator"}
    accepted -= {"middleware_options"}
    for name in rest:
        if name not in accepted:
            raise _config.unexpected_keyword(caller, name, accepted | set(ours))
    coordinator, middleware = _config.python_setup(
        caller, ours, coordinator=coordinator, policy=policy
    )
    main = functools.partial(serve, app, config, coordinator=coordinator, **rest, **middleware)
    # A signal during the teardown after the shutdown (the kubelet's SIGTERM right after
    # a preStop drain) is logged, not left to kill the process (status 143).
    with teardown_guard(lambda: coordinator.shutdown_requested):
        if worker == "trio":
            anyio.run(main, backend="trio")
        else:
            anyio.run(main, backend="asyncio", backend_options={"use_uvloop": worker == "uvloop"})


def _check_app(app: object) -> None:
    if not isinstance(app, str) and not callable(app):
        raise TypeError(
            f"app must be an ASGI or WSGI application or an import string 'module:app', got {app!r}"
        )


def _check_config(config: object) -> Config:
    if not isinstance(config, Config):
        raise TypeError(
            f"config must be a hypercorn.config.Config, got {type(config).__name__} {config!r}"
        )
    return config


def _bind_host(config: Config) -> str:
    """The host of hypercorn's first ``bind`` (``127.0.0.1`` for a socket or a UNIX
    path): where the management listener listens unless told otherwise."""
    bind = config.bind[0] if config.bind else ""
    if bind.startswith(("unix:", "fd://")) or ":" not in bind:
        return "127.0.0.1"
    host = bind.rsplit(":", 1)[0]
    return host.strip("[]") or "127.0.0.1"
