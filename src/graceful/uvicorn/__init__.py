"""uvicorn that follows a ``graceful.ShutdownCoordinator``.

::

    import graceful.uvicorn
    graceful.uvicorn.run("myapp:app", host="0.0.0.0", port=8000,
                         grace_period_s=30, idle_s=2)  # graceful's options by name

or, with a config of your own, ``await graceful.uvicorn.Server(config).serve()``.

What changes against stock uvicorn
----------------------------------
Stock uvicorn, at SIGTERM, closes its listener at once (connections in the accept backlog
are reset), closes idle keep-alive connections, waits for the rest and then runs lifespan
shutdown.  ``Server`` instead hands the signal to the coordinator and follows its
phases:

* *accepting*: the listener stays open, new connections count as activity, responses
  carry ``Connection: close`` if the policy nudges, readiness answers 503;
* *draining*: the listener is closed without resetting the backlog, idle keep-alive
  connections are closed, in-flight requests finish (with ``Connection: close``),
  websockets get a close frame with code 1001 after a grace period;
* *stopping* (drain deadline, second signal, SIGQUIT): requests still running are
  cancelled — a client whose response had not started gets a 503 with
  ``Connection: close``, one mid-body gets its connection closed — then lifespan shutdown
  runs (bounded by the kill deadline) and the server exits.

It uses uvicorn's public and de-facto-public surface only: ``Config(http=…)`` (tracking
subclasses of the configured protocol classes), ``Server.handle_exit``,
``capture_signals``, ``main_loop``/``on_tick``, ``shutdown``, ``servers``,
``server_state``; no uvicorn module is patched.  Works with ``http="h11"``,
``"httptools"`` and ``"auto"``, and with uvloop.

The hot path
------------
With uvicorn's ``httptools`` protocol (what ``uvicorn[standard]`` picks), a request
served while nothing shuts down goes from uvicorn straight to the application, past the
middleware; at the shutdown request the requests in flight are adopted and every later
one takes the middleware's full path (``graceful.uvicorn._shape.HotPath``).  The seams
are ``Config.loaded_app``, uvicorn's task set and the lifespan state; no uvicorn method
is replaced and no private name of uvicorn's is on the request path.

Signals: SIGTERM and SIGINT request shutdown (a second one escalates, a third exits at
once), SIGQUIT stops at once.  uvicorn re-raises captured signals after shutdown so that
the default action runs; this server does not, so the process exits 0 after a graceful
shutdown.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Final

import uvicorn

from .. import _options as _config
from .._core.coordinator import ShutdownCoordinator
from .._core.policy import Policy
from .._core.signals import teardown_guard
from ..asgi import ASGIApp
from ._server import HANDLED_SIGNALS as HANDLED_SIGNALS
from ._server import Server

__all__ = ("Server", "run", "serve")

logger = logging.getLogger("graceful")


#: ``uvicorn.Config`` settings ``Server`` does not carry out: ``uvicorn.run`` does
#: them around the server (several processes, the reloader); not here.
_NOT_HERE: Final = {
    "workers": "graceful run --workers N, or gunicorn with graceful.gunicorn.UvicornWorker",
    "reload": "graceful run --reload",
}
#: uvicorn's name for the longest drain (``graceful run --timeout-graceful-shutdown``).
_DRAIN_ALIAS: Final = "timeout_graceful_shutdown"


def _make_server(
    caller: str,
    app: ASGIApp | str,
    coordinator: ShutdownCoordinator | None,
    policy: Policy | str | None,
    kwargs: dict[str, Any],
) -> Server:
    """The server of ``run`` and ``serve``: graceful's options (by their Python names)
    build the coordinator and the middleware, checked as ``graceful run`` checks them;
    ``wrap_app`` and the rest go to ``uvicorn.Config``."""
    if not isinstance(app, str) and not callable(app):
        raise TypeError(
            f"app must be an ASGI application or an import string 'module:app', got {app!r}"
        )
    ours, rest = _config.split_python(kwargs)
    wrap_app = rest.pop("wrap_app", True)
    accepted = set(inspect.signature(uvicorn.Config).parameters) - {"app"}
    for name in rest:
        if name not in accepted:
            known = accepted | set(ours) | {o.python for o in _config.python_options()}
            raise _config.unexpected_keyword(caller, name, known)
    for name, instead in _NOT_HERE.items():
        if rest.get(name):
            raise ValueError(
                f"{caller}: {name}={rest[name]!r} is not supported here (one process, no "
                f"reloader): use {instead}"
            )
    drain = rest.pop(_DRAIN_ALIAS, None)
    if drain is not None:  # uvicorn's name for the longest drain, as on the command line
        if "drain_timeout_s" in ours:
            raise ValueError(
                f"{caller}: {_DRAIN_ALIAS} and drain_timeout_s are the same setting "
                "(the longest drain); give one"
            )
        ours["drain_timeout_s"] = drain
    coordinator, middleware = _config.python_setup(
        caller, ours, coordinator=coordinator, policy=policy
    )
    config = uvicorn.Config(app, **rest)
    if "management_port" in middleware and "management_host" not in middleware:
        middleware["management_host"] = config.host  # the app's own address
    return Server(config, coordinator=coordinator, wrap_app=wrap_app, **middleware)


async def serve(
    app: ASGIApp | str,
    *,
    coordinator: ShutdownCoordinator | None = None,
    policy: Policy | str | None = None,
    **kwargs: Any,
) -> None:
    """Serve ``app`` with a graceful ``Server`` in the running event loop.

    Args:
        app: An ASGI application, or an import string ``"module:app"``.
        coordinator: The process's coordinator (default: a new one, from ``policy``
            and graceful's options below).
        policy: A ``graceful.Policy``, or a policy's name (``"serve-until-killed"``, as
            ``graceful run --policy``); only without ``coordinator``.
        kwargs: graceful's options, by their Python names — every ``graceful run``
            option that is not uvicorn's: ``idle_s``, ``min_wait_s``, ``max_wait_s``,
            ``nudge_clients``, ``drain_timeout_s``, ``grace_period_s``,
            ``kill_margin_s``, ``kubernetes``, ``wait_for_endpoints``,
            ``readiness_on_shutdown``, ``readiness_path``, ``liveness_path``,
            ``prestop_path``, ``metrics_path``, ``websocket_close_grace_s`` (the
            configuration page lists each with its flag), checked as the command
            line's are; ``wrap_app`` (see ``Server``); everything else goes to
            ``uvicorn.Config`` (``host``, ``port``, ``log_level``, …).
            uvicorn's ``timeout_graceful_shutdown`` is ``drain_timeout_s``.  The
            options that configure the coordinator (all but the middleware's) are an
            error together with ``coordinator``.

    Raises:
        TypeError: an unknown keyword, or a value of the wrong type (the message names
            the keyword, the value and what is allowed).
        ValueError: a bad value, likewise; ``workers`` or ``reload`` (one process here).
    """
    await _make_server("graceful.uvicorn.serve", app, coordinator, policy, kwargs).serve()


def run(
    app: ASGIApp | str,
    *,
    coordinator: ShutdownCoordinator | None = None,
    policy: Policy | str | None = None,
    **kwargs: Any,
) -> None:
    """Like ``uvicorn.run`` (single process), with graceful shutdown; the arguments are
    ``serve``'s::

        graceful.uvicorn.run("myapp:app", host="0.0.0.0", port=8000,
                             grace_period_s=30, idle_s=2)

    A signal during the teardown after the shutdown (the kubelet's SIGTERM right after a
    preStop drain) is logged, not left to kill the process with its default action.
    """
    server = _make_server("graceful.uvicorn.run", app, coordinator, policy, kwargs)
    with teardown_guard(lambda: server.coordinator.shutdown_requested):
        server.run()


def build_server(
    values: _config.Values,
    config: uvicorn.Config,
    *,
    quick_signals: tuple[int, ...] | None = None,
    **coordinator_overrides: Any,
) -> Server:
    """The coordinator and the graceful uvicorn server of ``values``, in one call.

    Args:
        values: Checked values.
        config: uvicorn's configuration (from ``uvicorn_kwargs``, or the gunicorn
            worker's).
        quick_signals: Signals that stop at once (default: the server's).
        coordinator_overrides: Coordinator arguments that are not options
            (``hard_exit``, ``exit_on_third_request``, …).

    Raises:
        ConfigError: as ``check`` (for values that were not checked).
    """
    coordinator = _config.build_coordinator(values, **coordinator_overrides)
    extra: dict[str, Any] = {} if quick_signals is None else {"quick_signals": quick_signals}
    with _config._named(values):
        return Server(config, coordinator=coordinator, **extra, **_config.middleware_kwargs(values))
