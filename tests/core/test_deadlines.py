"""Deadlines: the pure arithmetic of graceful._core.deadlines on numbers, then the coordinator
obeying it on the virtual clock (trio's MockClock; the asyncio runs check the order only).
"""

from __future__ import annotations

import logging
import time

import anyio
import pytest

from graceful import Phase, RefuseImmediately, ServeUntilKilled, ShutdownCoordinator
from graceful._core import coordinator as _coordinator
from graceful._core.deadlines import (
    DEFAULT_GRACE_PERIOD_S,
    Deadlines,
    accept_by,
    drain_by,
    exit_margin,
    plan,
    wall_to_loop,
)

pytestmark = pytest.mark.anyio

T0 = 1000.0  # the shutdown request, on the loop clock


def plan_at(
    *,
    grace_period_s: float | None = None,
    kill_at: float | None = None,
    kill_source: str | None = None,
    drain_timeout_s: float = 30.0,
    kill_margin_s: float = 1.0,
) -> Deadlines:
    return plan(
        requested_at=T0,
        grace_period_s=grace_period_s,
        kill_at=kill_at,
        kill_source=kill_source,
        drain_timeout_s=drain_timeout_s,
        kill_margin_s=kill_margin_s,
    )


# ------------------------------------------------------------------ on numbers


def test_grace_period_gives_the_kill_time() -> None:
    d = plan_at(grace_period_s=30)
    assert d == Deadlines(
        kill=T0 + 30,
        kill_source="grace period 30 s",
        assumed=False,
        stop_by=T0 + 28,  # kill - 2 x the margin
        exit_by=T0 + 28.75,  # out by kill - the margin, the exit margin before
        accept_by=T0 + 14,  # draining gets min(30, 28 / 2)
    )
    assert d.stop_budget_s == pytest.approx(0.75)


def test_absolute_kill_time_wins_over_the_grace_period() -> None:
    d = plan_at(grace_period_s=30, kill_at=T0 + 10, kill_source="pod")
    assert (d.kill, d.kill_source, d.assumed) == (T0 + 10, "pod", False)
    assert (d.stop_by, d.exit_by, d.accept_by) == (T0 + 8, T0 + 8.75, T0 + 4)


def test_absolute_kill_time_without_a_source_says_who_set_it() -> None:
    assert plan_at(kill_at=T0 + 10).kill_source == "set by the application"


def test_no_kill_time_known_assumes_kubernetes_default() -> None:
    d = plan_at()
    assert DEFAULT_GRACE_PERIOD_S == 30.0
    assert d.assumed is True
    assert d.kill == T0 + 30
    assert d.kill_source == "assumed default grace period 30 s"
    assert d == Deadlines(
        kill=T0 + 30,
        kill_source=d.kill_source,
        assumed=True,
        stop_by=T0 + 28,
        exit_by=T0 + 28.75,
        accept_by=T0 + 14,
    )


def test_short_drain_timeout_leaves_accepting_the_rest() -> None:
    d = plan_at(grace_period_s=30, drain_timeout_s=5)
    assert d.accept_by == T0 + 23  # stop_by 28 minus the 5 s drain


def test_margin_larger_than_the_time_left_clamps_to_the_request() -> None:
    d = plan_at(kill_at=T0 + 2, kill_margin_s=1)
    assert d.stop_by == T0  # stopping begins at once, never before the request
    assert d.exit_by == T0 + 0.75  # kill - the margin - exit_margin(1)
    assert d.accept_by == T0  # no time to accept
    assert d.stop_budget_s == pytest.approx(0.75)
    late = plan_at(kill_at=T0 + 0.5, kill_margin_s=1)  # the promise is already past
    assert (late.stop_by, late.exit_by) == (T0, T0)


def test_kill_time_in_the_past_clamps_everything_to_the_request() -> None:
    d = plan_at(kill_at=T0 - 10, kill_source="pod")
    assert (d.stop_by, d.exit_by, d.accept_by) == (T0, T0, T0)
    assert d.kill == T0 - 10


@pytest.mark.parametrize(
    ("kill_margin_s", "margin"), [(0.0, 0.0), (0.4, 0.1), (1.0, 0.25), (10.0, 0.25)]
)
def test_exit_margin_is_a_quarter_of_the_kill_margin_at_most_a_quarter_second(
    kill_margin_s: float, margin: float
) -> None:
    assert exit_margin(kill_margin_s) == pytest.approx(margin)


def test_accept_by_leaves_draining_its_timeout_or_half_the_time() -> None:
    assert accept_by(requested_at=0, stop_by=100, drain_timeout_s=10) == 90
    assert accept_by(requested_at=0, stop_by=10, drain_timeout_s=30) == 5
    assert accept_by(requested_at=0, stop_by=0, drain_timeout_s=30) == 0
    assert accept_by(requested_at=5, stop_by=0, drain_timeout_s=30) == 0  # clamped budget


