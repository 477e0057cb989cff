"""``graceful.aiohttp.setup``: the request side (``graceful.aiohttp._middleware``)
installed on an application — the middleware, the health and metrics
routes, the drain signal."""

from __future__ import annotations

from typing import Final

from aiohttp import hdrs, web

from .._core import health as _health
from .._core.coordinator import ShutdownCoordinator, _check_coordinator
from .._core.drain_signal import DrainSignal
from .._core.management import Management, MetricsRenderer, check_management
from ._middleware import Handler, Middleware

__all__ = ("DRAIN_SIGNAL_KEY", "drain_signal", "setup")

#: Where ``setup`` puts the ``graceful.asgi.DrainSignal``:
#: ``request.config_dict[DRAIN_SIGNAL_KEY]`` (also from sub-applications).
DRAIN_SIGNAL_KEY: Final = web.AppKey("graceful.drain_signal", DrainSignal)

_MIDDLEWARE_KEY: Final = web.AppKey("graceful.middleware", Middleware)


def setup(
    app: web.Application,
    *,
    coordinator: ShutdownCoordinator,
    readiness_path: str | None = "/readyz",
    liveness_path: str | None = "/livez",
    prestop_path: str | None = None,
    websocket_close_grace_s: float = 1.0,
    metrics_path: str | None = None,
    readiness_on_shutdown: str = "fail",
    management_port: int | None = None,
    management_host: str = "127.0.0.1",
    health_on_app_port: bool = False,
) -> Middleware:
    """Install graceful's request side on ``app`` (before it starts).

    Adds ``Middleware`` as the outermost middleware (or reuses one already in
    ``app.middlewares``), the health routes and ``DRAIN_SIGNAL_KEY``.  Calling it
    again returns the same middleware.

    Args:
        app: The (root) application.
        coordinator: The process's coordinator.
        readiness_path: Readiness route (``None``: none): 200 while serving, 503 once
            shutdown was requested.
        liveness_path: Liveness route (``None``: none): 200 until stopped.
        prestop_path: preStop route (``None``: none, the default — anyone who can reach
            it can stop the server): requests shutdown and answers once drained, for
            Kubernetes ``lifecycle.preStop.httpGet``.
        websocket_close_grace_s: See ``Middleware``.
        metrics_path: Prometheus metrics route (``None``: none, the default): the
            coordinator's metrics and everything else in ``prometheus_client``'s
            registry, see ``graceful.metrics`` (needs ``graceful-drain[metrics]``).
        readiness_on_shutdown: ``"fail"`` or ``"keep"``: see
            ``graceful.asgi.GracefulMiddleware``.
        management_port: Serve the four endpoints on a listener of their own on this
            port, not as routes of ``app`` (``graceful._core.management``).
        management_host: The management listener's address.
        health_on_app_port: With ``management_port``: add the routes to ``app`` too.

    Raises:
        TypeError: if ``app`` is not an application or ``coordinator`` not a coordinator.
        ValueError: if ``app`` was set up with another coordinator, or for a bad path.
        RuntimeError: if ``app`` is already frozen (started).
    """
    if not isinstance(app, web.Application):
        raise TypeError(f"app must be an aiohttp.web.Application, got {app!r}")
    _check_coordinator(coordinator)
    existing = app.get(_MIDDLEWARE_KEY)
    if existing is not None:
        if existing.coordinator is not coordinator:
            raise ValueError("the application was set up with another coordinator")
        return existing
    paths = {
        "readiness_path": _health.check_path("readiness_path", readiness_path),
        "liveness_path": _health.check_path("liveness_path", liveness_path),
        "prestop_path": _health.check_path("prestop_path", prestop_path),
        "metrics_path": _health.check_path("metrics_path", metrics_path),
    }
    check_management(management_port, management_host, health_on_app_port)
    used = [p for p in paths.values() if p is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"health paths must differ, got {paths!r}")
    if app.frozen:
        raise RuntimeError("graceful.aiohttp.setup() must run before the application starts")
    middleware = next(
        (m for m in app.middlewares if isinstance(m, Middleware)),
        None,
    )
    if middleware is None:
        middleware = Middleware(
            coordinator,
            websocket_close_grace_s=websocket_close_grace_s,
            readiness_on_shutdown=readiness_on_shutdown,
        )
        app.middlewares.insert(0, middleware)
    elif middleware.coordinator is not coordinator:
        raise ValueError("the application's graceful Middleware has another coordinator")
    if management_port is not None:
        Management.for_options(
            coordinator,
            port=management_port,
            host=management_host,
            paths=(readiness_path, liveness_path, prestop_path, metrics_path),
            readiness_on_shutdown=readiness_on_shutdown,
            metrics=_renderer(coordinator, metrics_path),
        )
        if not health_on_app_port:
            paths = dict.fromkeys(paths)
    for name, path, handler in (
        ("readiness", paths["readiness_path"], middleware.readiness),
        ("liveness", paths["liveness_path"], middleware.liveness),
        ("prestop", paths["prestop_path"], middleware.prestop),
        ("metrics", paths["metrics_path"], _metrics_handler(middleware, paths["metrics_path"])),
    ):
        if path is not None and handler is not None:
            app.router.add_get(path, handler, name=f"graceful-{name}")
            middleware.uncounted.add(handler)
            middleware.uncounted_paths.add(path)
    app[DRAIN_SIGNAL_KEY] = DrainSignal(coordinator)
    app[_MIDDLEWARE_KEY] = middleware
    return middleware


def _renderer(coordinator: ShutdownCoordinator, path: str | None) -> MetricsRenderer | None:
    """The management listener's metrics renderer (``graceful.metrics`` imported only
    when the endpoint is wanted)."""
    if path is None:
        return None
    from .. import metrics

    return metrics.Exposition(coordinator).render_retrying


def _metrics_handler(middleware: Middleware, path: str | None) -> Handler | None:
    """The metrics route's handler; ``graceful.metrics`` (and prometheus_client) is
    imported only when the route is wanted."""
    if path is None:
        return None
    from .. import metrics

    exposition = metrics.Exposition(middleware.coordinator)

    async def serve_metrics(request: web.Request) -> web.StreamResponse:
        middleware.not_a_request()
        status, body, content_type = await exposition.render_retrying(
            request.headers.get(hdrs.ACCEPT, ""), request.query.getall("name[]", [])
        )
        response = web.Response(status=status, body=body, headers={hdrs.CONTENT_TYPE: content_type})
        if middleware.coordinator.nudging:
            response.force_close()
        return response

    return serve_metrics


def drain_signal(request: web.BaseRequest) -> DrainSignal | None:
    """The ``graceful.asgi.DrainSignal`` of ``request``'s application chain, or
    ``None`` if ``setup`` did not run on it."""
    config = getattr(request, "config_dict", None)
    if config is None:
        return None
    found = config.get(DRAIN_SIGNAL_KEY)
    return found if isinstance(found, DrainSignal) else None
