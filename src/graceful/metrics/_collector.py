"""What graceful's metrics are, how they are read from a coordinator, and the
single-process collector.

``_SPECS`` declares every metric but two — its name, help, whether it is a counter, how
it is read from a ``ShutdownStatistics`` snapshot and, for a gauge, how multiprocess mode
combines the processes' values — so the single-process collector here and the
multiprocess writer (``_multiprocess``) cannot disagree on a name or a meaning.  The
phase (one labelled series per phase) and the drain-duration histogram do not fit one
number per snapshot and are written out by each.  "Never" and "no deadline" are +Inf,
not a missing sample, so every series always exists and the ``livemin`` of the
processes is the nearest real deadline.

``_Reader`` takes the snapshot.  ``statistics()`` reads the event loop's clock, so it
must run on the loop's thread; a scrape may come from any thread
(``prometheus_client``'s own ``start_http_server``), so the reader remembers the loop
the first time it sees it running (at construction if there is one, else from a
background task of the coordinator) and hands the call to it.  When the loop is gone (the
server stopped) the last snapshot stands in rather than a scrape error.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
from typing_extensions import final

from .._core.coordinator import ShutdownCoordinator, ShutdownStatistics
from .._core.policy import Phase
from ._prometheus import (
    Collector,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    _go_float,
)

__all__ = ("DRAIN_DURATION_BUCKETS_S",)

logger = logging.getLogger("graceful")

#: Buckets of ``graceful_drain_duration_seconds``.
DRAIN_DURATION_BUCKETS_S: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

_INF: Final = math.inf

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
