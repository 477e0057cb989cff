"""The machinery that runs a coordinator's phases, behind ``graceful.ShutdownCoordinator``.

Why a room of its own
---------------------
``ShutdownCoordinator`` is what users and adapters see: the configuration, the phase,
the reporting calls, the registries, the statistics.  What *moves* the phase — the
``run`` task, the queued transitions, the deadlines, the stopping steps and hooks, the
waiters, the watchdog, the log of every phase change — is here, so that the facade reads
in one screen and this part can be read on its own.  Each coordinator owns one
``PhaseEngine`` and delegates to it; the engine reads the coordinator's counters and
configuration and flips the flags its hot path reads (``_draining``, ``_nudging``: see
``graceful._core.tracking``).  The hot path itself never comes through here.

Phase changes are queued
------------------------
``request_shutdown`` changes the phase before it returns (a readiness probe fails in the
same tick) and phase listeners run synchronously in registration order.  A listener may
itself request a shutdown or advance the phase; its transition is queued behind the one
being announced, so every listener sees every phase in order and the log lines come out
in order.

Deadlines
---------
Computed once, when shutdown is first requested (see ``graceful._core.deadlines``): the
kill deadline from an absolute time (``ShutdownCoordinator.set_kill_deadline``, the
pod's ``deletionTimestamp``), the grace period, or Kubernetes' default with a warning.
Stopping has its own budget (``kill_margin_s``); hooks of earlier phases still running
when it begins are cancelled instead of eating into it.  With ``hard_exit`` (for
processes graceful owns: ``graceful run``, the gunicorn workers) a watchdog thread ends
the process at ``exit_by`` whatever the application does — a handler that swallows
cancellation, a lifespan shutdown that hangs, a blocked executor thread — and says what
it abandoned.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, TypeVar

import anyio
import anyio.abc
from typing_extensions import final

from . import deadlines as _deadlines
from .deadlines import Deadlines
from .hooks import Hook, run_hooks
from .phases import PhaseTable, RequestOutcome, Transition
from .policy import Phase, PolicyInput, _check_seconds
from .signals import (
    QUICK_SIGNALS,
    SHUTDOWN_SIGNALS,
    catch_signals,
    current_schedule,
    in_terminal_foreground,
    loop_handles,
    signal_name,
)

if TYPE_CHECKING:
    from .policy import Policy
    from .tracking import Session


class Owner(Protocol):
    """What the engine takes of its coordinator (``graceful.ShutdownCoordinator``, which
    owns the engine and hands itself in: the engine does not import it).  Its counters
    and hot-path flags are ``Tracking``'s; its configuration and the calls the engine
    makes back are the facade's."""

    # Tracking: the counters and flags the engine reads and sets.
    _sessions: set[Session]
    _zero_waiters: int
    _requests_total: int
    _last_activity_at: float | None
    _connections_total: int
    _connections: int
    _changed: anyio.Event | None
    _draining: bool
    _nudging: bool
    _closed_draining: int

    @property
    def _requests(self) -> int: ...
    @property
    def drained(self) -> bool: ...
    def _now(self) -> float: ...
    def _notify(self) -> None: ...
    def _idle(self, include_connections: bool = True, include_requests: bool = True) -> bool: ...
    def _external_requests(self) -> tuple[int, int]: ...
    def _start_timing(self, now: float) -> None: ...
    def oldest_request_age_s(self) -> float | None: ...
    def longest_request_s(self, *, running: bool = True) -> float | None: ...

    # The facade: its configuration and the calls the engine makes back.
    @property
    def policy(self) -> Policy: ...
    @property
    def drain_timeout_s(self) -> float: ...
    @property
    def grace_period_s(self) -> float | None: ...
    @property
    def kill_margin_s(self) -> float: ...
    @property
    def hook_timeout_s(self) -> float: ...
    @property
    def hard_exit(self) -> bool: ...
    @property
    def exit_on_third_request(self) -> bool: ...
    def drain_time_left(self) -> float | None: ...
    def time_left_s(self, until: float | None, *, at_most_s: float = ...) -> float: ...
    def signal_received(self, signum: int, *, quick: Collection[int] = ...) -> None: ...
    def request_shutdown(
        self,
        reason: str = ...,
        *,
        escalate: bool = ...,
        immediate: bool = ...,
        drain_now: bool = ...,
    ) -> None: ...
    def exit_soon(self, within_s: float = ...) -> None: ...


