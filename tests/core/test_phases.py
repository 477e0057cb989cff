"""The phase table (graceful._core.phases) on plain values: no clock, no loop, no coordinator.

Small tables first (each rule of the escalation ladder), then every sequence of up to
four events, checked against what the module docs promise: phases only move forward,
only an escalation or ``immediate`` reaches STOPPING from a request, a third escalating
request asks for an exit, non-escalating requests never escalate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from graceful import Phase
from graceful._core.phases import PhaseTable, RequestOutcome, Transition


def request(
    table: PhaseTable,
    reason: str = "r",
    *,
    escalate: bool = True,
    immediate: bool = False,
    drain_now: bool = False,
) -> RequestOutcome:
    return table.request_shutdown(
        reason, escalate=escalate, immediate=immediate, drain_now=drain_now
    )


def test_a_new_table_is_serving() -> None:
    table = PhaseTable()
    assert (table.phase, table.requests) == (Phase.SERVING, 0)


def test_first_request_starts_accepting() -> None:
    table = PhaseTable()
    assert request(table, "SIGTERM") == RequestOutcome((Transition(Phase.ACCEPTING, "SIGTERM"),))
    assert (table.phase, table.requests) == (Phase.ACCEPTING, 1)


def test_drain_now_goes_through_accepting_to_draining() -> None:
    table = PhaseTable()
    outcome = request(table, "max requests", drain_now=True)
    assert outcome.transitions == (
        Transition(Phase.ACCEPTING, "max requests"),
        Transition(Phase.DRAINING, "max requests (no accepting period)"),
    )
    assert not outcome.exit_now
    assert not outcome.ignored
    assert table.phase is Phase.DRAINING


def test_second_escalating_request_stops() -> None:
    table = PhaseTable()
    request(table, "SIGTERM")
    outcome = request(table, "SIGINT")
    assert outcome == RequestOutcome((Transition(Phase.STOPPING, "SIGINT (escalated)"),))
    assert table.phase is Phase.STOPPING


def test_second_escalating_request_stops_from_draining_too() -> None:
    table = PhaseTable()
    request(table, "SIGTERM", drain_now=True)
    assert request(table, "SIGINT").transitions == (
        Transition(Phase.STOPPING, "SIGINT (escalated)"),
    )


@pytest.mark.parametrize("repeats", [1, 2, 5])
def test_non_escalating_requests_never_escalate(repeats: int) -> None:
    table = PhaseTable()
    first = request(table, "preStop", escalate=False)
    assert first.transitions == (Transition(Phase.ACCEPTING, "preStop"),)
    for _ in range(repeats):
        again = request(table, "preStop", escalate=False)
        assert again == RequestOutcome((), ignored=True)
        assert again.exit_now is False
    assert (table.phase, table.requests) == (Phase.ACCEPTING, 1)


def test_non_escalating_first_request_counts_once() -> None:
    """The kubelet's SIGTERM after the preStop hook returned is the second request."""
    table = PhaseTable()
    request(table, "preStop", escalate=False)
    request(table, "preStop", escalate=False)
    assert request(table, "SIGTERM").transitions == (
        Transition(Phase.STOPPING, "SIGTERM (escalated)"),
    )


def test_immediate_from_serving_stops_without_accepting() -> None:
    table = PhaseTable()
    outcome = request(table, "SIGQUIT", immediate=True)
    assert outcome == RequestOutcome((Transition(Phase.STOPPING, "SIGQUIT (escalated)"),))
    assert table.phase is Phase.STOPPING


def test_immediate_without_escalate_still_stops() -> None:
    table = PhaseTable()
    request(table, "preStop", escalate=False)
    assert request(table, "quick", escalate=False, immediate=True).transitions == (
        Transition(Phase.STOPPING, "quick (escalated)"),
    )


def test_immediate_when_already_stopping_is_ignored() -> None:
    table = PhaseTable()
    request(table, "SIGQUIT", immediate=True)
    assert request(table, "SIGQUIT", immediate=True) == RequestOutcome((), ignored=True)


def test_third_escalating_request_asks_to_exit() -> None:
    table = PhaseTable()
    request(table, "SIGTERM")
    request(table, "SIGINT")
    outcome = request(table, "SIGINT")
    assert outcome == RequestOutcome((), exit_now=True)
    assert table.phase is Phase.STOPPING  # the table itself does not move
    assert request(table, "SIGINT").exit_now  # and every later one asks again


