"""The health checkers' count (``graceful._core.checkers``) and what accept-until-idle
does with it: on a clock the test moves, probe by probe."""

from __future__ import annotations

import pytest

from graceful import AcceptUntilIdle, PolicyInput
from graceful._core.checkers import HealthCheckers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.requested: float | None = None
        self.changes = 0

    def checkers(self) -> HealthCheckers:
        return HealthCheckers(lambda: self.now, self.changed, lambda: self.requested)

    def changed(self) -> None:
        self.changes += 1


def probe_every(clock: Clock, checkers: HealthCheckers, who: tuple[str, str], n: int) -> None:
    for _ in range(n):
        clock.now += 2.0
        status = 200 if clock.requested is None else 503
        checkers.answered(*who, status)


HAPROXY = ("10.0.0.7", "")
KUBELET = ("10.0.0.1", "kube-probe/1.31")


def test_no_checker_seen_lets_go_at_the_request() -> None:
    clock = Clock()
    checkers = clock.checkers()
    assert checkers.let_go(3, clock.now) == (None, None)  # no shutdown requested yet
    clock.requested = clock.now
    assert checkers.let_go(3, clock.now) == (None, None)  # nothing to wait for


def test_a_checker_lets_go_at_its_third_503() -> None:
    clock = Clock()
    checkers = clock.checkers()
    probe_every(clock, checkers, HAPROXY, 4)  # period learned: 2 s
    clock.requested = clock.now + 0.5
    clock.now = clock.requested
    released, recheck = checkers.let_go(3, clock.now)
    assert released is None
    assert recheck == pytest.approx(clock.now - 0.5 + 4.0)  # quiet for two periods
    assert "10.0.0.7 - 0/3" in checkers.pending(3)
    probe_every(clock, checkers, HAPROXY, 2)
    assert checkers.let_go(3, clock.now)[0] is None
    probe_every(clock, checkers, HAPROXY, 1)
    third = clock.now
    probe_every(clock, checkers, HAPROXY, 2)  # it keeps checking a backend it marked down
    assert checkers.let_go(3, clock.now) == (third, None)
    assert clock.changes == 5  # every 503 wakes the policy


def test_a_checker_that_goes_quiet_has_let_go() -> None:
    clock = Clock()
    checkers = clock.checkers()
    probe_every(clock, checkers, HAPROXY, 3)
    clock.requested = clock.now
    probe_every(clock, checkers, HAPROXY, 1)
    last = clock.now
    clock.now = last + 3.9
    assert checkers.let_go(3, clock.now)[0] is None
    clock.now = last + 4.0
    assert checkers.let_go(3, clock.now) == (last + 4.0, None)


def test_one_probe_or_a_probe_long_before_is_not_a_checker() -> None:
    clock = Clock()
    checkers = clock.checkers()
    checkers.answered("127.0.0.1", "python-httpx/0.28", 200)  # a script waiting for start-up
    probe_every(clock, checkers, HAPROXY, 3)
    clock.now += 7.0  # more than three periods after the last probe
    clock.requested = clock.now
    assert checkers.let_go(3, clock.now) == (None, None)


def test_a_declared_checker_uses_its_own_threshold_and_is_released_with_the_endpoint() -> None:
    clock = Clock()
    checkers = clock.checkers()
    checkers.expect("kube-probe/", failures=1, period_s=10.0)
    checkers.answered(*KUBELET, 200)  # one probe is enough: its period is declared
    clock.requested = clock.now + 1.0
    clock.now = clock.requested
    assert checkers.let_go(3, clock.now)[0] is None
    checkers.release_declared()
    assert checkers.let_go(3, clock.now) == (None, None)
    checkers.answered(*KUBELET, 503)
    assert checkers.let_go(3, clock.now) == (None, None)


def test_a_checker_declared_after_its_first_probes_takes_the_declaration() -> None:
    """The kubelet probes before --kubernetes has read the pod (a second or so after
    start): its record takes the threshold once declared, and is released with it."""
    clock = Clock()
    checkers = clock.checkers()
    probe_every(clock, checkers, KUBELET, 3)
    checkers.expect("kube-probe/", failures=1, period_s=1.0)
    clock.requested = clock.now
    assert checkers.pending(3) == "10.0.0.1 kube-probe/1.31 0/1"
    checkers.release_declared()
    assert checkers.let_go(3, clock.now) == (None, None)


def test_checkers_are_told_apart_by_address_and_user_agent() -> None:
    clock = Clock()
    checkers = clock.checkers()
    for second in range(1, 7):  # the kubelet every second, Consul every two
        clock.now += 1.0
        checkers.answered("10.0.0.1", "kube-probe/1.31", 200)
        if second % 2 == 0:
            checkers.answered("10.0.0.1", "Consul Health Check", 200)
    clock.requested = clock.now
    for second in range(1, 4):
        clock.now += 1.0
        checkers.answered("10.0.0.1", "kube-probe/1.31", 503)
        if second % 2 == 0:
            checkers.answered("10.0.0.1", "Consul Health Check", 503)
    assert checkers.let_go(3, clock.now)[0] is None  # Consul has seen one failure
    assert checkers.pending(3) == "10.0.0.1 Consul Health Check 1/3"