__all__ = (
    "DUPLICATE_WINDOW_S",
    "Background",
    "PhaseEngine",
    "PhaseListener",
    "ShutdownStatistics",
)

logger: Final = logging.getLogger("graceful")

#: While accepting with a request in flight, the budget is looked at again this often
#: (the request's age is evidence of how long draining needs).
AGE_RECHECK_S: Final = 0.1

#: A repeat of the first shutdown request's reason (``"SIGTERM"``) this soon after it is
#: the same event arriving twice, not a second request: a signal sent to a process group
#: reaches a gunicorn worker from the kernel and again from the master relaying it
#: (systemd's ``KillMode=control-group``, dumb-init's setsid mode, supervisord's
#: ``stopasgroup``, ``timeout``), within milliseconds, tens of them under load.  A person
#: pressing Ctrl-C twice to force the exit takes longer than this.
DUPLICATE_WINDOW_S: Final = 0.3

PhaseListener = Callable[[Phase], None]
Background = Callable[[], Awaitable[object]]
_YEAR_S: Final = 365 * 24 * 3600.0


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


@final
class PhaseEngine:
    """Runs the phases of the coordinator that owns it (see the module docs).

    Attributes the coordinator reads (and its registries, which it fills) have public
    names; the methods without docs carry out the coordinator's method of the same name.
    """

    def __init__(self, owner: Owner) -> None:
        self._owner: Final = owner  # its counters, its configuration, its hot-path flags
        self._table = PhaseTable()
        self.phase = Phase.SERVING
        self.phase_since: float | None = None
        self.reason: str | None = None
        self._queue: collections.deque[Transition] = collections.deque()
        self._dispatching = False
        self.requested_at: float | None = None
        self._first_reason: str | None = None
        self.kill_expected: str | None = None
        self.kill_at: float | None = None
        self.kill_source: str | None = None
        self.deadlines: Deadlines | None = None
        self.endpoint_removed_at: float | None = None
        self.drain_deadline: float | None = None
        self._listeners: list[PhaseListener] = []
        self.hooks: dict[Phase, list[Hook]] = {
            Phase.ACCEPTING: [],
            Phase.DRAINING: [],
            Phase.STOPPING: [],
        }
        self.stopping_steps: list[Hook] = []
        self._background: list[Background] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop_thread: int | None = None
        self._schedule: Callable[[Callable[[], object]], object] | None = None
        self.running = False
        self._watchdog: threading.Timer | None = None
        self.totals_at_request = (0, 0)  # connections_total, requests_total
        self._draining_at: float | None = None
        self.drain_duration: float | None = None
        self.cut_at_stopping = 0
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

    def set_kill_deadline(self, wall_clock_s: float, source: str) -> None:
        owner = self._owner
        self.kill_at = _deadlines.wall_to_loop(
            wall_clock_s, wall_now=time.time(), loop_now=owner._now()
        )
        self.kill_source = source
        if self.requested_at is not None:
            self._plan(self.requested_at)
            owner._notify()

    def notify_endpoint_removed(self) -> None:
        if self.endpoint_removed_at is None:
            self.endpoint_removed_at = self._owner._now()
            logger.info("endpoint removed from its EndpointSlice")
            self._owner._notify()

    # ----------------------------------------------------------------- registries

    def subscribe(self, listener: PhaseListener) -> Callable[[], None]:
        listeners = self._listeners
        listeners.append(listener)

        def unsubscribe() -> None:
            if listener in listeners:
                listeners.remove(listener)

        return unsubscribe

    def add_hook(self, hook: Hook, phase: Phase) -> None:
        if phase not in self.hooks:
            raise ValueError(
                f"phase must be Phase.ACCEPTING, Phase.DRAINING or Phase.STOPPING, got {phase!r}"
            )
        self.hooks[phase].append(_check_callable("hook", hook))

    def add_stopping_step(self, step: Hook) -> None:
        self.stopping_steps.append(_check_callable("step", step))

    def start_background(self, task: Background) -> None:
        _check_callable("task", task)
        if self._tg is not None:
            self._tg.start_soon(self._guarded, task)
        else:
            self._background.append(task)

    async def _guarded(self, task: Background) -> None:
        try:
            await task()
        except Exception:
            logger.exception("background task %s failed", getattr(task, "__qualname__", task))

    # ------------------------------------------------------------------------ run

    async def run(
        self,
        shutdown_trigger: Callable[[], Awaitable[object]] | None,
        task_status: anyio.abc.TaskStatus[None],
    ) -> None:
        if self.running:
            raise RuntimeError("ShutdownCoordinator.run() is already running")
        self.running = True
        if self.phase_since is None:
            self.phase_since = self._owner._now()
        self._schedule = current_schedule()
        self._loop_thread = threading.get_ident()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for task in self._background:
                    tg.start_soon(self._guarded, task)
                self._background.clear()
                if shutdown_trigger is not None:
                    tg.start_soon(self._await_trigger, shutdown_trigger)
                    task_status.started()
                    await self._run_phases()
                else:
                    if any(loop_handles(s) for s in SHUTDOWN_SIGNALS):
                        logger.warning(
                            "SIGTERM and SIGINT are also handled by the event loop "
                            "(loop.add_signal_handler: hypercorn.asyncio.serve?): the server "
                            "stops at the signal whatever the policy; run the app with "
                            "'graceful run --server hypercorn' or graceful.hypercorn"
                        )
                    with catch_signals(
                        (*SHUTDOWN_SIGNALS, *QUICK_SIGNALS),
                        self._on_signal,
                        schedule=self._schedule,
                        hand_over=True,
                    ):
                        task_status.started()
                        await self._run_phases()
                tg.cancel_scope.cancel()
        finally:
            self._tg = None
            self.running = False
            self._loop_thread = None

    def _on_signal(self, signum: int) -> None:
        self._owner.signal_received(signum)

    async def _await_trigger(self, trigger: Callable[[], Awaitable[object]]) -> None:
        await trigger()
        self._owner.request_shutdown("shutdown trigger")

    async def _run_phases(self) -> None:
        await self.wait_until(lambda: self.phase > Phase.SERVING, None)
        with anyio.CancelScope() as background:
            async with anyio.create_task_group() as hooks:
                if self.phase is Phase.ACCEPTING:
                    hooks.start_soon(self._run_phase_hooks, Phase.ACCEPTING)
                    await self._accept()
                if self.phase is Phase.DRAINING:
                    hooks.start_soon(self._run_phase_hooks, Phase.DRAINING)
                    await self._drain()
                # Stopping has its own budget: hooks of earlier phases end here.
                background.cancel()
        d = self.deadlines
        assert d is not None
        now = self._owner._now
        await run_hooks(
            self.stopping_steps, label="stopping step", timeout_s=None, deadline=d.exit_by, now=now
        )
        await run_hooks(
            list(reversed(self.hooks[Phase.STOPPING])),
            label="stopping hook",
            timeout_s=self._owner.hook_timeout_s,
            deadline=d.exit_by,
            now=now,
        )
        self._advance(Phase.STOPPED, "shutdown complete")

    async def _run_phase_hooks(self, phase: Phase) -> None:
        d = self.deadlines
        await run_hooks(
            self.hooks[phase],
            label=f"{phase} hook",
            timeout_s=self._owner.hook_timeout_s,
            deadline=None if d is None else d.stop_by,
            now=self._owner._now,
        )

    async def _accept(self) -> None:
        assert self.requested_at is not None
        owner = self._owner
        while self.phase is Phase.ACCEPTING:
            d = self.deadlines
            assert d is not None
            accept_deadline = self._accept_deadline(d)
            decision = owner.policy.decide(
                PolicyInput(
                    now=owner._now(),
                    requested_at=self.requested_at,
                    last_connection_at=owner._last_activity_at,
                    accept_deadline=accept_deadline,
                    endpoint_removed_at=self.endpoint_removed_at,
                )
            )
            if decision.stop_accepting:
                self._advance(Phase.DRAINING, decision.reason)
                return
            timeout = None
            if decision.recheck_at is not None:
                timeout = max(0.0, decision.recheck_at - owner._now())
            if owner.oldest_request_age_s() is not None:
                # A request in flight grows the budget as it ages: look again soon.
                timeout = AGE_RECHECK_S if timeout is None else min(timeout, AGE_RECHECK_S)
            await self._wait_for_change(timeout)

    async def _drain(self) -> None:
        assert self.drain_deadline is not None
        owner = self._owner
        next_log = owner._now() + 1.0
        owner._zero_waiters += 1
        try:
            while self.phase is Phase.DRAINING:
                now = owner._now()
                if owner.drained:
                    self._advance(Phase.STOPPING, "drained")
                    return
                if now >= self.drain_deadline:
                    self._advance(
                        Phase.STOPPING, f"drain deadline reached with {self._counts()} left"
                    )
                    return
                if now >= next_log:
                    logger.info(
                        "draining: %s, %.1f s left", self._counts(), owner.drain_time_left() or 0.0
                    )
                    next_log = now + 1.0
                await self._wait_for_change(min(next_log, self.drain_deadline) - now)
        finally:
            owner._zero_waiters -= 1

    # -------------------------------------------------------- statistics, deadlines

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

    # ----------------------------------------------------------------------- exit

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
        """The watchdog fired: the process is still alive at ``exit_by``."""
        threads = [
            t.name
            for t in threading.enumerate()
            if t not in (threading.current_thread(), threading.main_thread())
            and not t.daemon
            and t.is_alive()
        ]
        logger.error(
            "still alive at the last moment before SIGKILL (phase %s); exiting, abandoning %s%s",
            self.phase,
            self._counts(sessions=True),
            f" and threads {', '.join(threads)}" if threads else "",
        )
        _flush_and_exit(0 if self.phase is Phase.STOPPED else 1)

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

    def _counts(self, *, sessions: bool = False) -> str:
        """``"1 connection, 2 requests"``, with the sessions when there are any."""
        owner = self._owner
        parts = [_counted(owner._connections, "connection"), _counted(owner._requests, "request")]
        if sessions or owner._sessions:
            parts.append(_counted(len(owner._sessions), "session"))
        return ", ".join(parts)

    # -------------------------------------------------------------------- waiting

    async def _wait_for_change(self, timeout_s: float | None) -> None:
        owner = self._owner
        if owner._changed is None:
            owner._changed = anyio.Event()
        event = owner._changed
        with anyio.move_on_after(math.inf if timeout_s is None else timeout_s):
            await event.wait()

    async def wait_drained(
        self,
        include_connections: bool,
        include_requests: bool,
        until_stopping: bool,
        timeout_s: float | None,
    ) -> bool:
        owner = self._owner

        def done() -> bool:
            if owner._idle(include_connections, include_requests):
                return True
            return until_stopping and self.phase >= Phase.STOPPING

        await self.wait_until(done, timeout_s, zero=True)
        return owner._idle(include_connections, include_requests)

    async def wait_until(
        self, condition: Callable[[], bool], timeout_s: float | None, *, zero: bool = False
    ) -> bool:
        """Wait until ``condition()`` holds (``False``: ``timeout_s`` elapsed first);
        ``zero`` wakes the check whenever a count reaches zero."""
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
        owner = self._owner
        if zero:
            owner._zero_waiters += 1
        try:
            with anyio.move_on_after(math.inf if timeout_s is None else timeout_s):
                while not condition():
                    await self._wait_for_change(None)
                return True
            return condition()
        finally:
            if zero:
                owner._zero_waiters -= 1


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


_C = TypeVar("_C")


def _check_callable(name: str, value: _C) -> _C:
    """``value`` if it is callable, else a ``TypeError`` naming ``name``."""
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {value!r}")
    return value