def test_drain_by_is_the_timeout_or_stop_by() -> None:
    assert drain_by(draining_at=10, drain_timeout_s=5, stop_by=100) == 15
    assert drain_by(draining_at=10, drain_timeout_s=50, stop_by=29) == 29


def test_wall_to_loop() -> None:
    assert wall_to_loop(1_700_000_010.0, wall_now=1_700_000_000.0, loop_now=5.0) == 15.0
    assert wall_to_loop(1_699_999_990.0, wall_now=1_700_000_000.0, loop_now=5.0) == -5.0


@pytest.mark.parametrize("grace", [0.5, 1.0, 2.0, 30.0, 600.0])
@pytest.mark.parametrize("margin", [0.1, 1.0, 5.0])
@pytest.mark.parametrize("drain", [0.0, 1.0, 30.0])
def test_deadlines_are_ordered(grace: float, margin: float, drain: float) -> None:
    d = plan_at(grace_period_s=grace, kill_margin_s=margin, drain_timeout_s=drain)
    assert T0 <= d.accept_by <= d.stop_by <= d.exit_by <= d.kill
    assert d.stop_by - d.accept_by <= drain + 1e-9


def test_deadlines_are_frozen() -> None:
    d = plan_at()
    with pytest.raises(AttributeError):
        d.kill = 0.0  # type: ignore[misc]


# ------------------------------------------------------------- the coordinator


async def never() -> None:
    await anyio.sleep_forever()


async def start(tg: anyio.abc.TaskGroup, c: ShutdownCoordinator) -> None:
    await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))


async def test_kill_deadline_set_after_the_request_replans(
    virtual_time: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="graceful")
    c = ShutdownCoordinator(
        policy=ServeUntilKilled(), grace_period_s=30, kill_margin_s=1, drain_timeout_s=60
    )
    changes: list[tuple[Phase, float, str | None]] = []
    c.subscribe(lambda phase: changes.append((phase, anyio.current_time(), c.statistics().reason)))
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        began = anyio.current_time()
        # Real time runs on while the test does (a loaded run: 74 ms between two lines).
        tol = 0.05 if virtual_time else 0.5
        with c.track_request():  # never finishes by itself
            c.request_shutdown("SIGTERM")
            assert c.statistics().kill_deadline_in_s == pytest.approx(30, abs=tol)
            c.set_kill_deadline(time.time() + 10, source="pod")
            assert c.statistics().kill_deadline_in_s == pytest.approx(10, abs=tol)
            d = c.deadlines
            assert d is not None
            assert d.kill_source == "pod"
            assert d.stop_by - began == pytest.approx(8, abs=tol)
            assert "kill deadline from pod: SIGKILL in 10.0 s" in caplog.text
            if not virtual_time:  # the rest takes 9 s of real time
                tg.cancel_scope.cancel()
                return
            assert await c.wait_for_phase(Phase.STOPPED, timeout_s=60)
    phases = [phase for phase, _, _ in changes]
    assert phases == [Phase.ACCEPTING, Phase.DRAINING, Phase.STOPPING, Phase.STOPPED]
    _, draining_at, _ = changes[1]
    _, stopping_at, stopping_reason = changes[2]
    # accepting ends at the re-planned accept_by (stop_by 8 - 8 / 2), stopping at stop_by
    assert draining_at - began == pytest.approx(4, abs=0.05)
    assert stopping_at - began == pytest.approx(8, abs=0.05)
    assert (stopping_reason or "").startswith("drain deadline reached")


async def test_kill_deadline_set_before_the_request_is_used_by_it() -> None:
    c = ShutdownCoordinator(grace_period_s=30)
    c.set_kill_deadline(time.time() + 12, source="pod")
    assert c.deadlines is None  # nothing planned before the request
    c.request_shutdown("SIGTERM")
    d = c.deadlines
    assert d is not None
    assert (d.kill_source, d.assumed) == ("pod", False)
    # The pod's 12 s, not the grace period's 30 (real time: a loaded run runs on).
    assert c.statistics().kill_deadline_in_s == pytest.approx(12, abs=0.5)


async def test_kill_deadline_rejects_bad_times() -> None:
    c = ShutdownCoordinator()
    with pytest.raises(TypeError, match="wall_clock_s"):
        c.set_kill_deadline("soon", source="pod")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wall_clock_s"):
        c.set_kill_deadline(float("nan"), source="pod")


