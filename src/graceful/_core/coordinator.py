"""The shutdown coordinator: one per process, the single source of truth for the phase.

How the pieces fit
------------------
Adapters (the uvicorn server, the ASGI middleware, the asyncio server, …) *report* to the
coordinator through the adapter API — a connection handed over by the kernel or closed, a
request started or finished, a session began, activity seen — and *obey* it: they
subscribe to phase changes, close their listener at ``DRAINING`` and register *stopping
steps* that cut what is left.  The coordinator is assembled from small parts of
``graceful._core``, each with its own essay:

* ``tracking`` (and ``sessions``) — the counters and ``graceful.Session``, the hot path;
* ``phases`` — the pure phase/escalation table; ``deadlines`` — the deadline arithmetic;
* ``hooks`` — running user code bounded; ``signals`` — one signal helper for everything;
* ``engine`` (built on ``machine`` and ``timetable``) — the machinery that runs the
  phases: the ``run`` task, queued phase changes, deadlines, stopping, waiting, the
  hard-exit watchdog, the ``statistics`` snapshot;
* ``checks`` — the checks of the arguments, each error naming the argument;
* this module — the facade that ties them together.

The facade hands every long body to its ``PhaseEngine``, so each of its methods is a
few lines (the module is not short: the public API's docstrings are most of it); the
start-up line, which states the configuration, stays here.  The hot path is not delegated:
``connection_opened``, ``request_started`` and the rest are ``Tracking``'s own methods,
inherited, so a request costs no extra call for the split.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Collection
from typing import Final

import anyio
import anyio.abc
from typing_extensions import final

from . import deadlines as _deadlines
from . import logging as _logging
from .checkers import HealthCheckers
from .checks import GRACE_PERIOD_ENV as GRACE_PERIOD_ENV
from .checks import _check_callable, _check_kill_margin, _check_phase, _check_policy, _grace_period
from .checks import _check_signals as _check_signals  # the adapters import it from here
from .deadlines import Deadlines
from .engine import Background, PhaseEngine
from .hooks import Hook
from .machine import DUPLICATE_WINDOW_S as DUPLICATE_WINDOW_S  # the tests import it from here
from .machine import PhaseListener
from .policy import Phase, Policy, _check_bool, _check_seconds
from .sessions import Session
from .signals import QUICK_SIGNALS, in_terminal_foreground
from .statistics import ShutdownStatistics
from .tracking import Tracking

__all__ = ("GRACE_PERIOD_ENV", "Session", "ShutdownCoordinator", "ShutdownStatistics")

logger: Final = logging.getLogger("graceful")


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
            is still alive then (see ``graceful._core.timetable``); for programs that own the
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
        self.policy: Final = _check_policy(policy)
        self.drain_timeout_s: Final = _check_seconds("drain_timeout_s", drain_timeout_s)
        self.grace_period_s: Final = _grace_period(grace_period_s)
        self.kill_margin_s: Final = _check_kill_margin(kill_margin_s, self.grace_period_s)
        self.hook_timeout_s: Final = _check_seconds("hook_timeout_s", hook_timeout_s)
        self.exit_on_third_request: Final = _check_bool(
            "exit_on_third_request", exit_on_third_request
        )
        self.hard_exit: Final = _check_bool("hard_exit", hard_exit)
        self._engine: Final = PhaseEngine(self)
        self._announced = False
        self._pod_serving: Callable[[], bool] | None = None  # see report_pod_serving

    # ------------------------------------------------------------------ reading

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self._engine.phase

    @property
    def accepting(self) -> bool:
        """``True`` while new connections should be accepted (serving or accepting)."""
        return self._engine.phase <= Phase.ACCEPTING

    @property
    def cutting(self) -> bool:
        """``True`` once stopping began: work still running is being cut."""
        return self._engine.phase >= Phase.STOPPING

    @property
    def shutdown_requested(self) -> bool:
        """``True`` once shutdown was requested."""
        return self._engine.phase > Phase.SERVING

    @property
    def running(self) -> bool:
        """``True`` while ``run`` runs: something will carry out a shutdown request
        (a graceful server, or the application's own ``run()``)."""
        return self._engine.running

    @property
    def deadlines(self) -> Deadlines | None:
        """The deadlines of the shutdown under way (``None`` before the request)."""
        return self._engine.deadlines

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
        drain_deadline = self._engine.drain_deadline
        if drain_deadline is None:
            return None
        return max(0.0, drain_deadline - self._now())

    def statistics(self) -> ShutdownStatistics:
        """Return a frozen snapshot of the phase, the counts and the deadlines."""
        return self._engine.statistics()

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
        return self._engine.subscribe(_check_callable("listener", listener))

    def add_stopping_step(self, step: Hook) -> None:
        """For adapters: run ``step`` when stopping begins, before any user hook.

        Steps cut what is left (cancel requests, close connections, run the ASGI
        lifespan shutdown); they run in registration order and share stopping's budget
        (each bounded by ``exit_by``, see ``deadlines``).
        """
        self._engine.add_stopping_step(step)

    def start_background(self, task: Background) -> None:
        """Run ``task()`` in the coordinator's task group while ``run`` runs.

        For watchers that report to the coordinator (the Kubernetes endpoint watcher):
        started when ``run`` starts (or at once if it already runs), cancelled when the
        coordinator reaches ``STOPPED``.
        """
        self._engine.start_background(task)

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
        self._engine.add_hook(hook, phase)

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
        self._engine.request_shutdown(
            reason, escalate=escalate, immediate=immediate, drain_now=drain_now
        )

    def signal_received(self, signum: int, *, quick: Collection[int] = QUICK_SIGNALS) -> None:
        """Request shutdown for a signal an adapter caught (from the event-loop thread or
        any other, as ``request_shutdown``).

        ``quick`` signals stop at once.  A SIGINT while this process is in the
        foreground of its terminal is somebody's Ctrl-C: no load balancer routes to a
        terminal, so it drains at once (as stock servers do) instead of following the
        policy; a second Ctrl-C still cuts what is left.
        """
        self._engine.signal_received(signum, quick)

    def report_pod_serving(self, check: Callable[[], bool]) -> None:
        """Let readiness stay 200 after the shutdown request while ``check()`` says the
        pod still serves through other processes.

        Readiness is the pod's, not one process's: a gunicorn worker replaced in a
        ``HUP`` reload, a ``TTOU`` or a ``max_requests`` recycle shuts down while its
        master and siblings keep serving, and a probe answered 503 then takes the pod
        out of rotation for nothing.  ``check`` runs at each readiness probe (on the
        event loop: it must be quick); an exception counts as "not serving".
        """
        self._pod_serving = _check_callable("check", check)

    def pod_still_serving(self) -> bool:
        """Whether the check given to ``report_pod_serving`` says the pod still serves
        (``False`` without one)."""
        check = self._pod_serving
        if check is None:
            return False
        try:
            return bool(check())
        except Exception:
            return False

    def expect_relayed_signals(self, *signums: int) -> None:
        """Take a repeat of each of ``signums`` for a relay of the first, never for an
        escalation, however late it comes.

        For a process whose parent relays signals: gunicorn's master sends its workers
        the SIGTERM a process group already delivered to them, seconds later on a loaded
        machine; gunicorn's quick shutdown is SIGINT or SIGQUIT (``quick``) and its
        master owns SIGKILL.  Elsewhere a second SIGTERM within 0.3 s is taken for the
        same event, a later one escalates.

        Raises:
            ValueError: if a signal number is not a valid signal.
        """
        _check_signals("expect_relayed_signals", signums)
        self._engine.relayed = self._engine.relayed | frozenset(signums)

    def set_kill_deadline(self, wall_clock_s: float, *, source: str) -> None:
        """Set the kill deadline to an absolute wall-clock time (``time.time()`` seconds).

        Kubernetes knows it: the pod's ``deletionTimestamp``.  It replaces the grace
        period; called after shutdown was requested, the deadlines are re-planned.
        """
        self._engine.set_kill_deadline(_check_seconds("wall_clock_s", wall_clock_s), source)

    def expect_kill_deadline(self, source: str) -> None:
        """Announce that a watcher will report the kill deadline (``set_kill_deadline``)
        shortly after the shutdown request, from ``source`` (``"the pod's
        deletionTimestamp"``): with no grace period configured, the default is still
        assumed until it arrives, but the log says what is awaited instead of warning."""
        self._engine.kill_expected = str(source)

    def notify_endpoint_removed(self, *, seconds_ago: float = 0.0) -> None:
        """Report that the pod is gone from its EndpointSlice (no more new traffic),
        now or ``seconds_ago`` (the idle window counts from then)."""
        self._engine.notify_endpoint_removed(_check_seconds("seconds_ago", seconds_ago))

    @property
    def health_checkers(self) -> HealthCheckers:
        """The readiness probes seen per checker (``graceful._core.checkers``): the
        health endpoints report each answer, the Kubernetes integration declares the
        kubelet's probe."""
        return self._engine.checkers

    # -------------------------------------------------------------------- waiting

    async def wait_for_phase(self, phase: Phase, *, timeout_s: float | None = None) -> bool:
        """Wait until the coordinator reaches ``phase`` (or a later one).

        Returns:
            ``True`` if it did, ``False`` if ``timeout_s`` elapsed first.
        """
        _check_phase(phase)
        return await self._engine.wait_until(lambda: self._engine.phase >= phase, timeout_s)

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
        return await self._engine.wait_drained(
            include_connections, include_requests, until_stopping, timeout_s
        )

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
        if shutdown_trigger is not None:
            _check_callable("shutdown_trigger", shutdown_trigger)
        else:
            # Run by the application itself (its lifespan, under plain uvicorn): no
            # graceful server set up logging, so write through the server's handlers.
            _logging.through_server()
        if not self._announced:  # once; a second run() while one runs raises below
            self._announced = True
            _announce(self.policy, self.grace_period_s, self._engine)
        await self._engine.run(shutdown_trigger, task_status)

    def exit_soon(self, within_s: float = 1.0) -> None:
        """For programs that own the process, after ``STOPPED``: if the interpreter's
        own teardown (``asyncio.run`` waiting for tasks that ignore cancellation, the
        default executor's threads) is not done within ``within_s`` (and before the
        exit deadline), end it with status 0.  Needs ``hard_exit``."""
        self._engine.exit_soon(_check_seconds("within_s", within_s))


def _check_coordinator(coordinator: object) -> ShutdownCoordinator:
    """``coordinator`` if it is a ``ShutdownCoordinator``, else a ``TypeError`` naming it."""
    if not isinstance(coordinator, ShutdownCoordinator):
        raise TypeError(
            "coordinator must be a graceful.ShutdownCoordinator, got "
            f"{type(coordinator).__name__} {coordinator!r}"
        )
    return coordinator


def _announce(policy: Policy, grace_period_s: float | None, engine: PhaseEngine) -> None:
    """The start-up line: the policy and where the kill deadline comes from.  Without one
    configured or coming from a watcher, Kubernetes' default is planned for, which may be
    wrong for this platform: a warning then — not in a terminal's foreground (the dev
    loop), where a Ctrl-C drains at once."""
    described = policy.describe()
    if engine.kill_at is not None:
        logger.info("policy %s; kill deadline: %s", described, engine.kill_source)
    elif engine.kill_expected:
        logger.info("policy %s; kill deadline: %s, at SIGTERM", described, engine.kill_expected)
    elif grace_period_s is not None:
        logger.info("policy %s; kill deadline: grace period %g s", described, grace_period_s)
    elif in_terminal_foreground():
        logger.info(
            "policy %s; kill deadline: none known (%g s assumed); Ctrl-C drains at once",
            described,
            _deadlines.DEFAULT_GRACE_PERIOD_S,
        )
    else:
        logger.warning(
            "policy %s; no kill deadline known (set --grace-period, grace_period_s= or %s): "
            "assuming Kubernetes' default of %g s at shutdown (docker stop and Cloud Run give "
            "10 s, ECS 30 s, systemd 90 s)",
            described,
            GRACE_PERIOD_ENV,
            _deadlines.DEFAULT_GRACE_PERIOD_S,
        )
