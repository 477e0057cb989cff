"""The shutdown's timetable: its deadlines, the snapshot of its progress, the hard exit.

``PhaseEngine`` (``graceful._core.engine``) moves the phase; this, its base class, keeps
the times it is moved by:

* the deadlines, computed once when shutdown is first requested (``_plan``, with the pure
  arithmetic of ``graceful._core.deadlines``): the kill deadline from an absolute time
  (``ShutdownCoordinator.set_kill_deadline``, the pod's ``deletionTimestamp``), the grace
  period, or Kubernetes' default with a warning; planned again when the absolute time
  arrives after the request (a watcher reports it a moment later), and said in the log;
* the deadline of the phase under way (``_phase_deadline``), and the snapshot that reports
  it with the counts (``statistics``), including what was counted when shutdown was
  requested, cut when stopping began and how long draining took — which the engine
  records here as it moves the phase;
* with ``hard_exit`` (for processes graceful owns: ``graceful run``, the gunicorn
  workers), the watchdog: a thread that ends the process at ``exit_by`` whatever the
  application does — a handler that swallows cancellation, a lifespan shutdown that hangs,
  a blocked executor thread — and says what it abandoned.

The end of accepting is a promise: ``_accept_deadline`` lets a budget measured later end
accepting sooner, never later than the plan announced.  The watchdog fires half the exit
margin after ``exit_by``: stopping's own timeouts (at ``exit_by``) report what they
abandoned first, and SIGKILL is still more than the kill margin away.  It is a
``threading.Timer``, a daemon, not a task: the event loop it must rescue the process from
may be the thing that hangs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Final

from . import deadlines as _deadlines
from .policy import Phase
from .statistics import ShutdownStatistics

if TYPE_CHECKING:
    from .deadlines import Deadlines
    from .owner import Owner

__all__ = ("Timetable",)

logger: Final = logging.getLogger("graceful")

_YEAR_S: Final = 365 * 24 * 3600.0


class Timetable:
    """The deadlines, the statistics and the watchdog of ``PhaseEngine``, its subclass
    (see the module docs).  Attributes the coordinator reads have public names."""

    # The phase, and when and why it began: set by the engine (PhaseMachine), which moves it.
    phase: Phase
    phase_since: float | None
    reason: str | None

    def __init__(self, owner: Owner) -> None:
        self._owner: Final = owner  # its counters, its configuration, its hot-path flags
        self.requested_at: float | None = None
        self.kill_expected: str | None = None
        self.kill_at: float | None = None
        self.kill_source: str | None = None
        self.deadlines: Deadlines | None = None
        self.drain_deadline: float | None = None
        self._watchdog: threading.Timer | None = None
        # Recorded by the engine for the statistics.
        self.totals_at_request = (0, 0)  # connections_total, requests_total
        self.drain_duration: float | None = None
        self.cut_at_stopping = 0

    # -------------------------------------------------------------------- deadlines

    def set_kill_deadline(self, wall_clock_s: float, source: str) -> None:
        owner = self._owner
        self.kill_at = _deadlines.wall_to_loop(
            wall_clock_s, wall_now=time.time(), loop_now=owner._now()
        )
        self.kill_source = source
        if self.requested_at is not None:
            self._plan(self.requested_at)
            owner._notify()

    def _plan(self, requested_at: float) -> None:
        owner = self._owner
        d = _deadlines.plan(
            requested_at=requested_at,
            grace_period_s=owner.grace_period_s,
            kill_at=self.kill_at,
            kill_source=self.kill_source,
            drain_timeout_s=owner.drain_timeout_s,
            kill_margin_s=owner.kill_margin_s,
            longest_request_s=owner.longest_request_s(),
        )
        first = self.deadlines is None
        self.deadlines = d
        now = owner._now()
        if first and d.assumed and self.kill_expected is not None:
            logger.info(
                "kill deadline: waiting for %s; %g s assumed until then",
                self.kill_expected,
                _deadlines.DEFAULT_GRACE_PERIOD_S,
            )
        if not first:
            accepting = ""
            if self.phase is Phase.ACCEPTING:
                accepting = f"; accepting at most {max(0.0, d.accept_by - now):.1f} s more"
            logger.info(
                "kill deadline from %s: SIGKILL in %.1f s%s", d.kill_source, d.kill - now, accepting
            )
        if self.drain_deadline is not None:
            self.drain_deadline = min(self.drain_deadline, d.stop_by)
        if owner.hard_exit:
            # Half the exit margin after exit_by: stopping's own timeouts (at exit_by)
            # report what they abandoned first, and SIGKILL is still a margin away.
            self._arm_watchdog(d.exit_by + _deadlines.exit_margin(owner.kill_margin_s) / 2 - now)

    def _accept_deadline(self, d: Deadlines) -> float:
        """``accept_by`` with the drain budget measured now (requests keep being timed
        while accepting, so the estimate follows the traffic), never later than the
        plan announced: "accepting at most X s" is a promise, and a budget that shrank
        for a slow request does not grow back when fast ones follow."""
        assert self.requested_at is not None
        return min(
            d.accept_by,
            _deadlines.accept_by(
                requested_at=self.requested_at,
                stop_by=d.stop_by,
                drain_timeout_s=self._owner.drain_timeout_s,
                longest_request_s=self._owner.longest_request_s(),
            ),
        )

    def _phase_deadline(self) -> float | None:
        """The current phase's deadline (``ShutdownStatistics.time_left_s`` says which)."""
        d = self.deadlines
        if d is None:
            return None
        if self.phase is Phase.ACCEPTING:
            deadline = self._accept_deadline(d)
            max_wait = self._owner.policy.max_wait_s
            if max_wait is not None and self.requested_at is not None:
                deadline = min(deadline, self.requested_at + max_wait)
            return deadline
        if self.phase is Phase.DRAINING:
            return self.drain_deadline
        if self.phase is Phase.STOPPING:
            return d.exit_by
        return None

    # ------------------------------------------------------------------- statistics

    def statistics(self) -> ShutdownStatistics:
        owner = self._owner
        now = owner._now()
        deadline = self._phase_deadline()
        in_flight, started = owner._external_requests()
        requested = self.requested_at is not None
        return ShutdownStatistics(
            phase=self.phase,
            reason=self.reason,
            connections=owner._connections,
            requests=owner._requests + in_flight,
            sessions=len(owner._sessions),
            connections_total=owner._connections_total,
            requests_total=owner._requests_total + started,
            time_in_phase_s=0.0 if self.phase_since is None else now - self.phase_since,
            time_left_s=None if deadline is None else max(0.0, deadline - now),
            kill_deadline_in_s=None if self.deadlines is None else self.deadlines.kill - now,
            connections_after_shutdown=owner._connections_total - self.totals_at_request[0]
            if requested
            else 0,
            requests_after_shutdown=owner._requests_total + started - self.totals_at_request[1]
            if requested
            else 0,
            connections_closed_draining=owner._closed_draining,
            cut_at_stopping=self.cut_at_stopping,
            since_last_connection_s=None
            if owner._last_activity_at is None
            else now - owner._last_activity_at,
            drain_duration_s=self.drain_duration,
        )

    # ------------------------------------------------------------------------- exit

    def exit_soon(self, within_s: float) -> None:
        if not self._owner.hard_exit:
            return
        d = self.deadlines
        delay = within_s if d is None else self._owner.time_left_s(d.exit_by, at_most_s=within_s)
        self._arm_watchdog(delay)

    def _arm_watchdog(self, delay_s: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        # A year is "never" here, and stays below what the platform's timers accept.
        timer = threading.Timer(min(max(0.0, delay_s), _YEAR_S), self._hard_exit)
        timer.daemon = True
        timer.name = "graceful-hard-exit"
        timer.start()
        self._watchdog = timer

    def _hard_exit(self) -> None:
        """The watchdog fired: the process is still alive at ``exit_by``.  An error if
        that cuts something short (the shutdown, a connection, a request, a session, a
        thread); a warning if the shutdown was complete and only the interpreter's own
        exit was late (an ``atexit`` handler, a loaded machine): nothing is lost."""
        owner = self._owner
        threads = [
            t.name
            for t in threading.enumerate()
            if t not in (threading.current_thread(), threading.main_thread())
            and not t.daemon
            and t.is_alive()
        ]
        complete = self.phase is Phase.STOPPED and not (
            threads or owner._connections or owner._requests or owner._sessions
        )
        logger.log(
            logging.WARNING if complete else logging.ERROR,
            "still alive at the last moment before SIGKILL (phase %s); exiting, abandoning %s%s",
            self.phase,
            self._counts(sessions=True),
            f" and threads {', '.join(threads)}" if threads else "",
        )
        _flush_and_exit(0 if self.phase is Phase.STOPPED else 1)

    # -------------------------------------------------------- the counts in the log

    def _counts(self, *, sessions: bool = False) -> str:
        """``"1 connection, 2 requests"``, with the sessions when there are any."""
        owner = self._owner
        parts = [_counted(owner._connections, "connection"), _counted(owner._requests, "request")]
        if sessions or owner._sessions:
            parts.append(_counted(len(owner._sessions), "session"))
        return ", ".join(parts)


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _flush_and_exit(status: int) -> None:
    """``os._exit`` after flushing what can be flushed without taking locks we may not
    get (the main thread may hold them)."""
    for handler in logging.getLogger().handlers + logging.getLogger("graceful").handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
