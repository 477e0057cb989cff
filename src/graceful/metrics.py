"""Prometheus metrics of a ``graceful.ShutdownCoordinator`` (``graceful-drain[metrics]``).

::

    import graceful.metrics
    graceful.metrics.register(coordinator)            # into prometheus_client.REGISTRY
    app = graceful.metrics.asgi_app(coordinator)      # or serve /metrics yourself

``GracefulMiddleware(metrics_path="/metrics")``, ``graceful run --metrics-path /metrics``
and ``graceful.aiohttp.setup(metrics_path=…)`` serve the endpoint for you.  Every metric
starts with ``graceful_``; ``docs/metrics.md`` says what each one means.

Why a collector, and why not in multiprocess mode
-------------------------------------------------
The coordinator already counts everything on the hot path, and
``graceful.ShutdownCoordinator.statistics`` returns a snapshot of it.  So in a single
process nothing is counted twice: a custom collector reads one snapshot per scrape and
turns it into metric families.  ``statistics()`` reads the event loop's clock, so it runs
on the event-loop thread; a scrape from another thread (``prometheus_client``'s own
``start_http_server``) hands the call to the loop and waits for it.

A collector's values never reach ``prometheus_client``'s multiprocess files, though: with
``PROMETHEUS_MULTIPROC_DIR`` set (gunicorn, ``graceful run --workers``) a scrape reaches
one worker, which can only read the other workers' files.  There each process writes real
multiprocess metrics — gauges with a ``multiprocess_mode``, counters, a histogram —
refreshed from ``statistics()`` at every phase change, every ``refresh_interval_s`` while
the coordinator runs and, in the scraped process, right before the scrape.  A process
that reaches ``STOPPED`` removes its own live gauges
(``prometheus_client.multiprocess.mark_process_dead``); one that was killed needs its
parent to do it (``mark_process_dead``, gunicorn's ``child_exit`` hook).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import parse_qs

import anyio
import anyio.from_thread
import anyio.lowlevel
from typing_extensions import final

try:
    import prometheus_client
    from prometheus_client import multiprocess, values
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import choose_encoder
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "graceful.metrics needs prometheus-client: pip install 'graceful-drain[metrics]'"
    ) from exc

from ._core.coordinator import ShutdownCoordinator, ShutdownStatistics, _check_coordinator
from ._core.policy import Phase, _check_seconds

__all__ = (
    "DRAIN_DURATION_BUCKETS_S",
    "MULTIPROC_DIR_ENV",
    "Exposition",
    "asgi_app",
    "mark_process_dead",
    "multiprocess_mode",
    "register",
    "unregister",
)

logger = logging.getLogger("graceful")

#: The environment variable that switches ``prometheus_client`` to multiprocess mode.
MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

#: Buckets of ``graceful_drain_duration_seconds``.
DRAIN_DURATION_BUCKETS_S: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_INF: Final = math.inf

# prometheus_client leaves these untyped.
_MultiProcessCollector: Callable[[CollectorRegistry | None], Collector] = (
    multiprocess.MultiProcessCollector
)
_mark_dead: Callable[[int], None] = multiprocess.mark_process_dead
_go_float: Callable[[float], str] = floatToGoString
_GaugeMode = Literal[
    "all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent",
    "livemostrecent",
]  # fmt: skip


def _or_inf(value: float | None) -> float:
    return _INF if value is None else value


@dataclass(frozen=True, slots=True)
class _Spec:
    """One metric read from a snapshot (the phase and the histogram are apart)."""

    name: str  # counters: without ``_total``
    help: str
    counter: bool
    read: Callable[[ShutdownStatistics], float]
    mode: _GaugeMode = "livesum"  # multiprocess_mode of a gauge


_PHASE: Final = "graceful_phase"
_PHASE_HELP: Final = "1 for the current shutdown phase (multiprocess: live processes in it)"
_DRAIN: Final = "graceful_drain_duration_seconds"
_DRAIN_HELP: Final = "Seconds from the start of draining to the start of stopping"

#: Everything but the phase and the drain duration, in exposition order.
_SPECS: Final = (
    _Spec("graceful_open_connections", "Open connections", False, lambda s: s.connections),
    _Spec("graceful_requests_in_flight", "Requests in flight", False, lambda s: s.requests),
    _Spec("graceful_sessions", "Websockets and streams in flight", False, lambda s: s.sessions),
    _Spec("graceful_connections", "Connections opened", True, lambda s: s.connections_total),
    _Spec("graceful_requests", "Requests started", True, lambda s: s.requests_total),
    _Spec(
        "graceful_connections_after_shutdown",
        "Connections opened after shutdown was requested (SIGTERM)",
        True,
        lambda s: s.connections_after_shutdown,
    ),
    _Spec(
        "graceful_requests_after_shutdown",
        "Requests started after shutdown was requested (SIGTERM)",
        True,
        lambda s: s.requests_after_shutdown,
    ),
    _Spec(
        "graceful_connections_closed_draining",
        "Connections closed from the start of draining on",
        True,
        lambda s: s.connections_closed_draining,
    ),
    _Spec(
        "graceful_cut_at_stopping",
        "Requests and sessions still in flight when stopping began (cancelled)",
        True,
        lambda s: s.cut_at_stopping,
    ),
    _Spec(
        "graceful_since_last_connection_seconds",
        "Seconds since the last new connection (+Inf: none yet)",
        False,
        lambda s: _or_inf(s.since_last_connection_s),
        "livemin",
    ),
    _Spec(
        "graceful_kill_deadline_seconds",
        "Seconds until the expected SIGKILL (+Inf before shutdown was requested)",
        False,
        lambda s: _or_inf(s.kill_deadline_in_s),
        "livemin",
    ),
    _Spec(
        "graceful_phase_time_left_seconds",
        "Seconds left in the current phase (+Inf: no deadline)",
        False,
        lambda s: _or_inf(s.time_left_s),
        "livemin",
    ),
)


# ----------------------------------------------------------------- checking input


def _check_registry(registry: object) -> CollectorRegistry | None:
    if registry is not None and not isinstance(registry, CollectorRegistry):
        raise TypeError(
            f"registry must be a prometheus_client.CollectorRegistry or None, got {registry!r}"
        )
    return registry


def multiprocess_mode() -> bool:
    """``True`` if ``PROMETHEUS_MULTIPROC_DIR`` is set (and usable).

    Raises:
        ValueError: if it names no directory.
        RuntimeError: if it was set after ``prometheus_client`` was imported (its metrics
            then stay in memory and never reach the directory).
    """
    path = os.environ.get(MULTIPROC_DIR_ENV, os.environ.get(MULTIPROC_DIR_ENV.lower()))
    if path is None:
        return False
    if not path or not os.path.isdir(path):
        raise ValueError(
            f"{MULTIPROC_DIR_ENV} must name an existing directory (empty at start-up), got {path!r}"
        )
    if not getattr(values.ValueClass, "_multiprocess", False):
        raise RuntimeError(
            f"{MULTIPROC_DIR_ENV} was set after prometheus_client was imported: set it in "
            "the environment before the process starts"
        )
    return True


# ---------------------------------------------------------------- reading the loop


class _Reader:
    """Calls ``statistics()`` on the coordinator's event-loop thread, from any thread."""

    def __init__(self, coordinator: ShutdownCoordinator) -> None:
        self.coordinator: Final = coordinator
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._loop_thread: int | None = None
        self.last: ShutdownStatistics | None = None
        self.capture()
        if self._token is None:
            coordinator.start_background(self._capture_async)

    def capture(self) -> None:
        """Remember the running event loop, if this thread runs one."""
        try:
            token = anyio.lowlevel.current_token()
        except RuntimeError:  # no loop here, or a protocol callback anyio can't place
            return
        self._token, self._loop_thread = token, threading.get_ident()

    async def _capture_async(self) -> None:
        self.capture()

    def read(self) -> ShutdownStatistics | None:
        """A fresh snapshot; the last one if the loop is gone; ``None`` if there is none."""
        token = self._token
        try:
            if token is None or threading.get_ident() == self._loop_thread:
                snapshot = self.coordinator.statistics()
            else:
                snapshot = anyio.from_thread.run_sync(self.coordinator.statistics, token=token)
        except (RuntimeError, anyio.RunFinishedError):  # no loop (yet, or any more)
            return self.last
        self.last = snapshot
        return snapshot


