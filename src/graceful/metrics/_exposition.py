"""Exposition: rendering the metrics for a scrape, and the ASGI app that serves them.

``Exposition`` is framework-neutral (``graceful.aiohttp`` and ``graceful.wsgi`` use it
directly); ``asgi_app`` wraps it for ``GracefulMiddleware(metrics_path=…)`` and for any
ASGI router.  Before rendering in multiprocess mode the scraped process writes its own
values, so they are fresh while the others' are at most ``refresh_interval_s`` old.

A scrape that fails to collect is retried after a pause (``RENDER_RETRIES_S``, and see
its comment for the race it covers) and then answered with a 503 naming the error,
rather than raising into the server: a metrics endpoint must not take the app down.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Final
from urllib.parse import parse_qs

import anyio
from typing_extensions import final

from .._core.coordinator import ShutdownCoordinator, _check_coordinator
from ._multiprocess import _MultiprocessWriter, multiprocess_mode
from ._prometheus import (
    REGISTRY,
    Collector,
    CollectorRegistry,
    _MultiProcessCollector,
    choose_encoder,
)
from ._registry import _check_registry, _writer, register

__all__ = ("RENDER_RETRIES_S", "Exposition", "asgi_app", "every_process")

logger = logging.getLogger("graceful")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@final
class Exposition:
    """Renders a registry with ``coordinator``'s metrics, for any web framework.

    Args:
        coordinator: The process's coordinator.
        registry: What to render.  ``None``: ``prometheus_client.REGISTRY`` with
            graceful's collector in a single process; in multiprocess mode a registry of
            its own with a
            ``prometheus_client.multiprocess.MultiProcessCollector`` (every
            process's metrics).  A registry you pass gets ``register`` applied.
        refresh_interval_s: See ``register``.
    """

    def __init__(
        self,
        coordinator: ShutdownCoordinator,
        registry: CollectorRegistry | None = None,
        *,
        refresh_interval_s: float = 1.0,
    ) -> None:
        coordinator = _check_coordinator(coordinator)
        registry = _check_registry(registry)
        self.coordinator: Final = coordinator
        self._writer: _MultiprocessWriter | None = None
        if multiprocess_mode():
            register(coordinator, registry, refresh_interval_s=refresh_interval_s)
            self._writer = _writer(coordinator, refresh_interval_s)
            if registry is None:
                registry = CollectorRegistry()
                _MultiProcessCollector(registry)
        else:
            register(coordinator, registry, refresh_interval_s=refresh_interval_s)
            if registry is None:
                registry = REGISTRY
        self.registry: Final = registry

    async def render_retrying(
        self, accept: str = "", names: Sequence[str] = ()
    ) -> tuple[int, bytes, str]:
        """:meth:`render` for a scrape: the status (200, or 503 with the reason when
        collecting still fails after :data:`RENDER_RETRIES_S`), the body, its type."""
        for delay_s in (*RENDER_RETRIES_S, None):
            try:
                body, content_type = self.render(accept, names)
            except Exception as exc:  # a multiprocess file caught while it is created
                if delay_s is not None:
                    await anyio.sleep(delay_s)
                    continue
                logger.warning("graceful metrics: cannot collect: %r", exc)
                return 503, f"metrics unavailable: {exc!r}\n".encode(), "text/plain"
            return 200, body, content_type
        raise AssertionError("unreachable")  # pragma: no cover

    def render(self, accept: str = "", names: Sequence[str] = ()) -> tuple[bytes, str]:
        """The exposition and its content type.

        Args:
            accept: The request's ``Accept`` header (OpenMetrics if it asks for it).
            names: Only these metric names (Prometheus' ``name[]`` query parameter).
        """
        if self._writer is not None:
            self._writer.refresh()  # this process's values are fresh, the others' recent
        encoder, content_type = choose_encoder(accept)
        registry: Collector = self.registry
        if names:
            registry = self.registry.restricted_registry(list(names))
        return encoder(registry), content_type


#: Pauses before collecting again when a scrape fails.  In multiprocess mode a worker
#: that is starting creates its files while another one reads the directory: a file
#: read in the microseconds between its creation and its first bytes fails to parse
#: (``struct.error``); a moment later it is whole.
RENDER_RETRIES_S: Final = (0.01, 0.05)


def asgi_app(
    coordinator: ShutdownCoordinator,
    registry: CollectorRegistry | None = None,
    *,
    refresh_interval_s: float = 1.0,
) -> ASGIApp:
    """An ASGI app that serves the metrics (``GET``/``HEAD`` of any path it is given).

    ``GracefulMiddleware(metrics_path=…)`` hands it the requests of its metrics path;
    mount it in your own router otherwise.  See ``Exposition`` for ``registry``.
    """
    exposition = Exposition(coordinator, registry, refresh_interval_s=refresh_interval_s)

    async def metrics_app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        method = scope.get("method", "GET")
        if method not in ("GET", "HEAD"):
            body = b"method not allowed\n"
            await _send(send, 405, [(b"allow", b"GET, HEAD")], b"text/plain", body, True)
            return
        accept = b",".join(v for k, v in scope.get("headers", ()) if k.lower() == b"accept")
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        status, output, content_type = await exposition.render_retrying(
            accept.decode("latin-1"), query.get("name[]", ())
        )
        await _send(send, status, [], content_type.encode(), output, method == "GET")

    return metrics_app


async def _send(
    send: Send,
    status: int,
    headers: list[tuple[bytes, bytes]],
    content_type: bytes,
    body: bytes,
    with_body: bool,
) -> None:
    head = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body if with_body else b""})


def every_process(names: Sequence[str] = ()) -> tuple[int, bytes, str]:
    """Every process's metrics from ``PROMETHEUS_MULTIPROC_DIR`` — for a parent that
    serves them for its workers (the ``--workers`` parent, gunicorn's master), from a
    thread: (status, body, content type), 503 naming the error if collecting still fails
    after ``RENDER_RETRIES_S``."""
    import time

    registry = CollectorRegistry()
    _MultiProcessCollector(registry)
    target: Collector = registry.restricted_registry(list(names)) if names else registry
    encoder, content_type = choose_encoder("")
    for delay_s in (*RENDER_RETRIES_S, None):
        try:
            return 200, encoder(target), content_type
        except Exception as exc:  # a worker's file caught while it is created
            if delay_s is None:
                logger.warning("graceful metrics: cannot collect: %r", exc)
                return 503, f"metrics unavailable: {exc!r}\n".encode(), "text/plain"
            time.sleep(delay_s)
    raise AssertionError("unreachable")  # pragma: no cover