def test_third_request_once_stopped_does_not_ask_to_exit() -> None:
    table = PhaseTable()
    request(table, "SIGTERM")
    request(table, "SIGINT")
    assert table.advance(Phase.STOPPED, "shutdown complete") is not None
    assert request(table, "SIGINT") == RequestOutcome((), exit_now=False)


def test_advance_moves_forward_only() -> None:
    table = PhaseTable()
    assert table.advance(Phase.DRAINING, "policy") == Transition(Phase.DRAINING, "policy")
    assert table.advance(Phase.DRAINING, "again") is None
    assert table.advance(Phase.ACCEPTING, "back") is None
    assert table.advance(Phase.SERVING, "back") is None
    assert table.phase is Phase.DRAINING
    assert table.advance(Phase.STOPPED, "done") == Transition(Phase.STOPPED, "done")


def test_transitions_are_frozen_values() -> None:
    step = Transition(Phase.ACCEPTING, "x")
    assert step == Transition(Phase.ACCEPTING, "x")
    with pytest.raises(AttributeError):
        step.phase = Phase.STOPPED  # type: ignore[misc]


# ----------------------------------------------------------- every short sequence


@dataclass(frozen=True)
class Request:
    escalate: bool
    immediate: bool
    drain_now: bool


@dataclass(frozen=True)
class Advance:
    phase: Phase


Event = Request | Advance

EVENTS: tuple[Event, ...] = (
    *(Request(e, i, d) for e, i, d in itertools.product((False, True), repeat=3)),
    *(Advance(p) for p in (Phase.DRAINING, Phase.STOPPING, Phase.STOPPED)),
)


@pytest.mark.parametrize("length", [1, 2, 3, 4])
def test_every_short_sequence_keeps_the_rules(length: int) -> None:
    for sequence in itertools.product(EVENTS, repeat=length):
        check_sequence(sequence)


def check_sequence(sequence: tuple[Event, ...]) -> None:
    table = PhaseTable()
    announced = [Phase.SERVING]
    escalating = 0  # requests counted towards escalation, as the docs define them
    for n, event in enumerate(sequence):
        before = table.phase
        if isinstance(event, Advance):
            step = table.advance(event.phase, "event")
            steps: tuple[Transition, ...] = () if step is None else (step,)
            assert (step is None) == (event.phase <= before), sequence
        else:
            if event.escalate or escalating == 0:
                escalating += 1
            outcome = request(
                table,
                f"req{n}",
                escalate=event.escalate,
                immediate=event.immediate,
                drain_now=event.drain_now,
            )
            steps = outcome.transitions
            assert table.requests == escalating, sequence
            stops = [s for s in steps if s.phase is Phase.STOPPING]
            if stops:
                # only an escalation reaches STOPPING from a request
                assert event.immediate or (event.escalate and escalating == 2), sequence
                assert stops[0].reason == f"req{n} (escalated)"
            if outcome.exit_now:
                assert event.escalate, sequence
                assert escalating >= 3, sequence
                assert not event.immediate, sequence
                assert before < Phase.STOPPED
            if escalating >= 3 and event.escalate and not event.immediate:
                assert outcome.exit_now == (before < Phase.STOPPED), sequence
            if not event.escalate and not event.immediate:
                # a non-escalating request only ever starts the shutdown
                assert all(s.phase <= Phase.DRAINING for s in steps), sequence
                assert not outcome.exit_now
            if before is Phase.SERVING and not event.immediate and escalating == 1:
                expected = [Phase.ACCEPTING] + ([Phase.DRAINING] if event.drain_now else [])
                assert [s.phase for s in steps] == expected, sequence
            if outcome.ignored:
                assert not steps, sequence
                assert not outcome.exit_now, sequence
            elif not steps and not outcome.exit_now:
                # nothing happened and it says so, except a late third request
                assert event.escalate, sequence
                assert escalating >= 3, sequence
        for step in steps:
            assert step.phase > announced[-1], sequence  # never backwards, never twice
            announced.append(step.phase)
        assert table.phase is announced[-1], sequence