# ------------------------------------------------------------------ single process


def _histogram_buckets(duration_s: float | None) -> list[tuple[str, float]]:
    """Cumulative buckets of the one drain a process does (or of none yet)."""
    buckets = [
        (_go_float(le), float(duration_s is not None and duration_s <= le))
        for le in DRAIN_DURATION_BUCKETS_S
    ]
    buckets.append(("+Inf", float(duration_s is not None)))
    return buckets


@final
class _StatisticsCollector(Collector):
    """Reads one ``statistics()`` snapshot per scrape (see the module docs)."""

    def __init__(self, reader: _Reader) -> None:
        self.reader: Final = reader

    @property
    def coordinator(self) -> ShutdownCoordinator:
        return self.reader.coordinator

    def describe(self) -> Iterable[Metric]:
        """The families without samples (a registry checks names at registration)."""
        return list(_families(None))

    def collect(self) -> Iterable[Metric]:
        snapshot = self.reader.read()
        if snapshot is None:
            logger.debug("graceful metrics: no statistics before the coordinator runs")
            return []
        return list(_families(snapshot))


def _families(s: ShutdownStatistics | None) -> Iterator[Metric]:
    phase = GaugeMetricFamily(_PHASE, _PHASE_HELP, labels=["phase"])
    if s is not None:
        for p in Phase:
            phase.add_metric([str(p)], 1.0 if p is s.phase else 0.0)
    yield phase
    for spec in _SPECS:
        family: Metric
        if spec.counter:
            family = CounterMetricFamily(spec.name, spec.help)
            if s is not None:
                family.add_metric([], spec.read(s))
        else:
            family = GaugeMetricFamily(spec.name, spec.help)
            if s is not None:
                family.add_metric([], spec.read(s))
        yield family
    if s is None:
        yield HistogramMetricFamily(_DRAIN, _DRAIN_HELP)
    else:
        duration = s.drain_duration_s
        yield HistogramMetricFamily(
            _DRAIN,
            _DRAIN_HELP,
            buckets=_histogram_buckets(duration),
            sum_value=0.0 if duration is None else duration,
        )


