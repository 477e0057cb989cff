"""Multiprocess mode: each process writes its metrics to ``PROMETHEUS_MULTIPROC_DIR``.

A collector's values never reach ``prometheus_client``'s multiprocess files, and with
``PROMETHEUS_MULTIPROC_DIR`` set (gunicorn, ``graceful run --workers``) a scrape reaches
one worker, which can only read the other workers' files.  So here each process keeps
real ``prometheus_client`` metrics of the ``_SPECS`` — gauges with a
``multiprocess_mode``, counters, the drain histogram — refreshed from ``statistics()``
at every phase change, every ``refresh_interval_s`` while the coordinator runs and, in
the scraped process, right before the scrape (``Exposition.render``).

The coordinator's counters are totals; a ``prometheus_client`` counter only goes up by
a delta, so the writer remembers what it already counted and adds the difference.  A
process that reaches ``STOPPED`` keeps its counters and histogram (they count what it
did) and drops its live gauges (``prometheus_client.multiprocess.mark_process_dead``),
so the gauges' sums are those of the processes still running; a process that was killed
cannot, and needs its parent to call ``mark_process_dead`` for it.

``multiprocess_mode`` refuses a ``PROMETHEUS_MULTIPROC_DIR`` set after
``prometheus_client`` was imported: ``prometheus_client`` chooses where values live at
import time, so such metrics would stay in memory and the directory would stay empty,
silently.
"""

from __future__ import annotations

import os
from typing import Any, Final

import anyio
from typing_extensions import final

from .._core.policy import Phase
from ._collector import (
    _DRAIN,
    _DRAIN_HELP,
    _PHASE,
    _PHASE_HELP,
    _SPECS,
    DRAIN_DURATION_BUCKETS_S,
    _Reader,
    _Spec,
)
from ._prometheus import Counter, Gauge, Histogram, _mark_dead, values

__all__ = ("MULTIPROC_DIR_ENV", "mark_process_dead", "multiprocess_mode")

#: The environment variable that switches ``prometheus_client`` to multiprocess mode.
MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"


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


@final
class _MultiprocessWriter:
    """Writes one process's metrics to ``PROMETHEUS_MULTIPROC_DIR`` (module docs)."""

    def __init__(self, reader: _Reader, refresh_interval_s: float) -> None:
        self.reader: Final = reader
        self.refresh_interval_s: Final = refresh_interval_s
        phase = Gauge(_PHASE, _PHASE_HELP, ["phase"], registry=None, multiprocess_mode="livesum")
        self._phases = [(p, phase.labels(str(p))) for p in Phase]  # every series from the start
        self._metrics: list[tuple[_Spec, Any]] = [
            (
                spec,
                Counter(spec.name, spec.help, registry=None)
                if spec.counter
                else Gauge(spec.name, spec.help, registry=None, multiprocess_mode=spec.mode),
            )
            for spec in _SPECS
        ]
        self._drain = Histogram(
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