async def test_hanging_accepting_hook_is_cancelled_when_stopping_begins(
    virtual_time: bool,
) -> None:
    # hook_timeout_s far beyond the shutdown: only stopping may end the hook
    c = ShutdownCoordinator(
        policy=ServeUntilKilled(), grace_period_s=30, kill_margin_s=1, hook_timeout_s=1000
    )
    started = anyio.Event()
    cancelled: list[float] = []

    async def hangs() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.append(anyio.current_time())

    c.add_hook(hangs, phase=Phase.ACCEPTING)
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        c.request_shutdown("SIGTERM")
        with anyio.fail_after(60):
            await started.wait()
        escalated = anyio.current_time()
        c.request_shutdown("SIGINT")  # escalates: stopping begins now
        with anyio.fail_after(60):
            assert await c.wait_for_phase(Phase.STOPPED)
        stopped = anyio.current_time()
    assert len(cancelled) == 1
    assert cancelled[0] <= stopped
    d = c.deadlines
    assert d is not None
    assert stopped <= d.exit_by
    if virtual_time:
        assert stopped == pytest.approx(escalated)  # the hook did not delay stopping at all


async def test_hanging_draining_hook_is_cancelled_at_stop_by(virtual_time: bool) -> None:
    if not virtual_time:
        pytest.skip("exact timing needs the virtual clock")
    c = ShutdownCoordinator(
        policy=RefuseImmediately(),
        grace_period_s=20,
        kill_margin_s=2,
        drain_timeout_s=100,
        hook_timeout_s=1000,
    )
    ends: list[float] = []

    async def hangs() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            ends.append(anyio.current_time())

    c.add_hook(hangs, phase=Phase.DRAINING)
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        began = anyio.current_time()
        with c.track_request():
            c.request_shutdown("SIGTERM")
            assert await c.wait_for_phase(Phase.STOPPED)
    assert ends == [pytest.approx(began + 16)]  # stop_by = kill 20 - 2 x margin 2
    assert anyio.current_time() - began == pytest.approx(16)


async def test_stopping_hooks_are_bounded_by_exit_by(virtual_time: bool) -> None:
    c = ShutdownCoordinator(
        policy=ServeUntilKilled(),
        grace_period_s=10 if virtual_time else 0.5,
        kill_margin_s=4 if virtual_time else 0.2,
        hook_timeout_s=1000,
    )
    ran: list[str] = []

    async def first_registered() -> None:
        ran.append("first")
        await anyio.sleep_forever()

    async def last_registered() -> None:
        ran.append("last")
        await anyio.sleep_forever()

    c.add_hook(first_registered)
    c.add_hook(last_registered)
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        began = anyio.current_time()
        c.request_shutdown("SIGQUIT", immediate=True)
        with anyio.fail_after(30):
            assert await c.wait_for_phase(Phase.STOPPED)
    d = c.deadlines
    assert d is not None
    # reverse registration order; the first hook ate the whole budget, the second got 0 s
    assert ran == ["last", "first"]
    if virtual_time:
        assert d.exit_by - began == pytest.approx(10 - 4 - 0.25)  # out by kill - margin
        assert anyio.current_time() == pytest.approx(d.exit_by)
    else:
        assert anyio.current_time() <= d.exit_by + 0.1


async def test_no_kill_deadline_warning_is_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At start-up (not when the shutdown begins, when it is too late to act on it)."""
    monkeypatch.setattr(_coordinator, "in_terminal_foreground", lambda: False)
    caplog.set_level(logging.INFO, logger="graceful")
    c = ShutdownCoordinator(policy=RefuseImmediately())
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        assert "no kill deadline known" in caplog.text  # before any shutdown request
        c.request_shutdown("preStop", escalate=False)
        c.request_shutdown("preStop", escalate=False)
        c.request_shutdown("SIGTERM")
        with anyio.fail_after(60):
            assert await c.wait_for_phase(Phase.STOPPED)
    warnings = [r for r in caplog.records if "no kill deadline known" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert "assuming Kubernetes' default of 30 s at shutdown" in warnings[0].getMessage()


async def test_no_kill_deadline_warning_not_in_a_terminal(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dev loop (a terminal's foreground) is not warned: Ctrl-C drains at once."""
    monkeypatch.setattr(_coordinator, "in_terminal_foreground", lambda: True)
    caplog.set_level(logging.INFO, logger="graceful")
    c = ShutdownCoordinator(policy=RefuseImmediately())
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        c.request_shutdown("SIGTERM")
        with anyio.fail_after(60):
            assert await c.wait_for_phase(Phase.STOPPED)
    assert "no kill deadline known" not in caplog.text


async def test_known_grace_period_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="graceful")
    c = ShutdownCoordinator(policy=RefuseImmediately(), grace_period_s=30)
    c.request_shutdown("SIGTERM")
    assert "no kill deadline known" not in caplog.text
