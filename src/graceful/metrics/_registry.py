"""Registration: which registry holds whose metrics, once.

``register`` is idempotent and keeps one entry per registry (single process: graceful's
collector, bound to one coordinator) and per coordinator (multiprocess mode: its
writer), in weak dictionaries so that a registry or a coordinator that is dropped (a
test's) takes its entry with it.  A second coordinator in the same registry is an error
that names the cause (one coordinator per process), not ``prometheus_client``'s refusal
of duplicate metric names.  In multiprocess mode the ``MultiProcessCollector`` returned
reads the whole directory, so it is added to a registry only when one is given: the
default registry holds this process's own metrics, which ``prometheus_client`` advises
not to mix in.

One lock covers the three dictionaries: ``register`` may run on any thread, and each
look-up-then-insert must happen once.
"""

from __future__ import annotations

import threading
import weakref

from .._core.coordinator import ShutdownCoordinator, _check_coordinator
from .._core.policy import _check_seconds
from ._collector import _Reader, _StatisticsCollector
from ._multiprocess import _MultiprocessWriter, multiprocess_mode
from ._prometheus import REGISTRY, Collector, CollectorRegistry, _MultiProcessCollector

__all__ = ("register", "unregister")


def _check_registry(registry: object) -> CollectorRegistry | None:
    if registry is not None and not isinstance(registry, CollectorRegistry):
        raise TypeError(
            f"registry must be a prometheus_client.CollectorRegistry or None, got {registry!r}"
        )
    return registry


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