def test_threshold_zero_waits_for_no_checker() -> None:
    clock = Clock()
    checkers = clock.checkers()
    probe_every(clock, checkers, HAPROXY, 3)
    clock.requested = clock.now
    assert checkers.let_go(0, clock.now) == (None, None)


def test_checkers_remembered_are_bounded_and_one_offs_go_first() -> None:
    """A flood of one-off user agents (a crawler, anyone who reaches /readyz) neither
    grows the process nor evicts the balancer that has been probing."""
    clock = Clock()
    checkers = clock.checkers()
    probe_every(clock, checkers, HAPROXY, 3)
    for n in range(1000):
        checkers.answered("10.0.0.9", f"made-up/{n}", 200)
    assert len(checkers._checkers) == 64
    assert ("10.0.0.7", "") in checkers._checkers
    clock.requested = clock.now
    checkers.answered("10.0.0.9", "new-after-the-request/1", 503)  # not recorded
    assert ("10.0.0.9", "new-after-the-request/1") not in checkers._checkers
    assert checkers.let_go(3, clock.now)[0] is None  # the balancer is still waited for


def test_a_checker_answered_ready_after_the_request_is_not_waited_for() -> None:
    """readiness-on-shutdown keep: 200 while accepting, so the checker never fails."""
    clock = Clock()
    checkers = clock.checkers()
    probe_every(clock, checkers, HAPROXY, 3)
    clock.requested = clock.now
    assert checkers.let_go(3, clock.now)[1] is not None
    clock.now += 2.0
    checkers.answered(*HAPROXY, 200)
    assert checkers.let_go(3, clock.now) == (None, None)


def test_accept_until_idle_starts_its_idle_window_when_the_checkers_let_go() -> None:
    policy = AcceptUntilIdle(idle_s=2.0)
    waiting = policy.decide(PolicyInput(now=10.0, requested_at=0.0, health_checks_recheck_at=12.0))
    assert not waiting.stop_accepting
    assert waiting.reason == "waiting for health checkers to fail"
    assert waiting.recheck_at == 12.0
    released = PolicyInput(now=7.0, requested_at=0.0, health_checks_failed_at=6.0)
    assert policy.decide(released).recheck_at == 8.0
    done = PolicyInput(now=8.0, requested_at=0.0, health_checks_failed_at=6.0)
    assert policy.decide(done).stop_accepting
    # Zero: health checkers are not waited for; the window starts at the request.
    assert (
        AcceptUntilIdle(idle_s=2.0, readiness_failures=0)
        .decide(PolicyInput(now=10.0, requested_at=0.0, health_checks_recheck_at=12.0))
        .stop_accepting
    )


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, ValueError), (True, TypeError), (2.5, TypeError), ("3", TypeError)],
)
def test_bad_readiness_failures_are_named(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"readiness_failures must be an int >= 0, got .*"):
        AcceptUntilIdle(readiness_failures=value)  # type: ignore[arg-type]


def test_the_kubelet_not_declared_is_waited_for_and_the_log_says_how_to_stop_that() -> None:
    """Without --kubernetes graceful cannot tell a deletion (the endpoint goes at once)
    from a SIGTERM without one (only the failed probes take it out): it waits, and says
    so."""
    clock = Clock()
    checkers = clock.checkers()
    probe_every(clock, checkers, KUBELET, 3)
    clock.requested = clock.now
    assert checkers.let_go(3, clock.now)[0] is None
    assert checkers.pending(3) == (
        "10.0.0.1 kube-probe/1.31 0/3; the kubelet's probes: --kubernetes stops waiting "
        "for them at a deletion"
    )


def test_a_hold_is_waited_for_until_released_and_counts_from_then() -> None:
    """A --workers worker whose parent answers the probes: it holds until the parent's
    word (a signal handler: a flag only), then the idle window counts from when the
    release was seen."""
    clock = Clock()
    checkers = clock.checkers()
    checkers.hold("the parent's checkers")
    assert checkers.held == "the parent's checkers"
    clock.requested = clock.now
    released, recheck = checkers.let_go(3, clock.now)
    assert released is None
    assert recheck == clock.now + 0.25
    assert checkers.pending(3) == "the parent's checkers"
    clock.now += 5.0
    checkers.release_held()
    assert checkers.let_go(3, clock.now) == (clock.now, None)
    assert checkers.let_go(3, clock.now + 1.0) == (clock.now, None)  # the first look


def test_a_ready_answer_decided_before_the_request_but_reported_after_is_a_probe() -> None:
    """WSGI decides in its thread and reports in the coordinator's: a 200 decided before
    SIGTERM must not count as the checker kept ready after it."""
    clock = Clock()
    checkers = clock.checkers()
    probe_every(clock, checkers, HAPROXY, 3)
    clock.requested = clock.now
    checkers.answered(*HAPROXY, 200, False)  # decided before, reported after
    assert checkers.let_go(3, clock.now)[1] is not None  # still waited for
    checkers.answered(*HAPROXY, 200, True)  # decided after: kept ready
    assert checkers.let_go(3, clock.now) == (None, None)
