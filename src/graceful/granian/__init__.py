"""granian's embedded server following a ``graceful.ShutdownCoordinator``.

::

    import graceful.granian

    graceful.granian.run(app, port=8000, grace_period_s=30, idle_s=2)
    # or, in a running asyncio (or uvloop) loop:
    await graceful.granian.serve(app, port=8000, coordinator=coordinator)

granian (a Rust HTTP server) serves the ASGI app through its embedded server
(``granian.server.embed.Server``): one process, the asyncio loop that runs ``serve``.
Unlike stock granian, SIGTERM does not stop it: granian keeps accepting while the policy
accepts (readiness answers 503, responses say ``Connection: close`` when the policy
nudges); at *draining*, after ``idle_grace_s`` of ``Connection: close`` on every
response, granian's ``stop()`` closes its listener and its idle connections while the
requests in flight finish; at *stopping* what still runs is cut (a 503 where no response
had started) and granian's lifespan shutdown runs, within the coordinator's deadlines.
Without a ``shutdown_trigger``, SIGTERM and SIGINT request shutdown (a second one
escalates) and SIGQUIT stops at once; with one, no handler is installed.

granian's listener, accept backlog and connections live in Rust, out of graceful's
reach: ``docs/granian.md`` says what that means (no backlog hand-over, no listener
seal, no per-connection idle window) and how the adapter is built
(``graceful.granian._server``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Literal

import anyio

from .. import _options as _config
from .._core import logging as _logging
from .._core.coordinator import ShutdownCoordinator, _check_coordinator, _check_signals
from .._core.engine import _check_callable
from .._core.policy import Policy, _check_bool, _check_seconds
from .._core.signals import QUICK_SIGNALS, teardown_guard
from ..asgi import GracefulMiddleware, check_options
from ._server import HANDLED_SIGNALS as HANDLED_SIGNALS
from ._server import GranianShape, NotStarted

__all__ = ("NotStarted", "run", "serve")

Loop = Literal["asyncio", "uvloop"]
LOOPS: Final = ("asyncio", "uvloop")
#: ``granian.server.embed.Server``'s settings that graceful sets itself.
OWN_SETTINGS: Final = frozenset({"target", "address", "port", "uds", "interface", "task_impl"})


async def serve(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    granian_options: Mapping[str, Any] | None = None,
    coordinator: ShutdownCoordinator | None = None,
    wrap_app: bool = True,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    quick_signals: tuple[int, ...] = QUICK_SIGNALS,
    idle_grace_s: float = 1.0,
    **middleware_options: Any,
) -> None:
    """Serve ``app`` with granian's embedded server in the running asyncio loop until the
    coordinator stops.

    Args:
        app: An ASGI app, or ``"module:app"``.
        host: The address to bind (unless ``sock`` is given).
        port: The port to bind (0: any free port).
        sock: A listening socket to serve instead (a supervisor's); granian takes it
            over and closes it.
        granian_options: Keyword arguments of ``granian.server.embed.Server``: granian's
            own settings (``http``, ``websockets``, ``backlog``, ``http1_settings``,
            ``ssl_cert``, ``log_access``, …), except those graceful sets
            (``address``, ``port``, ``uds``, ``interface``, ``task_impl``).
        coordinator: The process's coordinator (a new one with the default policy if
            omitted).  Its ``graceful.ShutdownCoordinator.run`` is run here.
        wrap_app: Wrap the app in ``graceful.asgi.GracefulMiddleware``.  Pass
            ``False`` if you added it yourself (with the same coordinator).
        shutdown_trigger: When the awaitable it returns completes, shutdown is
            requested.  Without one, SIGTERM and SIGINT request shutdown (a second one
            escalates) and SIGQUIT stops at once.
        quick_signals: Signals that stop at once instead of starting the policy.
        idle_grace_s: When draining begins, how long granian still serves before its
            ``stop()`` closes the listener and every idle connection; meanwhile every
            response says ``Connection: close``.
        middleware_options: Keyword arguments for the middleware (health paths,
            ``management_port``, ``websocket_close_grace_s``).

    Raises:
        NotStarted: the application's lifespan startup failed.
        RuntimeError: outside an asyncio event loop.
    """
    _check_app(app)
    coordinator = ShutdownCoordinator() if coordinator is None else _check_coordinator(coordinator)
    _check_bool("wrap_app", wrap_app)
    if shutdown_trigger is not None:
        _check_callable("shutdown_trigger", shutdown_trigger)
    quick_signals = _check_signals("quick_signals", quick_signals)
    idle_grace_s = _check_seconds("idle_grace_s", idle_grace_s)
    options = _check_granian_options(granian_options)
    check_options("graceful.granian.serve", **middleware_options)
    if "management_port" in middleware_options and "management_host" not in middleware_options:
        middleware_options["management_host"] = host  # the app's own address
    level = options.get("log_level", "info")
    _logging.through("_granian", _logging.level_of(str(getattr(level, "value", level))))
    asgi = load_app(app) if isinstance(app, str) else app
    if wrap_app:
        asgi = GracefulMiddleware(asgi, coordinator=coordinator, **middleware_options)
    if sock is None:
        sock = _bind(host, port, int(options.get("backlog", 1024)))
    shape = GranianShape(
        asgi,
        sock,
        options,
        coordinator=coordinator,
        shutdown_trigger=shutdown_trigger,
        quick_signals=quick_signals,
        idle_grace_s=idle_grace_s,
    )
    await shape.serve()


def run(
    app: Any,
    *,
    loop: Loop = "asyncio",
    coordinator: ShutdownCoordinator | None = None,
    policy: Policy | str | None = None,
    **kwargs: Any,
) -> None:
    """Run ``serve`` in a new event loop (one process).

    Args:
        app: An ASGI app, or ``"module:app"``.
        loop: ``"asyncio"`` or ``"uvloop"``.
        coordinator: The coordinator (default: a new one, from ``policy`` and
            graceful's options below).
        policy: A ``graceful.Policy``, or a policy's name (``"serve-until-killed"``);
            only without ``coordinator``.
        kwargs: ``serve``'s arguments (``host``, ``port``, ``sock``,
            ``granian_options``, ``wrap_app``, ``shutdown_trigger``,
            ``quick_signals``, ``idle_grace_s``) and graceful's options by their
            Python names (``grace_period_s``, ``idle_s``, ``drain_timeout_s``,
            ``readiness_path``, …: as ``graceful.uvicorn.serve``), checked as
            ``graceful run`` checks them.

    Raises:
        TypeError: an unknown keyword, or a value of the wrong type.
        ValueError: a bad value, likewise.
        NotStarted: the application's lifespan startup failed.
    """
    caller = "graceful.granian.run"
    _check_app(app)
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}, got {loop!r}")
    ours, rest = _config.split_python(kwargs)
    accepted = set(inspect.signature(serve).parameters) - {"app", "coordinator"}
    accepted -= {"middleware_options"}
    for name in rest:
        if name not in accepted:
            raise _config.unexpected_keyword(caller, name, accepted | set(ours))
    coordinator, middleware = _config.python_setup(
        caller, ours, coordinator=coordinator, policy=policy
    )
    main = functools.partial(serve, app, coordinator=coordinator, **rest, **middleware)
    # A signal during the teardown after the shutdown is logged, not left to kill the
    # process (status 143).
    with teardown_guard(lambda: coordinator.shutdown_requested):
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


def load_app(path: str) -> Any:
    """The application ``"module:attribute"`` names (the attribute may be dotted)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"app must be 'module:attribute', got {path!r}")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def _check_app(app: object) -> None:
    if not isinstance(app, str) and not callable(app):
        raise TypeError(f"app must be an ASGI application or 'module:app', got {app!r}")


def _check_granian_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"granian_options must be a mapping, got {options!r}")
    from granian.server.embed import Server

    known = set(inspect.signature(Server).parameters) - OWN_SETTINGS
    for name in options:
        if name not in known:
            raise TypeError(
                f"granian_options: {name!r} is not a setting of granian's embedded server "
                f"that graceful leaves to granian (those are {', '.join(sorted(known))})"
            )
    return dict(options)


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket, set up as granian sets up its own."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(max(128, backlog))
    except OSError:
        sock.close()
        raise
    return sock
