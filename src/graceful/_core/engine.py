"""The machinery that runs a coordinator's phases, behind ``graceful.ShutdownCoordinator``.

Why a room of its own
---------------------
``ShutdownCoordinator`` is what users and adapters see: the configuration, the phase,
the reporting calls, the registries, the statistics.  What *moves* the phase is
``PhaseEngine``, so that each of the facade's methods stays a few lines and this part
can be read on its own.  Each coordinator owns one and delegates to it; the engine reads
the coordinator's counters and configuration and flips the flags its hot path reads
(``_draining``, ``_nudging``: see ``graceful._core.tracking``).  The hot path itself
never comes through here.  ``PhaseEngine`` is one object built of three classes, each in its module:

* ``graceful._core.timetable.Timetable`` — the deadlines, the statistics snapshot, the
  hard-exit watchdog;
* ``graceful._core.machine.PhaseMachine`` — the synchronous half: shutdown requests and
  signals, the queued transitions, the phase listeners, the log line of every change;
* ``PhaseEngine``, here — the asynchronous half: the ``run`` task (its signal handlers or
  trigger, the background tasks), the phase loop, the stopping steps and hooks, the
  waiters.

One object rather than three: the facade's readings (``phase``, ``deadlines``, the drain
deadline) stay one attribute away, where a helper object would add a lookup to calls
adapters make on their own paths.

The phase loop
--------------
While accepting, the policy decides at every change of the counts, and at least every
``AGE_RECHECK_S`` while a request is in flight: its age is evidence of how long draining
needs, so the budget (and the end of accepting) moves as it ages.  Draining ends once
drained or at the drain deadline, with a progress line every second.  Stopping has its
own budget (``kill_margin_s``): hooks of earlier phases still running when it begins are
cancelled instead of eating into it; the stopping steps then the stopping hooks run,
bounded by ``exit_by``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

import anyio
import anyio.abc
from typing_extensions import final

from .checks import _check_callable as _check_callable  # adapters import it from here
from .hooks import Hook, run_hooks
from .machine import PhaseMachine
from .policy import Phase, PolicyInput, _check_seconds
from .signals import QUICK_SIGNALS, SHUTDOWN_SIGNALS, catch_signals, current_schedule, loop_handles

if TYPE_CHECKING:
    from .owner import Owner

__all__ = ("Background", "PhaseEngine")

logger: Final = logging.getLogger("graceful")

#: While accepting with a request in flight, the budget is looked at again this often
#: (the request's age is evidence of how long draining needs).
AGE_RECHECK_S: Final = 0.1

Background = Callable[[], Awaitable[object]]


@final
class PhaseEngine(PhaseMachine):
    """Runs the phases of the coordinator that owns it (see the module docs).

    Attributes the coordinator reads (and its registries, which it fills) have public
    names; the methods without docs carry out the coordinator's method of the same name.
    """

    def __init__(self, owner: Owner) -> None:
        super().__init__(owner)
        self.hooks: dict[Phase, list[Hook]] = {
            Phase.ACCEPTING: [],
            Phase.DRAINING: [],
            Phase.STOPPING: [],
        }
        self.stopping_steps: list[Hook] = []
        self._background: list[Background] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self.running = False
        self._told_checkers = False

    # ----------------------------------------------------------------- registries

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
            now = owner._now()
            failures = getattr(owner.policy, "readiness_failures", 0)
            let_go, recheck = self.checkers.let_go(failures, now)
            if recheck is not None and not self._told_checkers:
                self._told_checkers = True
                logger.info(
                    "accepting until the health checkers probing readiness have seen "
                    "this process fail (%s)",
                    self.checkers.pending(failures),
                )
            decision = owner.policy.decide(
                PolicyInput(
                    now=now,
                    requested_at=self.requested_at,
                    last_connection_at=owner._last_activity_at,
                    accept_deadline=accept_deadline,
                    endpoint_removed_at=self.endpoint_removed_at,
                    health_checks_failed_at=let_go,
                    health_checks_recheck_at=recheck,
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
