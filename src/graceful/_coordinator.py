"""The shutdown coordinator: one per process, the single source of truth for the phase.

How the pieces fit
------------------
Adapters (the uvicorn server, the ASGI middleware, the asyncio server, …) *report* to the
coordinator — a connection opened or closed, a request started or finished, a websocket
session began — and *obey* it: they subscribe to phase changes and close their listener
at ``DRAINING``, cancel what is left at ``STOPPING``.  Reporting is the hot path, so it is
plain attribute arithmetic on the event-loop thread: no locks, no tasks, no clock read per
request (connections do read the clock: their arrival is what *accept until idle*
watches).  Everything slow — deciding, waiting, logging, running hooks — happens in
:meth:`ShutdownCoordinator.run`, one task.

Phase changes are synchronous (``request_shutdown`` flips the phase at once, so a
readiness probe fails in the same tick), and subscribers are called synchronously in
registration order; they must not block.  ``run`` notices the change and does the timed
part: it asks the policy when accepting ends, waits for the drain with a deadline, logs a
progress line every second, runs the user's hooks, and finally reaches ``STOPPED``.

Deadlines
---------
With a known grace period (``grace_period_s`` or ``GRACEFUL_GRACE_PERIOD``) the kill
deadline is ``requested_at + grace_period_s``.  Stopping begins ``kill_margin_s`` before
it (``stop_by``), always.  Draining is given ``drain_timeout_s`` but at most half of the
time between the request and ``stop_by``; accepting ends early enough to leave that much.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Final

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
from typing_extensions import final

from ._policy import (
    AcceptUntilIdle,
    Phase,
    Policy,
    PolicyInput,
    _check_optional_seconds,
    _check_seconds,
)

__all__ = ("GRACE_PERIOD_ENV", "ShutdownCoordinator", "ShutdownStatistics")

logger: Final = logging.getLogger("graceful")

#: Environment variable holding the grace period (seconds before SIGKILL).
GRACE_PERIOD_ENV: Final = "GRACEFUL_GRACE_PERIOD"

Hook = Callable[[], Awaitable[object] | object]
PhaseListener = Callable[[Phase], None]


@final
@dataclass(frozen=True, slots=True)
class ShutdownStatistics:
    """A snapshot of a coordinator, from :meth:`ShutdownCoordinator.statistics`.

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
            end the deadlines allow; draining: the drain deadline; stopping: the kill
            deadline), or ``None`` if it has none.
        kill_deadline_in_s: Seconds until the expected SIGKILL, or ``None`` if unknown.
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


@final
class _RequestTracker:
    """The reusable context manager behind :meth:`ShutdownCoordinator.track_request`.

    One instance per coordinator: entering and leaving only touch two integers, so
    tracking a request costs no allocation.
    """

    __slots__ = ("_c",)

    def __init__(self, coordinator: ShutdownCoordinator) -> None:
        self._c = coordinator

    def __enter__(self) -> None:
        c = self._c
        c._requests += 1
        c._requests_total += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        c = self._c
        c._requests -= 1
        if c._draining and not c._requests:
            c._check_drained()


@final
class Session:
    """A long-lived session (websocket, streaming response) registered with a coordinator.

    Returned by :meth:`ShutdownCoordinator.track_session`; use it as a context manager
    around the session.  ``on_drain`` is called once when draining begins (or at once if
    it already has) so the session can finish its current message and end.
    """

    __slots__ = ("_c", "_on_drain", "drain_requested")

    def __init__(self, coordinator: ShutdownCoordinator, on_drain: Callable[[], None] | None):
        self._c = coordinator
        self._on_drain = on_drain
        #: ``True`` once the coordinator asked this session to end.
        self.drain_requested = False

    def __enter__(self) -> Session:
        c = self._c
        c._sessions.add(self)
        if c._draining:
            self._request_drain()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        c = self._c
        c._sessions.discard(self)
        if c._draining:
            c._check_drained()

    def _request_drain(self) -> None:
        if self.drain_requested:
            return
        self.drain_requested = True
        if self._on_drain is not None:
            try:
                self._on_drain()
            except Exception:
                logger.exception("session drain callback %r failed", self._on_drain)


