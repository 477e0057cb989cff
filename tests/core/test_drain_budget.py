"""The drain budget is measured from request durations, not half the grace period."""

from __future__ import annotations

import logging

import anyio
import anyio.abc
import pytest

from graceful import AcceptUntilIdle, Phase, ServeUntilKilled, ShutdownCoordinator
from graceful._core.deadlines import MIN_DRAIN_BUDGET_S, drain_budget

pytestmark = pytest.mark.anyio


async def never() -> None:
    await anyio.sleep_forever()


@pytest.mark.parametrize(
    ("longest", "timeout", "to_stop", "expected"),
    [
        (None, 30.0, 29.0, 14.5),  # nothing measured: the conservative half
        (None, 5.0, 29.0, 5.0),
        (0.1, 30.0, 29.0, MIN_DRAIN_BUDGET_S),  # short requests: the floor
        (2.0, 30.0, 29.0, 6.0),  # three times the longest request
        (20.0, 30.0, 29.0, 14.5),  # never more than the unmeasured rule
        (20.0, 10.0, 29.0, 10.0),  # never more than the drain timeout
        (1.0, 30.0, -1.0, 0.0),
        (0.1, 30.0, 1.5, 0.75),  # the floor yields to the time left
    ],
)
def test_drain_budget(
    longest: float | None, timeout: float, to_stop: float, expected: float
) -> None:
    assert drain_budget(
        longest_request_s=longest, drain_timeout_s=timeout, time_to_stop_s=to_stop
    ) == pytest.approx(expected)


async def serve_requests(c: ShutdownCoordinator, count: int, duration_s: float) -> None:
    for _ in range(count):
        started = c.request_started()
        await anyio.sleep(duration_s)
        c.request_finished(started)


async def test_serve_until_killed_accepts_until_the_measured_budget(
    virtual_time: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Requests measured before SIGTERM (``measure_requests_always``): the plan
    announced at SIGTERM already keeps only the floor to drain."""
    if not virtual_time:
        pytest.skip("a 30 s grace period needs the virtual clock")
    caplog.set_level(logging.INFO, logger="graceful")
    c = ShutdownCoordinator(policy=ServeUntilKilled(), grace_period_s=30)
    c.measure_requests_always()
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))
        await serve_requests(c, 20, 0.1)  # measured while serving
        start = anyio.current_time()
        c.request_shutdown("SIGTERM")
        await serve_requests(c, 20, 0.1)
        assert await c.wait_for_phase(Phase.DRAINING)
        accepted_for = anyio.current_time() - start
        assert await c.wait_for_phase(Phase.STOPPED)
    # kill at 30 s, stopping 2 s before (out by 1 s before), 1 s (the floor) kept to drain.
    assert accepted_for == pytest.approx(27.0)
    assert "accepting at most 27.0 s, then 1.0 s to drain" in caplog.text


async def test_the_announced_end_of_accepting_is_a_promise(
    virtual_time: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing measured at SIGTERM: "accepting at most 14 s" holds, however fast the
    requests measured afterwards (one that arrives later may be as slow as any)."""
    if not virtual_time:
        pytest.skip("a 30 s grace period needs the virtual clock")
    caplog.set_level(logging.INFO, logger="graceful")
    c = ShutdownCoordinator(policy=ServeUntilKilled(), grace_period_s=30)
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))
        start = anyio.current_time()
        c.request_shutdown("SIGTERM")
        await serve_requests(c, 20, 0.1)  # measured while accepting
        assert await c.wait_for_phase(Phase.DRAINING)
        accepted_for = anyio.current_time() - start
        assert await c.wait_for_phase(Phase.STOPPED)
    assert accepted_for == pytest.approx(14.0)
    assert "accepting at most 14.0 s, then 14.0 s to drain)" in caplog.text


