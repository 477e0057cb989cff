"""``graceful.ShutdownStatistics``: the frozen snapshot ``ShutdownCoordinator.statistics`` returns.

The snapshot is taken by the engine (``graceful._core.timetable``: it knows the deadlines
and what was counted when shutdown was requested) and read by the metrics exporter
(``graceful.metrics``), a test, or an application's own status page, possibly on another
thread: so it is a frozen value, never a view of live counters (slotted, and ``@final``
as every concrete public class of graceful).
"""

from __future__ import annotations

from dataclasses import dataclass

from typing_extensions import final

from .policy import Phase

__all__ = ("ShutdownStatistics",)


@final
@dataclass(frozen=True, slots=True)
class ShutdownStatistics:
    """A snapshot of a coordinator, from ``ShutdownCoordinator.statistics``.

    Attributes:
        phase: The current phase.
        reason: Why the coordinator entered this phase (``None`` while serving).
        connections: Open connections reported by adapters.
        requests: Requests in flight.
        sessions: Long-lived sessions (websockets, streams) in flight.
        connections_total: Connections opened since the coordinator was created.
        requests_total: Requests started since the coordinator was created.
        time_in_phase_s: Seconds since the phase began.
        time_left_s: Seconds until the current phase's deadline (accepting: the latest
            end the deadlines and the policy allow; draining: the drain deadline;
            stopping: the end of stopping), or ``None`` if it has none.
        kill_deadline_in_s: Seconds until the expected SIGKILL, or ``None`` before
            shutdown was requested.
        connections_after_shutdown: Connections opened since shutdown was requested.
        requests_after_shutdown: Requests started since shutdown was requested.
        connections_closed_draining: Connections that closed from the start of draining
            on (the drain closing idle keep-alive connections, clients leaving after
            their last response, stopping closing what was left).
        cut_at_stopping: Requests and sessions still in flight when stopping began (the
            work cancelled at the deadline or by an escalation); ``0`` before.
        since_last_connection_s: Seconds since the last new connection (or reported
            activity); ``None`` if there was none yet.
        drain_duration_s: Seconds from the start of draining to the start of stopping;
            ``None`` until stopping began after a drain.
    """

    phase: Phase
    reason: str | None
    connections: int
    requests: int
    sessions: int
    connections_total: int
    requests_total: int
    time_in_phase_s: float
    time_left_s: float | None
    kill_deadline_in_s: float | None
    connections_after_shutdown: int = 0
    requests_after_shutdown: int = 0
    connections_closed_draining: int = 0
    cut_at_stopping: int = 0
    since_last_connection_s: float | None = None
    drain_duration_s: float | None = None
