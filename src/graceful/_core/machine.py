"""What moves the phase: shutdown requests and signals, queued transitions, their announcement.

``PhaseMachine`` is the synchronous half of the coordinator's engine: everything that
changes the phase *now*, from whatever calls it — an adapter, a signal handler, a phase
listener, another thread.  The asynchronous half, the ``run`` task that changes it as
time passes (``graceful._core.engine.PhaseEngine``), is its subclass; the deadlines it
plans at the first request are its base's (``graceful._core.timetable``).  The escalation
rules themselves are the pure table of ``graceful._core.phases``: this carries them out.

Phase changes are queued
------------------------
``request_shutdown`` changes the phase before it returns (a readiness probe fails in the
same tick) and phase listeners run synchronously in registration order.  A listener may
itself request a shutdown or advance the phase; its transition is queued behind the one
being announced, so every listener sees every phase in order and the log lines come out
in order.  Adapters' listeners run before the log line, so that the listener is closed
when "draining" is logged.

A repeat is not an escalation
-----------------------------
A second request escalates, except the same event arriving twice: a repeat of the first
request's reason within ``DUPLICATE_WINDOW_S``, or a signal the parent process is known to
relay (``relayed``: ``ShutdownCoordinator.expect_relayed_signals``) however late.  A
request from another thread than the run task's is handed to its loop (``_schedule``, set
by ``run`` while it runs), so that listeners and waiters hear it on the loop.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Final

from . import deadlines as _deadlines
from .checkers import HealthCheckers
from .phases import PhaseTable, RequestOutcome, Transition
from .policy import Phase
from .signals import in_terminal_foreground, signal_name
from .timetable import Timetable, _flush_and_exit

if TYPE_CHECKING:
    from .owner import Owner

__all__ = ("DUPLICATE_WINDOW_S", "PhaseListener", "PhaseMachine")

logger: Final = logging.getLogger("graceful")

#: A repeat of the first shutdown request's reason (``"SIGTERM"``) this soon after it is
#: the same event arriving twice, not a second request: a signal sent to a process group
#: reaches a gunicorn worker from the kernel and again from the master relaying it
#: (systemd's ``KillMode=control-group``, dumb-init's setsid mode, supervisord's
#: ``stopasgroup``, ``timeout``), within milliseconds, tens of them under load.  A person
#: pressing Ctrl-C twice to force the exit takes longer than this.
DUPLICATE_WINDOW_S: Final = 0.3

PhaseListener = Callable[[Phase], None]


class PhaseMachine(Timetable):
    """The synchronous half of ``PhaseEngine``, its subclass (see the module docs)."""

    def __init__(self, owner: Owner) -> None:
        super().__init__(owner)
        self._table = PhaseTable()
        self.phase = Phase.SERVING
        self.phase_since: float | None = None
        self.reason: str | None = None
        self._queue: collections.deque[Transition] = collections.deque()
        self._dispatching = False
        self._first_reason: str | None = None
        self.endpoint_removed_at: float | None = None
        self.checkers = HealthCheckers(owner._now, owner._notify, lambda: self.requested_at)
        self._listeners: list[PhaseListener] = []
        # Where the run task runs (set by ``run`` while it runs).
        self._loop_thread: int | None = None
        self._schedule: Callable[[Callable[[], object]], object] | None = None
        self._draining_at: float | None = None
        self.relayed: frozenset[int] = frozenset()  # see expect_relayed_signals

    # ------------------------------------------------------------------- triggers

    def request_shutdown(
        self, reason: str, *, escalate: bool, immediate: bool, drain_now: bool
    ) -> None:
        schedule = self._schedule
        if (
            schedule is not None
            and self._loop_thread is not None
            and threading.get_ident() != self._loop_thread
        ):
            schedule(
                lambda: self.request_shutdown(
                    reason, escalate=escalate, immediate=immediate, drain_now=drain_now
                )
            )
            return
        owner = self._owner
        now = owner._now()
        if (
            escalate
            and self.requested_at is not None
            and reason == self._first_reason
            and now - self.requested_at < DUPLICATE_WINDOW_S
            and not immediate
        ):
            logger.info(
                "%s again %.0f ms after the first: the same event (a process group's "
                "signal and its relay), not an escalation",
                reason,
                (now - self.requested_at) * 1000,
            )
            return
        if self.requested_at is None:
            self.requested_at = now
            self._first_reason = reason
            started = owner._requests_total + owner._external_requests()[1]
            self.totals_at_request = (owner._connections_total, started)
            owner._start_timing(now)  # measure what draining will need
            self._plan(now)
        outcome: RequestOutcome = self._table.request_shutdown(
            reason, escalate=escalate, immediate=immediate, drain_now=drain_now
        )
        if outcome.exit_now:
            if owner.exit_on_third_request:
                logger.warning("%s: third shutdown request, exiting immediately", reason)
                _flush_and_exit(1)
            logger.warning("%s: third shutdown request; still stopping", reason)
        elif outcome.ignored and self._table.requests >= 2:
            logger.info("shutdown already %s; ignoring %s", self.phase, reason)
        self._enqueue(outcome.transitions)

    def signal_received(self, signum: int, quick: Collection[int]) -> None:
        if (
            signum in self.relayed
            and self.requested_at is not None
            and self._first_reason == signal_name(signum)
        ):
            logger.info(
                "%s again %.0f ms after the first: relayed by the parent process, not an "
                "escalation",
                self._first_reason,
                (self._owner._now() - self.requested_at) * 1000,
            )
            return
        interactive = signum == signal.SIGINT and in_terminal_foreground()
        self.request_shutdown(
            signal_name(signum) + (" (terminal)" if interactive else ""),
            escalate=True,
            immediate=signum in quick,
            drain_now=interactive,
        )

    def notify_endpoint_removed(self, seconds_ago: float = 0.0) -> None:
        # The earliest report wins: a watch that sees the removal now and the pod's
        # deletion that says it happened before may come in either order.
        at = self._owner._now() - seconds_ago
        if self.endpoint_removed_at is None or at < self.endpoint_removed_at:
            first = self.endpoint_removed_at is None
            self.endpoint_removed_at = at
            ago = f" {seconds_ago:.1f} s ago" if seconds_ago else ""
            if first or seconds_ago:
                logger.info("endpoint removed from its EndpointSlice%s", ago)
            self._owner._notify()

    # ------------------------------------------------------------------ listeners

    def subscribe(self, listener: PhaseListener) -> Callable[[], None]:
        listeners = self._listeners
        listeners.append(listener)

        def unsubscribe() -> None:
            if listener in listeners:
                listeners.remove(listener)

        return unsubscribe

    # ---------------------------------------------------------------- transitions

    def _enqueue(self, transitions: tuple[Transition, ...]) -> None:
        self._queue.extend(transitions)
        if self._dispatching:
            return  # a listener asked: announced after the current transition
        self._dispatching = True
        try:
            while self._queue:
                self._dispatch(self._queue.popleft())
        finally:
            self._dispatching = False

    def _advance(self, phase: Phase, reason: str) -> None:
        step = self._table.advance(phase, reason)
        if step is not None:
            self._enqueue((step,))

    def _dispatch(self, step: Transition) -> None:
        owner = self._owner
        phase, reason = step.phase, step.reason
        now = owner._now()
        previous = self.phase
        self.phase, self.phase_since, self.reason = phase, now, reason
        if phase >= Phase.DRAINING and not owner._draining:
            owner._draining = True
            self._draining_at = now
            d = self.deadlines
            assert d is not None
            self.drain_deadline = _deadlines.drain_by(
                draining_at=now, drain_timeout_s=owner.drain_timeout_s, stop_by=d.stop_by
            )
        if phase is Phase.STOPPING:
            self.cut_at_stopping = owner._requests + len(owner._sessions)
            if self._draining_at is not None and previous is Phase.DRAINING:
                self.drain_duration = now - self._draining_at
        owner._nudging = phase >= Phase.DRAINING or (
            phase is Phase.ACCEPTING and owner.policy.nudge_clients
        )
        # Adapters act first (the listener is closed when 'draining' is logged).
        for listener in list(self._listeners):
            try:
                listener(phase)
            except Exception:
                logger.exception("phase listener %r failed", listener)
        extra = ""
        if phase is Phase.ACCEPTING and self.deadlines is not None:
            d = self.deadlines
            longest = owner.longest_request_s()
            measured = "" if longest is None else f", longest recent request {longest:.3g} s"
            extra = (
                f"; SIGKILL expected in {d.kill - now:.1f} s ({d.kill_source}): accepting at"
                f" most {d.accept_by - now:.1f} s, then {d.stop_by - d.accept_by:.1f} s to"
                f" drain{measured}"
            )
        elif phase is Phase.DRAINING:
            extra = f"; {owner.drain_time_left():.1f} s to drain"
        logger.info("%s -> %s: %s (%s%s)", previous, phase, reason, self._counts(), extra)
        if phase is Phase.DRAINING or (phase is Phase.STOPPING and previous < Phase.DRAINING):
            for session in list(owner._sessions):
                session._request_drain()
        if phase is Phase.STOPPED and self._watchdog is not None:
            # Done: the interpreter's teardown (tasks that ignore cancellation, executor
            # threads) gets what is left of the budget, at most a second.
            owner.exit_soon()
        owner._notify()
