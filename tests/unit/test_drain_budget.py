"""The drain budget is measured from request durations, not half the grace period."""

from __future__ import annotations

import logging

import anyio
import anyio.abc
import pytest

from graceful import AcceptUntilIdle, Phase, ServeUntilKilled, ShutdownCoordinator
from graceful._deadlines import MIN_DRAIN_BUDGET_S, drain_budget

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
    # kill at 30 s, stopping 1 s before, 1 s (the floor) kept to drain.
    assert accepted_for == pytest.approx(28.0)
    assert "accepting at most 14.5 s, then 14.5 s to drain)" in caplog.text


async def test_longer_requests_seen_while_accepting_move_the_end(virtual_time: bool) -> None:
    if not virtual_time:
        pytest.skip("exact timing needs the virtual clock")
    c = ShutdownCoordinator(policy=ServeUntilKilled(), grace_period_s=30)
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))
        start = anyio.current_time()
        c.request_shutdown("SIGTERM")
        await serve_requests(c, 5, 0.1)
        await serve_requests(c, 1, 4.0)  # a 4 s request while accepting: keep 12 s
        assert await c.wait_for_phase(Phase.DRAINING)
        assert anyio.current_time() - start == pytest.approx(30 - 1 - 12)
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
        assert anyio.current_time() - start == pytest.approx(29 / 2)
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
