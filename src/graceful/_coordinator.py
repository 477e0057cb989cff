"""The shutdown coordinator: one per process, the single source of truth for the phase.

How the pieces fit
------------------
Adapters (the uvicorn server, the ASGI middleware, the asyncio server, …) *report* to the
coordinator through the adapter API — a connection handed over by the kernel or closed, a
request started or finished, a session began, activity seen — and *obey* it: they
subscribe to phase changes, close their listener at ``DRAINING`` and register *stopping
steps* that cut what is left.  The coordinator is assembled from small parts, each with
its own essay:

* ``graceful._tracking`` — the counters and ``graceful.Session``, the hot path;
* ``graceful._phases`` — the pure phase/escalation table;
* ``graceful._deadlines`` — the pure deadline arithmetic;
* ``graceful._hooks`` — running user code bounded;
* ``graceful._signals`` — one signal helper for everything;
* this module — the thin anyio ``run()`` that ties them together.

Phase changes are queued
------------------------
``request_shutdown`` changes the phase before it returns (a readiness probe fails in the
same tick) and phase listeners run synchronously in registration order.  A listener may
itself request a shutdown or advance the phase; its transition is queued behind the one
being announced, so every listener sees every phase in order and the log lines come out
in order.

Deadlines
---------
Computed once, when shutdown is first requested (see ``graceful._deadlines``): the
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
from typing import Final

import anyio
import anyio.abc
from typing_extensions import final

from . import _deadlines
from ._deadlines import Deadlines
from ._hooks import Hook, run_hooks
from ._phases import PhaseTable, RequestOutcome, Transition
from ._policy import (
    AcceptUntilIdle,
    Phase,
    Policy,
    PolicyInput,
    _check_optional_seconds,
    _check_seconds,
)
from ._signals import (
    QUICK_SIGNALS,
    SHUTDOWN_SIGNALS,
    catch_signals,
    in_terminal_foreground,
    loop_handles,
    signal_name,
)
from ._tracking import Session, Tracking

__all__ = ("GRACE_PERIOD_ENV", "Session", "ShutdownCoordinator", "ShutdownStatistics")

logger: Final = logging.getLogger("graceful")

#: Environment variable holding the grace period (seconds before SIGKILL).
GRACE_PERIOD_ENV: Final = "GRACEFUL_GRACE_PERIOD"
#: A repeat of the first shutdown request's reason (``"SIGTERM"``) this soon after it is
#: the same event arriving twice, not a second request: a signal sent to a process group
#: reaches a gunicorn worker from the kernel and again from the master relaying it
#: (systemd's ``KillMode=control-group``, dumb-init's setsid mode, supervisord's
#: ``stopasgroup``, ``timeout``), within milliseconds, tens of them under load.  A person
#: pressing Ctrl-C twice to force the exit takes longer than this.
DUPLICATE_WINDOW_S: Final = 0.3

PhaseListener = Callable[[Phase], None]
_YEAR_S: Final = 365 * 24 * 3600.0
Background = Callable[[], Awaitable[object]]


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


def _grace_from_environment() -> float | None:
    env = os.environ.get(GRACE_PERIOD_ENV, "").strip()
    if not env:
        return None
    try:
        value = float(env)
    except ValueError:
        raise ValueError(
            f"{GRACE_PERIOD_ENV} must be a finite number of seconds > 0, got {env!r}"
        ) from None
    return _check_seconds(GRACE_PERIOD_ENV, value)


@final
class ShutdownCoordinator(Tracking):
    """Tracks connections, requests and sessions and runs a shutdown policy.

    Create one per process, hand it to the adapters (``graceful.asgi``,
    ``graceful.uvicorn``, ``graceful.asyncio``, …) and run ``run`` in a task.
    Methods are for the event-loop thread, except ``request_shutdown``, which may be
    called from any thread.

    Args:
        policy: When accepting ends; defaults to ``AcceptUntilIdle``.
        drain_timeout_s: The longest time spent draining before remaining work is
            cancelled.
        grace_period_s: Seconds from the shutdown request to the expected SIGKILL (the
            pod's ``terminationGracePeriodSeconds``, gunicorn's ``graceful_timeout``);
            ``None`` reads ``GRACEFUL_GRACE_PERIOD`` and, if unset, assumes Kubernetes'
            default of 30 s (with a warning at shutdown).
        kill_margin_s: Stopping begins at least this long before the kill deadline;
            it is stopping's whole budget (cut, lifespan shutdown, hooks).
        hook_timeout_s: The longest time one shutdown hook may run.
        exit_on_third_request: A third shutdown request (a third Ctrl-C) exits the
            process at once with status 1.  Off by default: only a program that owns
            the process should exit it.
        hard_exit: End the process at the last moment before the kill deadline if it
            is still alive then (see the module docs); for programs that own the
            process.
    """

    def __init__(
        self,
        *,
        policy: Policy | None = None,
        drain_timeout_s: float = 30.0,
        grace_period_s: float | None = None,
        kill_margin_s: float = 1.0,
        hook_timeout_s: float = 5.0,
        exit_on_third_request: bool = False,
        hard_exit: bool = False,
    ) -> None:
        super().__init__()
        if policy is None:
            policy = AcceptUntilIdle()
        elif not isinstance(policy, Policy):
            raise TypeError(f"policy must be a graceful Policy instance, got {policy!r}")
        for name, flag in (
            ("exit_on_third_request", exit_on_third_request),
            ("hard_exit", hard_exit),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        self.policy: Final = policy
        self.drain_timeout_s: Final = _check_seconds("drain_timeout_s", drain_timeout_s)
        if grace_period_s is None:
            grace_period_s = _grace_from_environment()
        self.grace_period_s: Final = _check_optional_seconds("grace_period_s", grace_period_s)
        self.kill_margin_s: Final = _check_seconds("kill_margin_s", kill_margin_s)
        if self.grace_period_s is not None and self.kill_margin_s >= self.grace_period_s:
            raise ValueError(
                f"kill_margin_s ({self.kill_margin_s:g}) must be less than grace_period_s "
                f"({self.grace_period_s:g})"
            )
        self.hook_timeout_s: Final = _check_seconds("hook_timeout_s", hook_timeout_s)
        self.exit_on_third_request: Final = exit_on_third_request
        self.hard_exit: Final = hard_exit

        self._table = PhaseTable()
        self._phase = Phase.SERVING
        self._phase_since: float | None = None
        self._reason: str | None = None
        self._queue: collections.deque[Transition] = collections.deque()
        self._dispatching = False
        self._requested_at: float | None = None
        self._first_reason: str | None = None
        self._kill_expected: str | None = None
        self._announced = False
        self._kill_at: float | None = None
        self._kill_source: str | None = None
        self._deadlines: Deadlines | None = None
        self._endpoint_removed_at: float | None = None
        self._drain_deadline: float | None = None
        self._listeners: list[PhaseListener] = []
        self._hooks: dict[Phase, list[Hook]] = {
            Phase.ACCEPTING: [],
            Phase.DRAINING: [],
            Phase.STOPPING: [],
        }
        self._stopping_steps: list[Hook] = []
        self._background: list[Background] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop_thread: int | None = None
        self._schedule: Callable[[Callable[[], object]], object] | None = None
        self._running = False
        self._watchdog: threading.Timer | None = None
        self._totals_at_request = (0, 0)  # connections_total, requests_total
        self._draining_at: float | None = None
        self._drain_duration: float | None = None
        self._cut_at_stopping = 0

    # ------------------------------------------------------------------ reading

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self._phase

    @property
    def accepting(self) -> bool:
        """``True`` while new connections should be accepted (serving or accepting)."""
        return self._phase <= Phase.ACCEPTING

    @property
    def cutting(self) -> bool:
        """``True`` once stopping began: work still running is being cut."""
        return self._phase >= Phase.STOPPING

    @property
    def shutdown_requested(self) -> bool:
        """``True`` once shutdown was requested."""
        return self._phase > Phase.SERVING

    @property
    def running(self) -> bool:
        """``True`` while ``run`` runs: something will carry out a shutdown request
        (a graceful server, or the application's own ``run()``)."""
        return self._running

    @property
    def deadlines(self) -> Deadlines | None:
        """The deadlines of the shutdown under way (``None`` before the request)."""
        return self._deadlines

    def time_left_s(self, until: float | None, *, at_most_s: float = math.inf) -> float:
        """Seconds from now until ``until`` (≥ 0), capped at ``at_most_s``.

        ``coordinator.time_left_s(coordinator.deadlines.exit_by, at_most_s=1)`` bounds a
        stopping step.
        """
        if until is None:
            return at_most_s
        return max(0.0, min(at_most_s, until - self._now()))

    def drain_time_left(self) -> float | None:
        """Seconds until the drain deadline, once draining; ``None`` before.  Streaming
        handlers use it to finish in time."""
        if self._drain_deadline is None:
            return None
        return max(0.0, self._drain_deadline - self._now())

    def statistics(self) -> ShutdownStatistics:
        """Return a frozen snapshot of the phase, the counts and the deadlines."""
        now = self._now()
        d = self._deadlines
        deadline: float | None = None
        if d is not None:
            if self._phase is Phase.ACCEPTING:
                deadline = self._accept_deadline(d)
                max_wait = self.policy.max_wait_s
                if max_wait is not None and self._requested_at is not None:
                    deadline = min(deadline, self._requested_at + max_wait)
            elif self._phase is Phase.DRAINING:
                deadline = self._drain_deadline
            elif self._phase is Phase.STOPPING:
                deadline = d.exit_by
        in_flight, started = self._external_requests()
        return ShutdownStatistics(
            phase=self._phase,
            reason=self._reason,
            connections=self._connections,
            requests=self._requests + in_flight,
            sessions=len(self._sessions),
            connections_total=self._connections_total,
            requests_total=self._requests_total + started,
            time_in_phase_s=0.0 if self._phase_since is None else now - self._phase_since,
            time_left_s=None if deadline is None else max(0.0, deadline - now),
            kill_deadline_in_s=None if d is None else d.kill - now,
            connections_after_shutdown=self._connections_total - self._totals_at_request[0]
            if self._requested_at is not None
            else 0,
            requests_after_shutdown=self._requests_total + started - self._totals_at_request[1]
            if self._requested_at is not None
            else 0,
            connections_closed_draining=self._closed_draining,
            cut_at_stopping=self._cut_at_stopping,
            since_last_connection_s=None
            if self._last_activity_at is None
            else now - self._last_activity_at,
            drain_duration_s=self._drain_duration,
        )

    # ----------------------------------------------------------- adapter API

    def subscribe(self, listener: PhaseListener) -> Callable[[], None]:
        """Call ``listener(phase)`` synchronously at every phase change, in order.

        Adapters use this to obey the coordinator (close the listener at ``DRAINING``).
        Listeners run in registration order and must not block; one that raises is
        logged and does not stop the others.  A listener that requests a shutdown
        queues its transition behind the current one.

        Returns:
            A function that unsubscribes the listener.
        """
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def add_stopping_step(self, step: Hook) -> None:
        """For adapters: run ``step`` when stopping begins, before any user hook.

        Steps cut what is left (cancel requests, close connections, run the ASGI
        lifespan shutdown); they run in registration order and share stopping's budget
        (each bounded by ``exit_by``, see ``deadlines``).
        """
        if not callable(step):
            raise TypeError(f"step must be callable, got {step!r}")
        self._stopping_steps.append(step)

    def start_background(self, task: Background) -> None:
        """Run ``task()`` in the coordinator's task group while ``run`` runs.

        For watchers that report to the coordinator (the Kubernetes endpoint watcher):
        started when ``run`` starts (or at once if it already runs), cancelled when the
        coordinator reaches ``STOPPED``.
        """
        if not callable(task):
            raise TypeError(f"task must be callable, got {task!r}")
        if self._tg is not None:
            self._tg.start_soon(self._guarded, task)
        else:
            self._background.append(task)

    async def _guarded(self, task: Background) -> None:
        try:
            await task()
        except Exception:
            logger.exception("background task %s failed", getattr(task, "__qualname__", task))

    def add_hook(self, hook: Hook, *, phase: Phase = Phase.STOPPING) -> None:
        """Run ``hook`` when the coordinator enters ``phase``.

        ``ACCEPTING`` and ``DRAINING`` hooks run in registration order, in the
        background, as their phase begins, and are cancelled if still running when
        stopping begins.  ``STOPPING`` hooks run in reverse registration order (like
        ``contextlib.ExitStack``) after the adapters' stopping steps.  A phase
        skipped by an escalation skips its hooks; ``STOPPING`` hooks always run.  Each
        hook gets at most ``hook_timeout_s`` and never runs past the end of stopping;
        one that raises or times out is logged and the rest still run.  Async hooks run
        on the event loop; synchronous ones in a worker thread, so that a hanging one
        can be abandoned.

        Raises:
            ValueError: if ``phase`` is not ACCEPTING, DRAINING or STOPPING.
            TypeError: if ``hook`` is not callable.
        """
        if phase not in self._hooks:
            raise ValueError(
                f"phase must be Phase.ACCEPTING, Phase.DRAINING or Phase.STOPPING, got {phase!r}"
            )
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        self._hooks[phase].append(hook)

    # ------------------------------------------------------------------- triggers

    def request_shutdown(
        self,
        reason: str = "requested",
        *,
        escalate: bool = True,
        immediate: bool = False,
        drain_now: bool = False,
    ) -> None:
        """Ask for shutdown.

        From the event-loop thread the phase changes before this returns; from another
        thread the request is handed to the loop (thread-safe).  The first request
        starts *accepting*; a second one (with ``escalate``) goes straight to
        *stopping*; a third exits the process if ``exit_on_third_request``.

        Args:
            reason: Why, for the log (``"SIGTERM"``, ``"preStop"``, …).
            escalate: Count this request towards escalation.  The preStop endpoint
                passes ``False``: asking twice for the same shutdown is not a hurry.
            immediate: Go to *stopping* at once (SIGQUIT, gunicorn's quick shutdown).
            drain_now: Skip *accepting* and drain at once, whatever the policy (a
                worker recycled after ``max_requests`` while its siblings keep serving).
        """
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
        now = self._now()
        if (
            escalate
            and self._requested_at is not None
            and reason == self._first_reason
            and now - self._requested_at < DUPLICATE_WINDOW_S
            and not immediate
        ):
            logger.info(
                "%s again %.0f ms after the first: the same event (a process group's "
                "signal and its relay), not an escalation",
                reason,
                (now - self._requested_at) * 1000,
            )
            return
        if self._requested_at is None:
            self._requested_at = now
            self._first_reason = reason
            started = self._requests_total + self._external_requests()[1]
            self._totals_at_request = (self._connections_total, started)
            self._timing = True  # measure what draining will need
            self._plan(now)
        outcome: RequestOutcome = self._table.request_shutdown(
            reason, escalate=escalate, immediate=immediate, drain_now=drain_now
        )
        if outcome.exit_now:
            if self.exit_on_third_request:
                logger.warning("%s: third shutdown request, exiting immediately", reason)
                _flush_and_exit(1)
            logger.warning("%s: third shutdown request; still stopping", reason)
        elif outcome.ignored and self._table.requests >= 2:
            logger.info("shutdown already %s; ignoring %s", self._phase, reason)
        self._enqueue(outcome.transitions)

    def signal_received(self, signum: int, *, quick: Collection[int] = QUICK_SIGNALS) -> None:
        """Request shutdown for a signal an adapter caught (from the event-loop thread or
        any other, as ``request_shutdown``).

        ``quick`` signals stop at once.  A SIGINT while this process is in the
        foreground of its terminal is somebody's Ctrl-C: no load balancer routes to a
        terminal, so it drains at once (as stock servers do) instead of following the
        policy; a second Ctrl-C still cuts what is left.
        """
        interactive = signum == signal.SIGINT and in_terminal_foreground()
        self.request_shutdown(
            signal_name(signum) + (" (terminal)" if interactive else ""),
            immediate=signum in quick,
            drain_now=interactive,
        )

    def set_kill_deadline(self, wall_clock_s: float, *, source: str) -> None:
        """Set the kill deadline to an absolute wall-clock time (``time.time()`` seconds).

        Kubernetes knows it: the pod's ``deletionTimestamp``.  It replaces the grace
        period; called after shutdown was requested, the deadlines are re-planned.
        """
        value = _check_seconds("wall_clock_s", wall_clock_s)
        self._kill_at = _deadlines.wall_to_loop(value, wall_now=time.time(), loop_now=self._now())
        self._kill_source = source
        if self._requested_at is not None:
            self._plan(self._requested_at)
            self._notify()

    def expect_kill_deadline(self, source: str) -> None:
        """Announce that a watcher will report the kill deadline (``set_kill_deadline``)
        shortly after the shutdown request, from ``source`` (``"the pod's
        deletionTimestamp"``): with no grace period configured, the default is still
        assumed until it arrives, but the log says what is awaited instead of warning."""
        self._kill_expected = str(source)

    def notify_endpoint_removed(self) -> None:
        """Report that the pod is gone from its EndpointSlice (no more new traffic)."""
        if self._endpoint_removed_at is None:
            self._endpoint_removed_at = self._now()
            logger.info("endpoint removed from its EndpointSlice")
            self._notify()

    # -------------------------------------------------------------------- waiting

    async def wait_for_phase(self, phase: Phase, *, timeout_s: float | None = None) -> bool:
        """Wait until the coordinator reaches ``phase`` (or a later one).

        Returns:
            ``True`` if it did, ``False`` if ``timeout_s`` elapsed first.
        """
        return await self._wait_until(lambda: self._phase >= phase, timeout_s)

    async def wait_drained(
        self,
        *,
        include_connections: bool = True,
        include_requests: bool = True,
        until_stopping: bool = True,
        timeout_s: float | None = None,
    ) -> bool:
        """Wait until no connection, request or session is left, in any phase.

        Args:
            include_connections: ``False`` ignores open connections (the preStop
                endpoint's own connection is still open while it waits).
            include_requests: ``False`` waits for sessions only (a stopping step
                letting websockets close before requests are cut).
            until_stopping: Also return once *stopping* began, since nothing drains
                after that.
            timeout_s: Give up after this long.

        Returns:
            ``True`` if drained, ``False`` if stopping began or ``timeout_s`` elapsed
            first.
        """

        def done() -> bool:
            if self._idle(include_connections, include_requests):
                return True
            return until_stopping and self._phase >= Phase.STOPPING

        await self._wait_until(done, timeout_s, zero=True)
        return self._idle(include_connections, include_requests)

    # ------------------------------------------------------------------------ run

    async def run(
        self,
        *,
        shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the shutdown machinery until ``STOPPED``.

        ``await task_group.start(coordinator.run)`` returns once signal handlers are in
        place.

        Args:
            shutdown_trigger: An awaitable factory; when it returns, shutdown is
                requested.  Without one, handlers for SIGTERM, SIGINT (request shutdown,
                escalate on repeat) and SIGQUIT (stop at once) are installed — only in
                the main thread — and the previous handlers restored on exit.  If a
                handler replaced was somebody's own (a server's: an app whose lifespan
                runs the coordinator under plain uvicorn), it then gets the first
                signal, so that the server stops once the coordinator did.
        """
        if self._running:
            raise RuntimeError("ShutdownCoordinator.run() is already running")
        self._running = True
        self._announce()
        if self._phase_since is None:
            self._phase_since = self._now()
        from ._signals import current_schedule

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
            self._running = False
            self._loop_thread = None

    def _announce(self) -> None:
        """The start-up line, once: the policy and where the kill deadline comes from.
        Without one configured or coming from a watcher, Kubernetes' default is planned
        for, which may be wrong for this platform: a warning then — not in a terminal's
        foreground (the dev loop), where a Ctrl-C drains at once."""
        if self._announced:
            return
        self._announced = True
        policy = self.policy.describe()
        if self._kill_at is not None:
            logger.info("policy %s; kill deadline: %s", policy, self._kill_source)
        elif self._kill_expected:
            logger.info("policy %s; kill deadline: %s, at SIGTERM", policy, self._kill_expected)
        elif self.grace_period_s is not None:
            logger.info("policy %s; kill deadline: grace period %g s", policy, self.grace_period_s)
        elif in_terminal_foreground():
            logger.info(
                "policy %s; kill deadline: none known (%g s assumed); Ctrl-C drains at once",
                policy,
                _deadlines.DEFAULT_GRACE_PERIOD_S,
            )
        else:
            logger.warning(
                "policy %s; no kill deadline known (set --grace-period or %s): assuming "
                "Kubernetes' default of %g s at shutdown (docker stop and Cloud Run give "
                "10 s, ECS 30 s, systemd 90 s)",
                policy,
                GRACE_PERIOD_ENV,
                _deadlines.DEFAULT_GRACE_PERIOD_S,
            )

    def _on_signal(self, signum: int) -> None:
        self.signal_received(signum)

    async def _await_trigger(self, trigger: Callable[[], Awaitable[object]]) -> None:
        await trigger()
        self.request_shutdown("shutdown trigger")

    async def _run_phases(self) -> None:
        await self._wait_until(lambda: self._phase > Phase.SERVING, None)
        with anyio.CancelScope() as background:
            async with anyio.create_task_group() as hooks:
                if self._phase is Phase.ACCEPTING:
                    hooks.start_soon(self._run_phase_hooks, Phase.ACCEPTING)
                    await self._accept()
                if self._phase is Phase.DRAINING:
                    hooks.start_soon(self._run_phase_hooks, Phase.DRAINING)
                    await self._drain()
                # Stopping has its own budget: hooks of earlier phases end here.
                background.cancel()
        d = self._deadlines
        assert d is not None
        now = self._now
        await run_hooks(
            self._stopping_steps, label="stopping step", timeout_s=None, deadline=d.exit_by, now=now
        )
        await run_hooks(
            list(reversed(self._hooks[Phase.STOPPING])),
            label="stopping hook",
            timeout_s=self.hook_timeout_s,
            deadline=d.exit_by,
            now=now,
        )
        self._advance(Phase.STOPPED, "shutdown complete")

    async def _run_phase_hooks(self, phase: Phase) -> None:
        d = self._deadlines
        await run_hooks(
            self._hooks[phase],
            label=f"{phase} hook",
            timeout_s=self.hook_timeout_s,
            deadline=None if d is None else d.stop_by,
            now=self._now,
        )

    async def _accept(self) -> None:
        assert self._requested_at is not None
        while self._phase is Phase.ACCEPTING:
            d = self._deadlines
            assert d is not None
            accept_deadline = self._accept_deadline(d)
            decision = self.policy.decide(
                PolicyInput(
                    now=self._now(),
                    requested_at=self._requested_at,
                    last_connection_at=self._last_activity_at,
                    accept_deadline=accept_deadline,
                    endpoint_removed_at=self._endpoint_removed_at,
                )
            )
            if decision.stop_accepting:
                self._advance(Phase.DRAINING, decision.reason)
                return
            timeout = None
            if decision.recheck_at is not None:
                timeout = max(0.0, decision.recheck_at - self._now())
            await self._wait_for_change(timeout)

    async def _drain(self) -> None:
        assert self._drain_deadline is not None
        next_log = self._now() + 1.0
        self._zero_waiters += 1
        try:
            while self._phase is Phase.DRAINING:
                now = self._now()
                if self.drained:
                    self._advance(Phase.STOPPING, "drained")
                    return
                if now >= self._drain_deadline:
                    self._advance(
                        Phase.STOPPING, f"drain deadline reached with {self._counts()} left"
                    )
                    return
                if now >= next_log:
                    logger.info(
                        "draining: %s, %.1f s left", self._counts(), self.drain_time_left() or 0.0
                    )
                    next_log = now + 1.0
                await self._wait_for_change(min(next_log, self._drain_deadline) - now)
        finally:
            self._zero_waiters -= 1

    # ------------------------------------------------------------------- internals

    def _accept_deadline(self, d: Deadlines) -> float:
        """``accept_by`` with the drain budget measured now (requests keep being timed
        while accepting, so the estimate follows the traffic)."""
        assert self._requested_at is not None
        return _deadlines.accept_by(
            requested_at=self._requested_at,
            stop_by=d.stop_by,
            drain_timeout_s=self.drain_timeout_s,
            longest_request_s=self.longest_request_s(),
        )

    def _plan(self, requested_at: float) -> None:
        d = _deadlines.plan(
            requested_at=requested_at,
            grace_period_s=self.grace_period_s,
            kill_at=self._kill_at,
            kill_source=self._kill_source,
            drain_timeout_s=self.drain_timeout_s,
            kill_margin_s=self.kill_margin_s,
            longest_request_s=self.longest_request_s(),
        )
        first = self._deadlines is None
        self._deadlines = d
        now = self._now()
        if first and d.assumed and self._kill_expected is not None:
            logger.info(
                "kill deadline: waiting for %s; %g s assumed until then",
                self._kill_expected,
                _deadlines.DEFAULT_GRACE_PERIOD_S,
            )
        if not first:
            logger.info("kill deadline from %s: SIGKILL in %.1f s", d.kill_source, d.kill - now)
        if self._drain_deadline is not None:
            self._drain_deadline = min(self._drain_deadline, d.stop_by)
        if self.hard_exit:
            # Half the exit margin after exit_by: stopping's own timeouts (at exit_by)
            # report what they abandoned first, and SIGKILL is still a margin away.
            self._arm_watchdog(d.exit_by + _deadlines.exit_margin(self.kill_margin_s) / 2 - now)

    def _arm_watchdog(self, delay_s: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        # A year is "never" here, and stays below what the platform's timers accept.
        timer = threading.Timer(min(max(0.0, delay_s), _YEAR_S), self._hard_exit)
        timer.daemon = True
        timer.name = "graceful-hard-exit"
        timer.start()
        self._watchdog = timer

    def _counts(self, *, sessions: bool = False) -> str:
        """``"1 connection, 2 requests"``, with the sessions when there are any."""
        parts = [_counted(self._connections, "connection"), _counted(self._requests, "request")]
        if sessions or self._sessions:
            parts.append(_counted(len(self._sessions), "session"))
        return ", ".join(parts)

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
            self._phase,
            self._counts(sessions=True),
            f" and threads {', '.join(threads)}" if threads else "",
        )
        _flush_and_exit(0 if self._phase is Phase.STOPPED else 1)

    def exit_soon(self, within_s: float = 1.0) -> None:
        """For programs that own the process, after ``STOPPED``: if the interpreter's
        own teardown (``asyncio.run`` waiting for tasks that ignore cancellation, the
        default executor's threads) is not done within ``within_s`` (and before the
        exit deadline), end it with status 0.  Needs ``hard_exit``."""
        if not self.hard_exit:
            return
        d = self._deadlines
        delay = within_s if d is None else self.time_left_s(d.exit_by, at_most_s=within_s)
        self._arm_watchdog(delay)

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
        phase, reason = step.phase, step.reason
        now = self._now()
        previous = self._phase
        self._phase, self._phase_since, self._reason = phase, now, reason
        if phase >= Phase.DRAINING and not self._draining:
            self._draining = True
            self._draining_at = now
            d = self._deadlines
            assert d is not None
            self._drain_deadline = _deadlines.drain_by(
                draining_at=now, drain_timeout_s=self.drain_timeout_s, stop_by=d.stop_by
            )
        if phase is Phase.STOPPING:
            self._cut_at_stopping = self._requests + len(self._sessions)
            if self._draining_at is not None and previous is Phase.DRAINING:
                self._drain_duration = now - self._draining_at
        self._nudging = phase >= Phase.DRAINING or (
            phase is Phase.ACCEPTING and self.policy.nudge_clients
        )
        # Adapters act first (the listener is closed when 'draining' is logged).
        for listener in list(self._listeners):
            try:
                listener(phase)
            except Exception:
                logger.exception("phase listener %r failed", listener)
        extra = ""
        if phase is Phase.ACCEPTING and self._deadlines is not None:
            d = self._deadlines
            longest = self.longest_request_s()
            measured = "" if longest is None else f", longest recent request {longest:.3g} s"
            extra = (
                f"; SIGKILL expected in {d.kill - now:.1f} s ({d.kill_source}): accepting at"
                f" most {d.accept_by - now:.1f} s, then {d.stop_by - d.accept_by:.1f} s to"
                f" drain{measured}"
            )
        elif phase is Phase.DRAINING:
            extra = f"; {self.drain_time_left():.1f} s to drain"
        logger.info("%s -> %s: %s (%s%s)", previous, phase, reason, self._counts(), extra)
        if phase is Phase.DRAINING or (phase is Phase.STOPPING and previous < Phase.DRAINING):
            for session in list(self._sessions):
                session._request_drain()
        if phase is Phase.STOPPED and self._watchdog is not None:
            # Done: the interpreter's teardown (tasks that ignore cancellation, executor
            # threads) gets what is left of the budget, at most a second.
            self.exit_soon()
        self._notify()

    async def _wait_for_change(self, timeout_s: float | None) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        event = self._changed
        with anyio.move_on_after(math.inf if timeout_s is None else timeout_s):
            await event.wait()

    async def _wait_until(
        self, condition: Callable[[], bool], timeout_s: float | None, *, zero: bool = False
    ) -> bool:
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
        if zero:
            self._zero_waiters += 1
        try:
            with anyio.move_on_after(math.inf if timeout_s is None else timeout_s):
                while not condition():
                    await self._wait_for_change(None)
                return True
            return condition()
        finally:
            if zero:
                self._zero_waiters -= 1


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