@final
class ShutdownCoordinator:
    """Tracks connections, requests and sessions and runs a shutdown policy.

    Create one per process, hand it to the adapters (:mod:`graceful.asgi`,
    :mod:`graceful.uvicorn`, :mod:`graceful.asyncio`, …) and run :meth:`run` in a task.
    All methods must be called from the event loop thread.

    Args:
        policy: When accepting ends; defaults to :class:`AcceptUntilIdle`.
        drain_timeout_s: The longest time spent draining before remaining work is
            cancelled.
        grace_period_s: Seconds from the shutdown request to the expected SIGKILL (the
            pod's ``terminationGracePeriodSeconds``, gunicorn's ``graceful_timeout``);
            ``None`` reads ``GRACEFUL_GRACE_PERIOD`` and, if unset, assumes no kill
            deadline.
        kill_margin_s: Stopping begins at least this long before the kill deadline.
        hook_timeout_s: The longest time one shutdown hook may run.
        exit_on_third_request: A third shutdown request (e.g. a third Ctrl-C) exits the
            process at once with status 1.
    """

    def __init__(
        self,
        *,
        policy: Policy | None = None,
        drain_timeout_s: float = 30.0,
        grace_period_s: float | None = None,
        kill_margin_s: float = 1.0,
        hook_timeout_s: float = 5.0,
        exit_on_third_request: bool = True,
    ) -> None:
        if policy is None:
            policy = AcceptUntilIdle()
        elif not isinstance(policy, Policy):
            raise ValueError(f"policy must be a graceful Policy instance, got {policy!r}")
        self.policy: Final = policy
        self.drain_timeout_s: Final = _check_seconds("drain_timeout_s", drain_timeout_s)
        if grace_period_s is None:
            env = os.environ.get(GRACE_PERIOD_ENV, "").strip()
            if env:
                try:
                    grace_period_s = float(env)
                except ValueError:
                    raise ValueError(
                        f"{GRACE_PERIOD_ENV} must be a finite number of seconds > 0, got {env!r}"
                    ) from None
                _check_seconds(GRACE_PERIOD_ENV, grace_period_s)
        self.grace_period_s: Final = _check_optional_seconds("grace_period_s", grace_period_s)
        self.kill_margin_s: Final = _check_seconds("kill_margin_s", kill_margin_s)
        if self.grace_period_s is not None and self.kill_margin_s >= self.grace_period_s:
            raise ValueError(
                f"kill_margin_s ({self.kill_margin_s:g}) must be less than grace_period_s "
                f"({self.grace_period_s:g})"
            )
        self.hook_timeout_s: Final = _check_seconds("hook_timeout_s", hook_timeout_s)
        self.exit_on_third_request: Final = exit_on_third_request

        self._phase = Phase.SERVING
        self._phase_since: float | None = None
        self._reason: str | None = None
        self._draining = False  # phase >= DRAINING, read on the hot path
        self._nudging = False  # clients should be told to close their connection
        self._requests = 0
        self._requests_total = 0
        self._connections = 0
        self._connections_total = 0
        self._sessions: set[Session] = set()
        self._last_connection_at: float | None = None
        self._requested_at: float | None = None
        self._shutdown_requests = 0
        self._endpoint_removed_at: float | None = None
        self._drain_deadline: float | None = None
        self._listeners: list[PhaseListener] = []
        self._hooks: dict[Phase, list[Hook]] = {
            Phase.ACCEPTING: [],
            Phase.DRAINING: [],
            Phase.STOPPING: [],
        }
        self._cleanups: list[Hook] = []  # adapters' STOPPING work, before user hooks
        self._changed: anyio.Event | None = None
        self._running = False
        self._request_tracker = _RequestTracker(self)
        self._clock: Callable[[], float] | None = None

    def _now(self) -> float:
        """The event loop's clock, looked up once (protocol callbacks run outside any
        task, where anyio cannot tell which backend is running)."""
        clock = self._clock
        if clock is None:
            try:
                clock = anyio.lowlevel.current_token().backend_class.current_time
            except anyio.NoEventLoopError:
                clock = asyncio.get_running_loop().time  # an asyncio protocol callback
            self._clock = clock
        return clock()

    # ------------------------------------------------------------------ hot path

    def track_request(self) -> _RequestTracker:
        """Return a context manager that counts one in-flight request.

        ``with coordinator.track_request(): ...`` costs two integer updates; the object
        returned is shared, so it needs no allocation.
        """
        return self._request_tracker

    def track_session(self, on_drain: Callable[[], None] | None = None) -> Session:
        """Return a context manager that counts a long-lived session (websocket, stream).

        Args:
            on_drain: Called once, synchronously, when draining begins (at once if it
                already has); it should make the session finish and close, e.g. send a
                websocket close frame with code 1001.
        """
        return Session(self, on_drain)

    def connection_opened(self) -> None:
        """Report a new connection; it counts as activity for *accept until idle*."""
        self._connections += 1
        self._connections_total += 1
        self._last_connection_at = self._now()

    def connection_closed(self) -> None:
        """Report that a connection reported by :meth:`connection_opened` closed."""
        self._connections -= 1
        if self._draining and not self._connections:
            self._check_drained()

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self._phase

    @property
    def accepting(self) -> bool:
        """``True`` while new connections should be accepted (serving or accepting)."""
        return self._phase <= Phase.ACCEPTING

    @property
    def draining(self) -> bool:
        """``True`` from the moment draining begins (including stopping and stopped)."""
        return self._draining

    @property
    def nudging(self) -> bool:
        """``True`` while responses should tell clients to close their connection."""
        return self._nudging

    @property
    def drained(self) -> bool:
        """``True`` when no connection, request or session is left."""
        return not (self._connections or self._requests or self._sessions)

    @property
    def shutdown_requested(self) -> bool:
        """``True`` once shutdown was requested."""
        return self._phase > Phase.SERVING

    # ---------------------------------------------------------------- configuration

    def subscribe(self, listener: PhaseListener) -> Callable[[], None]:
        """Call ``listener(phase)`` synchronously at every phase change.

        Adapters use this to obey the coordinator (close the listener at ``DRAINING``,
        cancel work at ``STOPPING``).  Listeners run in registration order and must not
        block; an exception is logged and does not stop the others.

        Returns:
            A function that unsubscribes the listener.
        """
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def add_hook(self, hook: Hook, *, phase: Phase = Phase.STOPPING) -> None:
        """Run ``hook`` when the coordinator enters ``phase``.

        Order: ``ACCEPTING`` and ``DRAINING`` hooks run in registration order, in the
        background, as their phase begins; ``STOPPING`` hooks run in reverse registration
        order (like :class:`contextlib.ExitStack`) before the coordinator reports
        ``STOPPED``, after the adapters' own cleanup (cancelling what is left, the ASGI
        lifespan shutdown).  A phase that is skipped by an escalation skips its hooks;
        ``STOPPING`` hooks always run.  Each hook gets at most ``hook_timeout_s`` and never
        runs past the kill deadline; one that raises or times out is logged and the rest
        still run.  Async hooks run on the event loop; synchronous ones in a worker
        thread, so that a hanging one can be abandoned.

        Raises:
            ValueError: if ``phase`` is not ACCEPTING, DRAINING or STOPPING.
        """
        if phase not in self._hooks:
            raise ValueError(
                f"phase must be Phase.ACCEPTING, Phase.DRAINING or Phase.STOPPING, got {phase!r}"
            )
        if not callable(hook):
            raise ValueError(f"hook must be callable, got {hook!r}")
        self._hooks[phase].append(hook)

    def _add_cleanup(self, hook: Hook) -> None:
        """For adapters: run ``hook`` at STOPPING before any user hook (cancel what is
        left, run the app's lifespan shutdown).  Bounded like a hook."""
        self._cleanups.append(hook)

    # ------------------------------------------------------------------- triggers

    def request_shutdown(
        self,
        reason: str = "requested",
        *,
        escalate: bool = True,
        immediate: bool = False,
        drain_now: bool = False,
    ) -> None:
        """Ask for shutdown; the phase changes before this returns.

        The first request starts *accepting*.  A second one (with ``escalate``) goes
        straight to *stopping*; a third exits the process at once (see
        ``exit_on_third_request``).

        Args:
            reason: Why, for the log (``"SIGTERM"``, ``"preStop"``, …).
            escalate: Count this request towards escalation.  The preStop endpoint
                passes ``False``: asking twice for the same shutdown is not a hurry.
            immediate: Go to *stopping* at once (SIGQUIT, gunicorn's quick shutdown).
            drain_now: Skip *accepting* and drain at once, whatever the policy (a
                worker recycled after ``max_requests`` while its siblings keep serving).
        """
        now = self._now()
        if self._requested_at is None:
            self._requested_at = now
        if escalate or self._shutdown_requests == 0:
            self._shutdown_requests += 1
        count = self._shutdown_requests
        if immediate or (escalate and count == 2):
            if self._phase < Phase.STOPPING:
                self._advance(Phase.STOPPING, f"{reason} (escalated)")
            elif count >= 2:
                logger.info("shutdown already %s; ignoring %s", self._phase, reason)
        elif escalate and count >= 3:
            if self.exit_on_third_request and self._phase < Phase.STOPPED:
                logger.warning("%s: third shutdown request, exiting immediately", reason)
                logging.shutdown()
                os._exit(1)
        elif self._phase is Phase.SERVING:
            self._advance(Phase.ACCEPTING, reason)
            if drain_now:
                self._advance(Phase.DRAINING, f"{reason} (no accepting period)")

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
        self, *, include_connections: bool = True, timeout_s: float | None = None
    ) -> bool:
        """Wait until no connection, request or session is left.

        Also returns once *stopping* began, since nothing drains after that.

        Args:
            include_connections: ``False`` waits for requests and sessions only (the
                preStop endpoint's own connection is still open while it waits).
            timeout_s: Give up after this long.

        Returns:
            ``True`` if drained, ``False`` if stopping began or ``timeout_s`` elapsed
            first.
        """

        def drained() -> bool:
            if self._requests or self._sessions:
                return False
            return not (include_connections and self._connections)

        await self._wait_until(lambda: drained() or self._phase >= Phase.STOPPING, timeout_s)
        return drained()

    def drain_time_left(self) -> float | None:
        """Seconds until the drain deadline, once draining; ``None`` before, or if
        there is no deadline.  Streaming handlers use it to finish in time."""
        if self._drain_deadline is None:
            return None
        return max(0.0, self._drain_deadline - self._now())

    def statistics(self) -> ShutdownStatistics:
        """Return a frozen snapshot of the phase, the counts and the deadlines."""
        now = self._now()
        kill = self._kill_deadline()
        if self._phase is Phase.ACCEPTING:
            deadline = self._accept_deadline()
            max_wait = getattr(self.policy, "max_wait_s", None)
            if max_wait is not None and self._requested_at is not None:
                end = self._requested_at + max_wait
                deadline = end if deadline is None else min(deadline, end)
        elif self._phase is Phase.DRAINING:
            deadline = self._drain_deadline
        elif self._phase is Phase.STOPPING:
            deadline = kill
        else:
            deadline = None
        return ShutdownStatistics(
            phase=self._phase,
            reason=self._reason,
            connections=self._connections,
            requests=self._requests,
            sessions=len(self._sessions),
            connections_total=self._connections_total,
            requests_total=self._requests_total,
            time_in_phase_s=0.0 if self._phase_since is None else now - self._phase_since,
            time_left_s=None if deadline is None else max(0.0, deadline - now),
            kill_deadline_in_s=None if kill is None else kill - now,
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
                the main thread — and the previous handlers restored on exit.
        """
        if self._running:
            raise RuntimeError("ShutdownCoordinator.run() is already running")
        self._running = True
        if self._phase_since is None:
            self._phase_since = self._now()
        from ._signals import handle_signals

        try:
            async with anyio.create_task_group() as tg:
                if shutdown_trigger is not None:
                    tg.start_soon(self._await_trigger, shutdown_trigger)
                else:
                    await tg.start(handle_signals, self)
                task_status.started()
                await self._run_phases(tg)
                tg.cancel_scope.cancel()
        finally:
            self._running = False

    async def _await_trigger(self, trigger: Callable[[], Awaitable[object]]) -> None:
        await trigger()
        self.request_shutdown("shutdown trigger")

    async def _run_phases(self, tg: anyio.abc.TaskGroup) -> None:
        await self._wait_until(lambda: self._phase > Phase.SERVING, None)
        background: list[anyio.Event] = []
        if self._phase is Phase.ACCEPTING:
            background.append(self._start_hooks(tg, Phase.ACCEPTING))
            await self._accept()
        if self._phase is Phase.DRAINING:
            background.append(self._start_hooks(tg, Phase.DRAINING))
            await self._drain()
        for done in background:  # each hook is bounded, so this wait is too
            await done.wait()
        await self._run_hooks(Phase.STOPPING)
        self._advance(Phase.STOPPED, "shutdown complete")

    def _start_hooks(self, tg: anyio.abc.TaskGroup, phase: Phase) -> anyio.Event:
        done = anyio.Event()

        async def run() -> None:
            try:
                await self._run_hooks(phase)
            finally:
                done.set()

        tg.start_soon(run)
        return done

    async def _accept(self) -> None:
        assert self._requested_at is not None
        while self._phase is Phase.ACCEPTING:
            decision = self.policy.decide(
                PolicyInput(
                    now=self._now(),
                    requested_at=self._requested_at,
                    last_connection_at=self._last_connection_at,
                    accept_deadline=self._accept_deadline(),
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
        while self._phase is Phase.DRAINING:
            now = self._now()
            if self.drained:
                self._advance(Phase.STOPPING, "drained")
                return
            if now >= self._drain_deadline:
                s = self.statistics()
                self._advance(
                    Phase.STOPPING,
                    f"drain deadline reached with {s.connections} connections, "
                    f"{s.requests} requests and {s.sessions} sessions left",
                )
                return
            if now >= next_log:
                s = self.statistics()
                logger.info(
                    "draining: %d connections, %d requests in flight, %d sessions, %.1f s left",
                    s.connections,
                    s.requests,
                    s.sessions,
                    s.time_left_s or 0.0,
                )
                next_log = now + 1.0
            await self._wait_for_change(min(next_log, self._drain_deadline) - now)

    async def _run_hooks(self, phase: Phase) -> None:
        hooks = self._hooks[phase]
        if phase is Phase.STOPPING:
            hooks = [*self._cleanups, *reversed(hooks)]
        for hook in list(hooks):
            timeout = self.hook_timeout_s
            kill = self._kill_deadline()
            if kill is not None:
                timeout = max(0.0, min(timeout, kill - self._now() - 0.1))
            name = getattr(hook, "__qualname__", repr(hook))
            try:
                with anyio.move_on_after(timeout) as scope:
                    if inspect.iscoroutinefunction(hook):
                        await hook()
                    else:
                        result = await anyio.to_thread.run_sync(hook, abandon_on_cancel=True)
                        if inspect.isawaitable(result):
                            await result
                if scope.cancelled_caught:
                    logger.error("%s hook %s timed out after %.3g s", phase, name, timeout)
            except Exception:
                logger.exception("%s hook %s failed", phase, name)

    # ------------------------------------------------------------------- internals

    def _kill_deadline(self) -> float | None:
        if self.grace_period_s is None or self._requested_at is None:
            return None
        return self._requested_at + self.grace_period_s

    def _stop_by(self) -> float | None:
        kill = self._kill_deadline()
        return None if kill is None else kill - self.kill_margin_s

    def _accept_deadline(self) -> float | None:
        stop_by = self._stop_by()
        if stop_by is None or self._requested_at is None:
            return None
        budget = max(0.0, stop_by - self._requested_at)
        return stop_by - min(self.drain_timeout_s, budget / 2)

    def _advance(self, phase: Phase, reason: str) -> None:
        if phase <= self._phase:
            return
        now = self._now()
        previous, self._phase, self._phase_since, self._reason = (
            self._phase,
            phase,
            now,
            reason,
        )
        if phase >= Phase.DRAINING and not self._draining:
            self._draining = True
            deadline = now + self.drain_timeout_s
            stop_by = self._stop_by()
            if stop_by is not None:
                deadline = min(deadline, stop_by)
            self._drain_deadline = deadline
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
        if phase is Phase.ACCEPTING:
            kill = self._kill_deadline()
            extra = f", policy {self.policy.name}" + (
                "" if kill is None else f", SIGKILL expected in {kill - now:.1f} s"
            )
        elif phase is Phase.DRAINING:
            extra = f", {self.drain_time_left():.1f} s to drain"
        logger.info(
            "%s -> %s: %s (%d connections, %d requests, %d sessions%s)",
            previous,
            phase,
            reason,
            self._connections,
            self._requests,
            len(self._sessions),
            extra,
        )
        if phase is Phase.DRAINING or (phase is Phase.STOPPING and previous < Phase.DRAINING):
            for session in list(self._sessions):
                session._request_drain()
        self._notify()

    def _check_drained(self) -> None:
        # Called while draining when requests, sessions or connections reach zero; wake
        # every waiter (wait_drained may ignore connections, so don't filter here).
        self._notify()

    def _notify(self) -> None:
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def _wait_for_change(self, timeout_s: float | None) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        event = self._changed
        with anyio.move_on_after(math.inf if timeout_s is None else timeout_s):
            await event.wait()

    async def _wait_until(self, condition: Callable[[], bool], timeout_s: float | None) -> bool:
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
        with anyio.move_on_after(math.inf if timeout_s is None else timeout_s):
            while not condition():
                await self._wait_for_change(None)
            return True
        return condition()