# ------------------------------------------------------------------- multiprocess


@final
class _MultiprocessWriter:
    """Writes one process's metrics to ``PROMETHEUS_MULTIPROC_DIR`` (module docs)."""

    def __init__(self, reader: _Reader, refresh_interval_s: float) -> None:
        self.reader: Final = reader
        self.refresh_interval_s: Final = refresh_interval_s
        phase = prometheus_client.Gauge(
            _PHASE, _PHASE_HELP, ["phase"], registry=None, multiprocess_mode="livesum"
        )
        self._phases = [(p, phase.labels(str(p))) for p in Phase]  # every series from the start
        self._metrics: list[tuple[_Spec, Any]] = [
            (
                spec,
                prometheus_client.Counter(spec.name, spec.help, registry=None)
                if spec.counter
                else prometheus_client.Gauge(
                    spec.name, spec.help, registry=None, multiprocess_mode=spec.mode
                ),
            )
            for spec in _SPECS
        ]
        self._drain = prometheus_client.Histogram(
            _DRAIN, _DRAIN_HELP, registry=None, buckets=DRAIN_DURATION_BUCKETS_S
        )
        self._counted: dict[str, float] = {}
        self._drain_observed = False
        self._dead = False
        reader.coordinator.subscribe(self._on_phase)
        reader.coordinator.start_background(self._refresh_periodically)

    def refresh(self) -> None:
        """Write the current snapshot (a no-op outside the event loop before it runs)."""
        if self._dead:
            return
        s = self.reader.read()
        if s is None:
            return
        for p, gauge in self._phases:
            gauge.set(1.0 if p is s.phase else 0.0)
        for spec, metric in self._metrics:
            value = float(spec.read(s))
            if spec.counter:
                delta = value - self._counted.get(spec.name, 0.0)
                if delta > 0:
                    metric.inc(delta)
                    self._counted[spec.name] = value
            else:
                metric.set(value)
        if s.drain_duration_s is not None and not self._drain_observed:
            self._drain_observed = True
            self._drain.observe(s.drain_duration_s)

    def _on_phase(self, phase: Phase) -> None:
        self.reader.capture()
        self.refresh()
        if phase is Phase.STOPPED:
            # Counters and the histogram stay (they count what this process did); the
            # live gauges go, so the sums are those of the processes still running.
            self._dead = True
            mark_process_dead(os.getpid())

    async def _refresh_periodically(self) -> None:
        while True:
            self.refresh()
            await anyio.sleep(self.refresh_interval_s)


# ------------------------------------------------------------------ registration

