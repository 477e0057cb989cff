"""ShutdownCoordinator on asyncio and trio: phases, counts, deadlines, hooks, escalation.

On trio the clock is virtual (``MockClock(autojump_threshold=0)``), so timings are exact and
long deadlines cost nothing; on asyncio the same tests run on real time with durations
scaled down, and only the order of events is asserted.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import anyio
import pytest

from graceful import (
    AcceptUntilIdle,
    Phase,
    RefuseImmediately,
    ServeUntilKilled,
    ShutdownCoordinator,
)
from graceful._core import coordinator as _coordinator

pytestmark = pytest.mark.anyio


@pytest.fixture
def scale(virtual_time: bool) -> float:
    """Multiply durations by this: 1 on the virtual clock, small on real time."""
    return 1.0 if virtual_time else 0.02


async def never() -> None:
    await anyio.sleep_forever()


async def run_in_background(tg: anyio.abc.TaskGroup, c: ShutdownCoordinator) -> None:
    await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))


def record(c: ShutdownCoordinator) -> list[tuple[Phase, float, str | None]]:
    """Phase changes as (phase, time, reason), as they happen."""
    changes: list[tuple[Phase, float, str | None]] = []
    c.subscribe(lambda phase: changes.append((phase, anyio.current_time(), c.statistics().reason)))
    return changes


async def test_phases_move_forward_in_order(scale: float) -> None:
    c = ShutdownCoordinator(policy=AcceptUntilIdle(idle_s=1 * scale))
    seen: list[Phase] = []
    c.subscribe(seen.append)
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        assert c.phase is Phase.SERVING
        assert not c.shutdown_requested
        c.request_shutdown("test")
        assert c.phase is Phase.ACCEPTING  # synchronous: readiness flips at once
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=10)
    assert seen == [Phase.ACCEPTING, Phase.DRAINING, Phase.STOPPING, Phase.STOPPED]


async def test_accept_until_idle_waits_for_quiet(virtual_time: bool, scale: float) -> None:
    c = ShutdownCoordinator(policy=AcceptUntilIdle(idle_s=2 * scale, max_wait_s=60))
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        start = anyio.current_time()
        c.request_shutdown("test")
        for _ in range(3):  # a connection every 1.5 "s" keeps the window open
            await anyio.sleep(1.5 * scale)
            assert c.phase is Phase.ACCEPTING
            c.connection_opened()
            c.connection_closed()
        last = anyio.current_time()
        assert await c.wait_for_phase(Phase.DRAINING, timeout_s=10)
        if virtual_time:
            assert anyio.current_time() - start == pytest.approx(4.5 + 2.0)
        assert anyio.current_time() - last >= 2 * scale - 1e-6
    assert c.phase is Phase.STOPPED


async def test_max_wait_ends_accepting_under_constant_traffic(virtual_time: bool) -> None:
    if not virtual_time:
        pytest.skip("exact timing needs the virtual clock")
    c = ShutdownCoordinator(policy=AcceptUntilIdle(idle_s=2, max_wait_s=10))
    changes = record(c)
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        start = anyio.current_time()
        c.request_shutdown("test")
        while c.phase is Phase.ACCEPTING:
            c.connection_opened()
            c.connection_closed()
            await anyio.sleep(0.5)
        assert changes[1] == (Phase.DRAINING, pytest.approx(start + 10.0), "max_wait_s=10 reached")


async def test_refuse_immediately_drains_in_flight_requests(scale: float) -> None:
    c = ShutdownCoordinator(policy=RefuseImmediately(), drain_timeout_s=60)
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        c.connection_opened()
        with c.track_request():
            c.request_shutdown("test")
            assert await c.wait_for_phase(Phase.DRAINING, timeout_s=10)
            assert c.draining
            assert c.nudging
            assert not c.accepting
            await anyio.sleep(1 * scale)
            assert c.phase is Phase.DRAINING  # the request holds the drain open
            assert c.statistics().requests == 1
        assert c.phase is Phase.DRAINING  # the connection still does
        c.connection_closed()
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=10)
        assert c.statistics().reason == "shutdown complete"


async def test_drain_timeout_cuts_the_drain(virtual_time: bool, scale: float) -> None:
    c = ShutdownCoordinator(policy=RefuseImmediately(), drain_timeout_s=5 * scale)
    changes = record(c)
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        with c.track_request():
            c.request_shutdown("test")
            assert await c.wait_for_phase(Phase.DRAINING, timeout_s=10)
            began = anyio.current_time()
            assert await c.wait_for_phase(Phase.STOPPING, timeout_s=10)
            if virtual_time:
                assert anyio.current_time() - began == pytest.approx(5.0)
            assert changes[2][0] is Phase.STOPPING
            assert changes[2][2] == ("drain deadline reached with 0 connections, 1 request left")


async def test_kill_deadline_bounds_accepting_and_draining(virtual_time: bool) -> None:
    if not virtual_time:
        pytest.skip("exact timing needs the virtual clock")
    c = ShutdownCoordinator(
        policy=ServeUntilKilled(), grace_period_s=30, kill_margin_s=1, drain_timeout_s=60
    )
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        start = anyio.current_time()
        with c.track_request():  # never finishes on its own
            c.request_shutdown("SIGTERM")
            assert c.statistics().kill_deadline_in_s == pytest.approx(30)
            assert await c.wait_for_phase(Phase.DRAINING)
            # stop_by = 28; draining gets min(60, 28/2) = 14 s of it
            assert anyio.current_time() - start == pytest.approx(14.0)
            assert c.drain_time_left() == pytest.approx(14.0)
            assert await c.wait_for_phase(Phase.STOPPING)
            assert anyio.current_time() - start == pytest.approx(28.0)


async def test_grace_period_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRACEFUL_GRACE_PERIOD", "45")
    assert ShutdownCoordinator().grace_period_s == 45.0
    monkeypatch.setenv("GRACEFUL_GRACE_PERIOD", "soon")
    with pytest.raises(ValueError, match=r"GRACEFUL_GRACE_PERIOD must be .* got 'soon'"):
        ShutdownCoordinator()
    monkeypatch.setenv("GRACEFUL_GRACE_PERIOD", "-3")
    with pytest.raises(ValueError, match=r"GRACEFUL_GRACE_PERIOD must be .* got -3.0"):
        ShutdownCoordinator()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"drain_timeout_s": -1}, r"drain_timeout_s must be a finite number .* got -1"),
        ({"drain_timeout_s": math.nan}, r"drain_timeout_s must be .* got nan"),
        ({"grace_period_s": math.inf}, r"grace_period_s must be .* got inf"),
        ({"grace_period_s": 5, "kill_margin_s": 5}, r"kill_margin_s \(5\) must be less than"),
        ({"policy": "accept-until-idle"}, r"policy must be a graceful Policy instance"),
    ],
)
def test_bad_configuration_is_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        ShutdownCoordinator(**kwargs)


async def test_second_request_escalates_to_stopping() -> None:
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        with c.track_request():
            c.request_shutdown("SIGTERM")
            assert c.phase is Phase.ACCEPTING
            c.request_shutdown("SIGINT")
            assert c.phase is Phase.STOPPING
            assert c.statistics().reason == "SIGINT (escalated)"
            assert await c.wait_for_phase(Phase.STOPPED, timeout_s=10)


async def test_prestop_requests_do_not_escalate() -> None:
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        c.request_shutdown("preStop", escalate=False)
        c.request_shutdown("preStop", escalate=False)
        assert c.phase is Phase.ACCEPTING
        c.request_shutdown("SIGTERM")  # the kubelet's SIGTERM after preStop returned
        assert c.phase is Phase.STOPPING
        tg.cancel_scope.cancel()


async def test_immediate_request_skips_to_stopping() -> None:
    c = ShutdownCoordinator()
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        c.request_shutdown("SIGQUIT", immediate=True)
        assert c.phase is Phase.STOPPING
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=10)


async def test_trigger_requests_shutdown() -> None:
    c = ShutdownCoordinator(policy=RefuseImmediately())
    fire = anyio.Event()

    async def trigger() -> None:
        await fire.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: c.run(shutdown_trigger=trigger))
        assert not await c.wait_for_phase(Phase.ACCEPTING, timeout_s=0.01)
        fire.set()
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=10)
    assert c.statistics().phase is Phase.STOPPED


async def test_sessions_are_asked_to_drain_and_hold_the_drain(scale: float) -> None:
    c = ShutdownCoordinator(policy=RefuseImmediately(), drain_timeout_s=60)
    asked: list[str] = []
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        with c.track_session(lambda: asked.append("ws")) as session:
            assert c.statistics().sessions == 1
            c.request_shutdown("test")
            assert await c.wait_for_phase(Phase.DRAINING, timeout_s=10)
            assert asked == ["ws"]
            assert session.drain_requested
            await anyio.sleep(scale)
            assert c.phase is Phase.DRAINING
        # a session that starts while draining is asked at once
        with c.track_session(lambda: asked.append("late")):
            assert asked == ["ws", "late"]
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=10)


async def test_wait_drained_and_timeouts(scale: float) -> None:
    c = ShutdownCoordinator()
    c.connection_opened()
    assert not c.drained
    assert await c.wait_drained(timeout_s=0.01 * scale) is False
    c.connection_closed()
    assert await c.wait_drained(timeout_s=1) is True
    with pytest.raises(ValueError, match="timeout_s must be"):
        await c.wait_drained(timeout_s=-1)


async def test_hooks_run_in_documented_order_and_failures_are_contained(
    caplog: pytest.LogCaptureFixture, virtual_time: bool
) -> None:
    caplog.set_level(logging.INFO, logger="graceful")
    order: list[str] = []
    c = ShutdownCoordinator(policy=RefuseImmediately(), hook_timeout_s=2 if virtual_time else 0.2)

    async def accepting_hook() -> None:
        order.append("accepting")

    async def draining_hook() -> None:
        order.append("draining")

    async def first_stop() -> None:
        order.append("stop-first-registered")

    async def hangs() -> None:
        order.append("hangs")
        await anyio.sleep_forever()

    async def raises() -> None:
        order.append("raises")
        raise RuntimeError("boom")

    async def last_stop() -> None:
        order.append("stop-last-registered")

    c.add_hook(accepting_hook, phase=Phase.ACCEPTING)
    c.add_hook(draining_hook, phase=Phase.DRAINING)
    for hook in (first_stop, hangs, raises, last_stop):
        c.add_hook(hook)
    with pytest.raises(ValueError, match="phase must be"):
        c.add_hook(first_stop, phase=Phase.SERVING)

    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        c.request_shutdown("test")
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=30)
    # stopping hooks run last-registered first, after a hanging and a failing one
    assert order[-4:] == ["stop-last-registered", "raises", "hangs", "stop-first-registered"]
    assert set(order[:2]) == {"accepting", "draining"}
    assert (
        "hook test_hooks_run_in_documented_order_and_failures_are_contained.<locals>.hangs"
        " timed out" in caplog.text
    )
    assert "stopping hook" in caplog.text
    assert "raises failed" in caplog.text


async def test_sync_hooks_run_in_a_thread_and_hanging_ones_are_abandoned(
    caplog: pytest.LogCaptureFixture, virtual_time: bool
) -> None:
    if virtual_time:
        pytest.skip("worker threads and an autojumping clock race; real time only")
    release = threading.Event()
    ran: list[str] = []
    c = ShutdownCoordinator(policy=RefuseImmediately(), hook_timeout_s=0.1)
    c.add_hook(lambda: ran.append(threading.current_thread().name))
    c.add_hook(lambda: release.wait(10))  # hangs until released; abandoned at 0.1 s
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        c.request_shutdown("test")
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=10)
    release.set()
    assert ran
    assert ran[0] != threading.main_thread().name
    assert "timed out after 0.1 s" in caplog.text


async def test_logs_phase_changes_and_drain_progress(
    caplog: pytest.LogCaptureFixture, virtual_time: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not virtual_time:
        pytest.skip("once-a-second progress lines are checked on the virtual clock")
    monkeypatch.setattr(_coordinator, "in_terminal_foreground", lambda: False)
    caplog.set_level(logging.INFO, logger="graceful")
    c = ShutdownCoordinator(policy=RefuseImmediately(), drain_timeout_s=20)
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        for _ in range(12):
            c.connection_opened()
        with c.track_request(), c.track_request(), c.track_request():
            c.request_shutdown("SIGTERM")
            await anyio.sleep(1.8)
        for _ in range(12):
            c.connection_closed()
        assert await c.wait_for_phase(Phase.STOPPED)
    messages = [r.getMessage() for r in caplog.records if r.name == "graceful"]
    assert messages.pop(0).startswith("policy refuse-immediately; no kill deadline known")
    assert messages[0].startswith("serving -> accepting: SIGTERM (12 connections, 3 requests;")
    assert messages[1].startswith("accepting -> draining: policy refuses")
    assert messages[2] == "draining: 12 connections, 3 requests, 19.0 s left"
    assert messages[3].startswith("draining -> stopping: drained")
    assert messages[4].startswith("stopping -> stopped")


async def test_statistics_snapshot_is_frozen(virtual_time: bool) -> None:
    c = ShutdownCoordinator(policy=AcceptUntilIdle(idle_s=5, max_wait_s=20), grace_period_s=30)
    c.connection_opened()
    s = c.statistics()
    assert (s.phase, s.connections, s.requests, s.time_left_s) == (Phase.SERVING, 1, 0, None)
    with pytest.raises(AttributeError):
        s.phase = Phase.STOPPED  # type: ignore[misc]
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        c.request_shutdown("test")
        s = c.statistics()
        assert s.phase is Phase.ACCEPTING
        if virtual_time:
            # max_wait is 20 s, but draining must fit before SIGKILL: stop_by = 29 s,
            # draining gets min(drain_timeout_s, 28 / 2), so accepting ends at 14 s
            assert s.time_left_s == pytest.approx(14.0)
            assert s.kill_deadline_in_s == pytest.approx(30)
        tg.cancel_scope.cancel()


async def test_run_twice_at_once_is_an_error() -> None:
    c = ShutdownCoordinator()
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        with pytest.raises(RuntimeError, match="already running"):
            await c.run(shutdown_trigger=never)
        tg.cancel_scope.cancel()


async def test_endpoint_removal_starts_the_idle_window(virtual_time: bool) -> None:
    if not virtual_time:
        pytest.skip("exact timing needs the virtual clock")
    policy = AcceptUntilIdle(idle_s=2, max_wait_s=60, wait_for_endpoint_removal=True)
    c = ShutdownCoordinator(policy=policy)
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        start = anyio.current_time()
        c.request_shutdown("test")
        await anyio.sleep(7)
        assert c.phase is Phase.ACCEPTING
        c.notify_endpoint_removed()
        assert await c.wait_for_phase(Phase.DRAINING)
        assert anyio.current_time() - start == pytest.approx(9)


async def test_statistics_count_what_happened_after_shutdown(virtual_time: bool) -> None:
    """The operator's numbers (graceful.metrics reads them at scrape time)."""
    if not virtual_time:
        pytest.skip("exact durations need the virtual clock")
    c = ShutdownCoordinator(policy=AcceptUntilIdle(idle_s=2), drain_timeout_s=10, grace_period_s=60)
    c.connection_opened()  # before shutdown: not "after"
    before = c.request_started()
    c.request_finished(before)
    s = c.statistics()
    assert (s.connections_after_shutdown, s.requests_after_shutdown) == (0, 0)
    assert s.since_last_connection_s == 0.0
    async with anyio.create_task_group() as tg:
        await run_in_background(tg, c)
        c.request_shutdown("test")
        c.connection_opened()
        held = c.request_started()  # in flight across the drain, cut at stopping
        c.request_started()  # finished during the drain, below
        await anyio.sleep(1)
        assert c.statistics().since_last_connection_s == pytest.approx(1)
        assert await c.wait_for_phase(Phase.DRAINING, timeout_s=30)
        draining_at = anyio.current_time()
        c.connection_closed()  # the drain closed one idle connection
        c.request_finished(None)
        s = c.statistics()
        assert (s.connections_after_shutdown, s.requests_after_shutdown) == (1, 2)
        assert (s.connections_closed_draining, s.cut_at_stopping, s.drain_duration_s) == (
            1,
            0,
            None,
        )
        assert await c.wait_for_phase(Phase.STOPPING, timeout_s=30)
        s = c.statistics()
        assert s.cut_at_stopping == 1  # the held request
        assert s.drain_duration_s == pytest.approx(anyio.current_time() - draining_at)
        assert s.drain_duration_s == pytest.approx(10)  # the drain timeout
        c.request_finished(held)
        c.connection_closed()
    assert c.statistics().connections_closed_draining == 2
