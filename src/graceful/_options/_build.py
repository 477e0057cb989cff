"""Where the values go, and the checks between options.

Each option's ``to`` names its target; ``policy_kwargs``, ``coordinator_kwargs``,
``middleware_kwargs`` and ``uvicorn_kwargs`` gather the keyword arguments of each target
from ``Values``, and ``build_coordinator`` makes the coordinator (with the Kubernetes
integration when ``--kubernetes`` is on).

``check`` runs once the options were parsed one by one (``_parse``): it builds the policy,
the coordinator and the middleware once, so that whatever they validate is validated
here, before a server or a worker starts, and adds the checks between options
(``--grace-period`` must exceed twice ``--kill-margin``, the health endpoints need
distinct paths, an option the chosen server does not take).  The constructors speak of
keyword arguments (``idle_s``); ``_named`` rewrites their messages to name the options
as the user set them (``--idle``, ``GRACEFUL_IDLE``); ``build_coordinator`` uses it too,
for values that never went through ``check``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

from .._core.coordinator import ShutdownCoordinator
from .._core.policy import AcceptUntilIdle, Policy, policy_from_name
from ._parse import ConfigError, endpoint_path
from ._table import OPTIONS, SERVER_LOOPS, Target, _show, option
from ._values import Values

__all__ = (
    "answered_by_parent",
    "build_coordinator",
    "check",
    "coordinator_kwargs",
    "middleware_kwargs",
    "policy_kwargs",
    "uvicorn_kwargs",
)


def _kwargs(values: Values, target: Target) -> dict[str, Any]:
    return {o.keyword: values[o.name] for o in OPTIONS if o.target == target}


def policy_kwargs(values: Values) -> dict[str, Any]:
    """Keyword arguments of ``graceful.policy_from_name``, unset ones left out."""
    kwargs = _kwargs(values, "policy")
    return {k: v for k, v in kwargs.items() if v is not None}


def _policy(values: Values) -> Policy:
    kwargs = policy_kwargs(values)
    if _waits_for_endpoints(values):
        kwargs["wait_for_endpoint_removal"] = True
    return policy_from_name(**kwargs)


def _waits_for_endpoints(values: Values) -> bool:
    """``--kubernetes`` with accept-until-idle waits for endpoint removal unless told not to."""
    return bool(
        values["kubernetes"]
        and values["wait_for_endpoints"]
        and values["policy"] == AcceptUntilIdle.name
    )


def coordinator_kwargs(values: Values, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of ``graceful.ShutdownCoordinator``, policy included."""
    return {"policy": _policy(values), **_kwargs(values, "coordinator"), **overrides}


def build_coordinator(values: Values, **overrides: Any) -> ShutdownCoordinator:
    """The coordinator of ``values``, with the Kubernetes integration attached when
    ``--kubernetes`` is on; ``overrides`` are coordinator arguments that are not options
    (``hard_exit``, …).

    Raises:
        ConfigError: as ``check`` (for values that were not checked).
    """
    with _named(values):
        coordinator = ShutdownCoordinator(**coordinator_kwargs(values, **overrides))
    if values["kubernetes"]:
        from ..kubernetes import Kubernetes

        Kubernetes().attach(coordinator)
    return coordinator


def middleware_kwargs(values: Values) -> dict[str, Any]:
    """Keyword arguments of ``graceful.asgi.GracefulMiddleware`` (and so of
    ``graceful.uvicorn.Server``)."""
    kwargs = _kwargs(values, "middleware")
    if kwargs["management_host"] is None:
        if kwargs["management_port"] is None:
            del kwargs["management_host"]  # no listener: the middleware's default
        else:
            kwargs["management_host"] = values["host"]  # the app's own address
    return kwargs


def uvicorn_kwargs(values: Values) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config``."""
    return _kwargs(values, "uvicorn")


# ------------------------------------------------------------------------- checking


@contextlib.contextmanager
def _named(values: Values) -> Iterator[None]:
    """Turn a constructor's ValueError or TypeError into a ``ConfigError`` whose
    message names options (``--idle``, ``GRACEFUL_IDLE``) instead of keyword arguments
    (``idle_s``)."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        message = " ".join(str(exc).split())
        for opt in sorted(OPTIONS, key=lambda o: -len(o.keyword)):
            if opt.target in ("policy", "coordinator", "middleware") and "_" in opt.keyword:
                label = values.label(opt.name)
                message = re.sub(rf"\b{re.escape(opt.keyword)}\b", label, message)
        raise ConfigError(message) from None