_collectors: weakref.WeakKeyDictionary[CollectorRegistry, _StatisticsCollector] = (
    weakref.WeakKeyDictionary()
)
_writers: weakref.WeakKeyDictionary[ShutdownCoordinator, _MultiprocessWriter] = (
    weakref.WeakKeyDictionary()
)
_multiprocess_collectors: weakref.WeakKeyDictionary[CollectorRegistry, Collector] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def _writer(coordinator: ShutdownCoordinator, refresh_interval_s: float) -> _MultiprocessWriter:
    with _lock:
        writer = _writers.get(coordinator)
        if writer is None:
            writer = _MultiprocessWriter(_Reader(coordinator), refresh_interval_s)
            _writers[coordinator] = writer
        return writer


def register(
    coordinator: ShutdownCoordinator,
    registry: CollectorRegistry | None = None,
    *,
    refresh_interval_s: float = 1.0,
) -> Collector:
    """Make ``coordinator``'s metrics scrapeable; idempotent.

    Single process: a collector that reads ``graceful.ShutdownCoordinator.statistics``
    at scrape time is added to ``registry`` (default ``prometheus_client.REGISTRY``)
    and returned.

    Multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set): this process writes its metrics
    to the directory — at every phase change and every ``refresh_interval_s`` while the
    coordinator runs — and a ``prometheus_client.multiprocess.MultiProcessCollector``
    of the directory (every process's metrics, graceful's and yours) is returned.  It is
    added to ``registry`` only if one is given: the default registry holds per-process
    metrics that ``prometheus_client`` advises not to mix in.

    Args:
        coordinator: The process's coordinator.
        registry: Where the metrics go (see above).
        refresh_interval_s: Multiprocess mode only: how stale another worker's values
            may be.

    Raises:
        TypeError: for a ``coordinator`` or ``registry`` of the wrong type.
        ValueError: if ``registry`` already has the metrics of another coordinator, or
            ``PROMETHEUS_MULTIPROC_DIR`` names no directory.
        RuntimeError: if ``PROMETHEUS_MULTIPROC_DIR`` was set too late (see
            ``multiprocess_mode``).
    """
    coordinator = _check_coordinator(coordinator)
    registry = _check_registry(registry)
    refresh_interval_s = _check_seconds("refresh_interval_s", refresh_interval_s)
    if multiprocess_mode():
        _writer(coordinator, refresh_interval_s)
        return _multiprocess_collector(registry)
    target = REGISTRY if registry is None else registry
    with _lock:
        existing = _collectors.get(target)
        if existing is not None:
            if existing.coordinator is not coordinator:
                raise ValueError(
                    f"registry {target!r} already has the graceful metrics of another "
                    "ShutdownCoordinator (one coordinator per process)"
                )
            return existing
        collector = _StatisticsCollector(_Reader(coordinator))
        try:
            target.register(collector)
        except ValueError as exc:
            raise ValueError(
                f"registry {target!r} already has metrics named like graceful's: {exc}"
            ) from None
        _collectors[target] = collector
        return collector


def unregister(registry: CollectorRegistry | None = None) -> None:
    """Remove graceful's single-process collector from ``registry`` (default
    ``prometheus_client.REGISTRY``), so that another coordinator can
    ``register`` there (a test, a program that replaces its coordinator).  Does
    nothing if there is none.
    """
    target = REGISTRY if registry is None else _check_registry(registry)
    assert target is not None
    with _lock:
        collector = _collectors.pop(target, None)
        if collector is not None:
            target.unregister(collector)


def _multiprocess_collector(registry: CollectorRegistry | None) -> Collector:
    if registry is None:
        return _MultiProcessCollector(None)
    with _lock:
        existing = _multiprocess_collectors.get(registry)
        if existing is None:
            existing = _MultiProcessCollector(registry)
            _multiprocess_collectors[registry] = existing
        return existing


def mark_process_dead(pid: int) -> None:
    """Drop the live gauges of a dead process in multiprocess mode (else a no-op).

    Call it where the parent learns that a worker exited — gunicorn's ``child_exit``
    server hook::

        def child_exit(server, worker):
            graceful.metrics.mark_process_dead(worker.pid)
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise TypeError(f"pid must be a positive int, got {pid!r}")
    if multiprocess_mode():
        _mark_dead(pid)


# -------------------------------------------------------------------- exposition


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
