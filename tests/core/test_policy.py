"""The policies' decisions, on plain numbers: no clock, no sockets."""

from __future__ import annotations

import math

import pytest

from graceful import (
    AcceptUntilIdle,
    Decision,
    PolicyInput,
    RefuseImmediately,
    ServeUntilKilled,
    policy_from_name,
)

T0 = 1000.0  # the shutdown request


def inp(now: float, **kw: float | None) -> PolicyInput:
    return PolicyInput(now=T0 + now, requested_at=T0, **kw)  # type: ignore[arg-type]


class TestAcceptUntilIdle:
    policy = AcceptUntilIdle(idle_s=2.0, min_wait_s=0.0, max_wait_s=30.0)

    def test_quiet_server_stops_after_idle_window(self) -> None:
        assert self.policy.decide(inp(0.0)) == Decision(
            False, "new connections may still arrive", T0 + 2.0
        )
        assert self.policy.decide(inp(1.999)).stop_accepting is False
        assert self.policy.decide(inp(2.0)).stop_accepting is True

    def test_connection_before_request_does_not_shorten_window(self) -> None:
        d = self.policy.decide(inp(1.0, last_connection_at=T0 - 50))
        assert d.stop_accepting is False
        assert d.recheck_at == T0 + 2.0

    def test_each_connection_restarts_window(self) -> None:
        d = self.policy.decide(inp(2.0, last_connection_at=T0 + 1.5))
        assert d.stop_accepting is False
        assert d.recheck_at == T0 + 3.5
        assert self.policy.decide(inp(3.5, last_connection_at=T0 + 1.5)).stop_accepting

    def test_connection_exactly_at_idle_boundary_restarts_window(self) -> None:
        d = self.policy.decide(inp(2.0, last_connection_at=T0 + 2.0))
        assert d.stop_accepting is False
        assert d.recheck_at == T0 + 4.0

    def test_max_wait_reached_while_connections_keep_arriving(self) -> None:
        d = self.policy.decide(inp(29.9, last_connection_at=T0 + 29.8))
        assert d.stop_accepting is False
        assert d.recheck_at == T0 + 30.0  # capped by max_wait, not 31.8
        d = self.policy.decide(inp(30.0, last_connection_at=T0 + 29.99))
        assert d.stop_accepting is True
        assert "max_wait_s=30" in d.reason

    def test_min_wait_holds_accepting_open(self) -> None:
        policy = AcceptUntilIdle(idle_s=1.0, min_wait_s=5.0, max_wait_s=30.0)
        d = policy.decide(inp(1.0))
        assert d.stop_accepting is False
        assert d.recheck_at == T0 + 5.0
        assert policy.decide(inp(5.0)).stop_accepting

    def test_kill_deadline_earlier_than_max_wait(self) -> None:
        kw = {"accept_deadline": T0 + 10.0, "last_connection_at": T0 + 9.5}
        d = self.policy.decide(inp(9.9, **kw))
        assert d.recheck_at == T0 + 10.0
        d = self.policy.decide(inp(10.0, **kw))
        assert d.stop_accepting is True
        assert d.reason == "kill deadline approaching"

    def test_min_wait_longer_than_grace_period_yields_to_kill_deadline(self) -> None:
        policy = AcceptUntilIdle(idle_s=1.0, min_wait_s=60.0, max_wait_s=120.0)
        d = policy.decide(inp(5.0, accept_deadline=T0 + 14.5))
        assert d.stop_accepting is False
        assert d.recheck_at == T0 + 14.5
        assert policy.decide(inp(14.5, accept_deadline=T0 + 14.5)).stop_accepting

    def test_waits_for_endpoint_removal_then_idle(self) -> None:
        policy = AcceptUntilIdle(idle_s=2.0, max_wait_s=30.0, wait_for_endpoint_removal=True)
        d = policy.decide(inp(10.0))
        assert (d.stop_accepting, d.recheck_at) == (False, T0 + 30.0)
        assert d.reason == "waiting for endpoint removal"
        d = policy.decide(inp(11.0, endpoint_removed_at=T0 + 10.0))
        assert d.recheck_at == T0 + 12.0
        assert policy.decide(inp(12.0, endpoint_removed_at=T0 + 10.0)).stop_accepting
        assert policy.decide(inp(30.0)).stop_accepting

    def test_zero_idle_stops_at_once(self) -> None:
        assert AcceptUntilIdle(idle_s=0).decide(inp(0.0)).stop_accepting


class TestServeUntilKilled:
    def test_never_stops_without_deadlines(self) -> None:
        d = ServeUntilKilled().decide(inp(1e6))
        assert d == Decision(False, "serving until killed", None)

    def test_stops_at_max_wait(self) -> None:
        policy = ServeUntilKilled(max_wait_s=5.0)
        assert policy.decide(inp(4.0)).recheck_at == T0 + 5.0
        assert policy.decide(inp(5.0)).stop_accepting

    def test_stops_cleanly_before_kill_deadline(self) -> None:
        d = ServeUntilKilled().decide(inp(3.0, accept_deadline=T0 + 14.5))
        assert d.recheck_at == T0 + 14.5
        assert ServeUntilKilled().decide(inp(14.5, accept_deadline=T0 + 14.5)).stop_accepting

    def test_does_not_nudge_by_default(self) -> None:
        assert ServeUntilKilled().nudge_clients is False
        assert ServeUntilKilled(nudge_clients=True).nudge_clients is True


def test_refuse_immediately_stops_at_once() -> None:
    assert RefuseImmediately().decide(inp(0.0)).stop_accepting


@pytest.mark.parametrize("value", [-1, -0.001, math.nan, math.inf, -math.inf, "3", True])
@pytest.mark.parametrize("name", ["idle_s", "min_wait_s", "max_wait_s"])
def test_accept_until_idle_rejects_bad_durations(name: str, value: object) -> None:
    error = TypeError if isinstance(value, (str, bool)) else ValueError
    with pytest.raises(error, match=rf"{name} must be a finite number of seconds >= 0, got"):
        AcceptUntilIdle(**{name: value})  # type: ignore[arg-type]


def test_min_wait_above_max_wait_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"min_wait_s \(10\) must not exceed max_wait_s \(5\)"):
        AcceptUntilIdle(min_wait_s=10, max_wait_s=5)


def test_serve_until_killed_rejects_bad_max_wait() -> None:
    with pytest.raises(ValueError, match=r"max_wait_s must be .* or None, got nan"):
        ServeUntilKilled(max_wait_s=math.nan)


def test_policies_are_immutable() -> None:
    policy = AcceptUntilIdle()
    with pytest.raises(AttributeError):
        policy.idle_s = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("accept-until-idle", AcceptUntilIdle),
        ("ACCEPT_UNTIL_IDLE", AcceptUntilIdle),
        ("serve-until-killed", ServeUntilKilled),
        (" refuse-immediately ", RefuseImmediately),
    ],
)
def test_policy_from_name(name: str, cls: type) -> None:
    assert type(policy_from_name(name)) is cls


def test_policy_from_name_passes_options() -> None:
    assert policy_from_name("accept-until-idle", idle_s=3, max_wait_s=9) == AcceptUntilIdle(
        idle_s=3, max_wait_s=9
    )


def test_unknown_policy_name_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'drain-slowly'; expected one of "):
        policy_from_name("drain-slowly")


def test_option_that_does_not_apply_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"idle_s=3 does not apply to policy 'refuse-immediately'"):
        policy_from_name("refuse-immediately", idle_s=3)