def check(values: Values) -> None:
    """Check the options together: build the policy, the coordinator and the middleware
    once (so that whatever they check is checked now) and compare options.

    Raises:
        ConfigError: naming the options involved.
    """
    label = values.label
    grace, margin = values["grace_period"], values["kill_margin"]
    if grace is not None and not grace > 2 * margin:
        raise ConfigError(
            f"{label('grace_period')} ({_show(grace)} s) must be greater than twice "
            f"{label('kill_margin')} ({_show(margin)} s): the process is out the kill margin "
            "before SIGKILL, and stopping begins the kill margin before that"
        )
    server = values["server"]
    for opt in OPTIONS:
        if values.given(opt.name) and server not in opt.servers:
            raise ConfigError(
                f"{label(opt.name)} is not taken by {label('server')} {server} "
                f"(only by {', '.join(opt.servers)})"
            )
    loop = values["loop"]
    if loop == "trio" and server != "hypercorn":
        raise ConfigError(
            f"{label('loop')} trio needs --server hypercorn ({label('server')} {server} "
            "runs on asyncio or uvloop)"
        )
    if server != "uvicorn" and loop not in SERVER_LOOPS[server]:
        raise ConfigError(
            f"{label('loop')} {loop} is not taken by {label('server')} {server} "
            f"(it takes {', '.join(SERVER_LOOPS[server])})"
        )
    _check_management(values)
    paths: dict[str, str] = {}
    for opt in OPTIONS:
        if opt.parse is endpoint_path and values[opt.name] is not None:
            other = paths.setdefault(values[opt.name], opt.name)
            if other != opt.name:
                raise ConfigError(
                    f"{label(other)} and {label(opt.name)} are both {values[opt.name]!r}: "
                    "each endpoint needs its own path"
                )
    from ..asgi import GracefulMiddleware

    async def no_app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
        pass

    if values["kubernetes"]:
        try:
            import lightkube  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"{label('kubernetes')} needs lightkube: pip install 'graceful-drain[kubernetes]'"
            ) from None
    elif values.given("wait_for_endpoints"):
        on = label("kubernetes")
        raise ConfigError(
            f"{label('wait_for_endpoints')} applies only with "
            + (f"{on} (or {option('kubernetes').env}=1)" if on.startswith("--") else f"{on}=True")
        )
    if values["metrics_path"] is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"{label('metrics_path')} needs prometheus-client: "
                "pip install 'graceful-drain[metrics]'"
            ) from None
    with _named(values):
        coordinator = ShutdownCoordinator(**coordinator_kwargs(values))
        # Without the metrics endpoint: it would register this throwaway coordinator's
        # metrics in the process's default registry.
        options = {**middleware_kwargs(values), "metrics_path": None}
        GracefulMiddleware(no_app, coordinator=coordinator, **options)


def _check_management(values: Values) -> None:
    """``--management-port``: a port of its own, one process (for now)."""
    label, port = values.label, values["management_port"]
    if port is None:
        for name in ("management_host", "health_on_app_port"):
            if values[name]:
                raise ConfigError(f"{label(name)} applies only with {label('management_port')}")
        return
    if values["workers"] > 1:
        # The parent answers for every worker (graceful._core.threaded).
        if values["readiness_on_shutdown"] == "keep":
            raise ConfigError(
                f"{label('readiness_on_shutdown')} keep is not taken with "
                f"{label('management_port')} and {label('workers')} {values['workers']} yet "
                "(the parent does not know when its workers stop accepting): use fail"
            )
        if values["metrics_path"] is not None and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            raise ConfigError(
                f"{label('metrics_path')} on {label('management_port')} with "
                f"{label('workers')} {values['workers']} needs PROMETHEUS_MULTIPROC_DIR (an "
                "empty directory): the parent serves every worker's metrics from it"
            )


def answered_by_parent(values: Values) -> Values:
    """A ``--workers`` worker's values when its parent has the management listener: no
    listener of its own, and the health paths left to the app on its port (unless
    ``--health-on-app-port``)."""
    changed: dict[str, Any] = {"management_port": None, "management_host": None}
    if not values["health_on_app_port"]:
        changed.update(dict.fromkeys(("readiness_path", "liveness_path", "prestop_path")))
        changed["metrics_path"] = None
    changed["health_on_app_port"] = False
    return values.replaced(changed)