async def test_longer_requests_seen_while_accepting_move_the_end(virtual_time: bool) -> None:
    if not virtual_time:
        pytest.skip("exact timing needs the virtual clock")
    c = ShutdownCoordinator(policy=ServeUntilKilled(), grace_period_s=30)
    c.measure_requests_always()
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))
        await serve_requests(c, 5, 0.1)
        start = anyio.current_time()
        c.request_shutdown("SIGTERM")
        await serve_requests(c, 5, 0.1)
        await serve_requests(c, 1, 4.0)  # a 4 s request while accepting: keep 12 s
        await serve_requests(c, 200, 0.01)  # fast traffic does not age it out
        assert await c.wait_for_phase(Phase.DRAINING)
        assert anyio.current_time() - start == pytest.approx(30 - 2 - 12)
        assert await c.wait_for_phase(Phase.STOPPED)


async def test_a_request_in_flight_counts_as_it_ages(virtual_time: bool) -> None:
    """A 5 s request in flight at SIGTERM, fast ones measured before (accepting at most
    7 s announced): the budget is three times its age so far (at most half of the 8 s
    before stopping), so accepting ends at 4 s — not at 5 s when it ends, when a
    request as slow could no longer finish."""
    if not virtual_time:
        pytest.skip("exact timing needs the virtual clock")
    c = ShutdownCoordinator(policy=ServeUntilKilled(), grace_period_s=10)
    c.measure_requests_always()
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))
        await serve_requests(c, 5, 0.01)
        tg.start_soon(serve_requests, c, 1, 5.0)
        await anyio.wait_all_tasks_blocked()
        start = anyio.current_time()
        c.request_shutdown("SIGTERM")
        assert await c.wait_for_phase(Phase.DRAINING)
        assert anyio.current_time() - start == pytest.approx(4.0, abs=0.11)
        assert await c.wait_for_phase(Phase.STOPPED)
        assert c.statistics().cut_at_stopping == 0


async def test_a_request_in_flight_before_timing_counts_from_the_shutdown_request(
    virtual_time: bool,
) -> None:
    """Untimed (started before SIGTERM, nothing measured): its age is at least the time
    since the shutdown request."""
    if not virtual_time:
        pytest.skip("exact timing needs the virtual clock")
    c = ShutdownCoordinator(policy=ServeUntilKilled(), grace_period_s=10)
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))
        tg.start_soon(serve_requests, c, 1, 5.0)
        await anyio.wait_all_tasks_blocked()
        start = anyio.current_time()
        c.request_shutdown("SIGTERM")
        assert c.longest_request_s() == 0.0
        await anyio.sleep(1)
        assert c.longest_request_s() == pytest.approx(1.0)
        assert await c.wait_for_phase(Phase.DRAINING)
        assert anyio.current_time() - start == pytest.approx(4.0)
        assert await c.wait_for_phase(Phase.STOPPED)


async def test_unmeasured_keeps_the_conservative_half(virtual_time: bool) -> None:
    if not virtual_time:
        pytest.skip("exact timing needs the virtual clock")
    c = ShutdownCoordinator(policy=AcceptUntilIdle(idle_s=100, max_wait_s=100), grace_period_s=30)
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))
        start = anyio.current_time()
        c.request_shutdown("SIGTERM")
        assert await c.wait_for_phase(Phase.DRAINING)
        assert anyio.current_time() - start == pytest.approx(28 / 2)
        assert await c.wait_for_phase(Phase.STOPPED)


def test_requests_are_timed_only_once_shutdown_was_requested() -> None:
    c = ShutdownCoordinator()

    async def main() -> list[bool]:
        timed = []
        for i in range(10):
            if i == 5:
                c.request_shutdown("test")
            started = c.request_started()
            timed.append(started is not None)
            c.request_finished(started)
        return timed

    assert anyio.run(main) == [False] * 5 + [True] * 5
    assert c.longest_request_s() is not None


def test_measure_requests_always_times_them_while_serving() -> None:
    c = ShutdownCoordinator()
    c.measure_requests_always()

    async def main() -> list[bool]:
        timed = []
        for _ in range(3):
            started = c.request_started()
            timed.append(started is not None)
            c.request_finished(started)
        return timed

    assert anyio.run(main) == [True] * 3
    assert c.longest_request_s() is not None
    assert c.oldest_request_age_s() is None
