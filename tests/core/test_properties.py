"""Property-based tests (hypothesis): random shutdowns on trio's virtual clock.

A scenario is a coordinator configuration and a random sequence of what adapters and
operators do — connections opened and closed, requests and sessions started and ended,
shutdown requests with random flags, a kill deadline learnt late, time passing.  It runs
on ``MockClock(autojump_threshold=0)``, so deadlines fire exactly when due and a scenario
spanning minutes takes milliseconds.  Every phase change is recorded as it is announced,
and the record must satisfy what the module docs promise:

* phases only move forward, and every scenario reaches STOPPED;
* draining never ends while a connection, request or session is still counted, unless
  its deadline passed or an escalation cut it short;
* stopping begins no later than ``deadlines.stop_by`` (or at once, when a kill deadline
  learnt late is already behind us), and with nothing to run it ends at once;
* the counts the coordinator reports are the adapters' counts.

The pure parts (the phase table, the deadline arithmetic) are checked directly.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graceful import (
    AcceptUntilIdle,
    Phase,
    Policy,
    RefuseImmediately,
    ServeUntilKilled,
    Session,
    ShutdownCoordinator,
)
from graceful._core.deadlines import plan
from graceful._core.phases import PhaseTable

trio = pytest.importorskip("trio")
trio_testing = pytest.importorskip("trio.testing")

EPSILON = 1e-6  # float rounding of "now + (deadline - now)" on the virtual clock

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# --------------------------------------------------------------------- the events


@dataclass(frozen=True)
class Open:
    pass


@dataclass(frozen=True)
class Close:
    pass


@dataclass(frozen=True)
class StartRequest:
    pass


@dataclass(frozen=True)
class EndRequest:
    pass


@dataclass(frozen=True)
class EnterSession:
    pass


@dataclass(frozen=True)
class ExitSession:
    pass


@dataclass(frozen=True)
class Activity:
    pass


@dataclass(frozen=True)
class Shutdown:
    escalate: bool
    immediate: bool
    drain_now: bool


@dataclass(frozen=True)
class KillDeadline:
    in_s: float


@dataclass(frozen=True)
class Sleep:
    seconds: float


Event = (
    Open
    | Close
    | StartRequest
    | EndRequest
    | EnterSession
    | ExitSession
    | Activity
    | Shutdown
    | KillDeadline
    | Sleep
)

seconds = st.floats(min_value=0, max_value=20, allow_nan=False, allow_infinity=False)
events = st.lists(
    st.one_of(
        st.sampled_from(
            [Open(), Close(), StartRequest(), EndRequest(), EnterSession(), ExitSession()]
        ),
        st.just(Activity()),
        st.builds(Shutdown, st.booleans(), st.booleans(), st.booleans()),
        st.builds(KillDeadline, st.floats(min_value=-5, max_value=60)),
        st.builds(Sleep, seconds),
        st.builds(Sleep, st.sampled_from([0.0, 0.5, 1.0, 2.0])),
    ),
    max_size=30,
)


@dataclass(frozen=True)
class Config:
    policy: Policy
    drain_timeout_s: float
    grace_period_s: float | None
    kill_margin_s: float

    def coordinator(self) -> ShutdownCoordinator:
        return ShutdownCoordinator(
            policy=self.policy,
            drain_timeout_s=self.drain_timeout_s,
            grace_period_s=self.grace_period_s,
            kill_margin_s=self.kill_margin_s,
        )


policies = st.one_of(
    st.builds(RefuseImmediately),
    st.builds(
        AcceptUntilIdle,
        idle_s=st.floats(0, 5),
        min_wait_s=st.just(0.0),
        max_wait_s=st.floats(5, 60),
    ),
    st.builds(ServeUntilKilled, max_wait_s=st.none() | st.floats(0, 60)),
)


@st.composite
def configs(draw: st.DrawFn) -> Config:
    margin = draw(st.floats(min_value=0.1, max_value=5))
    grace = draw(st.none() | st.floats(min_value=2 * margin + 0.1, max_value=100))
    return Config(
        policy=draw(policies),
        drain_timeout_s=draw(st.floats(min_value=0, max_value=60)),
        grace_period_s=grace,
        kill_margin_s=margin,
    )


# ---------------------------------------------------------------- the simulation


@dataclass(frozen=True)
class Seen:
    """One phase change, as a listener saw it."""

    phase: Phase
    at: float
    reason: str | None
    counts: tuple[int, int, int]  # connections, requests, sessions per the coordinator
    adapters: tuple[int, int, int]  # the same, as the adapters counted them
    in_request: bool  # announced from inside request_shutdown (an escalation)
    drain_time_left: float | None
    stop_by: float
    draining: bool


@dataclass
class World:
    """What the adapters know: their own counts."""

    connections: int = 0
    requests: list[float | None] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    in_request: bool = False
    replanned_at: list[float] = field(default_factory=list)

    def counts(self) -> tuple[int, int, int]:
        return self.connections, len(self.requests), len(self.sessions)


async def never() -> None:
    await trio.sleep_forever()


Outcome = tuple[list[Seen], ShutdownCoordinator, list[float]]


async def simulate(config: Config, script: list[Event]) -> Outcome:
    c = config.coordinator()
    world = World()
    seen: list[Seen] = []

    def listener(phase: Phase) -> None:
        s = c.statistics()
        d = c.deadlines
        assert d is not None
        seen.append(
            Seen(
                phase=phase,
                at=trio.current_time(),
                reason=s.reason,
                counts=(s.connections, s.requests, s.sessions),
                adapters=world.counts(),
                in_request=world.in_request,
                drain_time_left=c.drain_time_left(),
                stop_by=d.stop_by,
                draining=c.draining,
            )
        )

    c.subscribe(listener)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(c.run, shutdown_trigger=never))
        for event in script:
            await apply(c, world, event)
        if not c.shutdown_requested:
            await apply(c, world, Shutdown(escalate=True, immediate=False, drain_now=False))
        # whatever is still open is never closed: the deadlines must end the shutdown
        with trio.fail_after(1_000):
            assert await c.wait_for_phase(Phase.STOPPED)
        assert c.statistics().connections == world.connections
    return seen, c, world.replanned_at


async def apply(c: ShutdownCoordinator, world: World, event: Event) -> None:
    if isinstance(event, Open):
        world.connections += 1
        c.connection_opened()
    elif isinstance(event, Close) and world.connections:
        world.connections -= 1
        c.connection_closed()
    elif isinstance(event, StartRequest):
        world.requests.append(c.request_started())
    elif isinstance(event, EndRequest) and world.requests:
        c.request_finished(world.requests.pop(0))
    elif isinstance(event, EnterSession):
        session = c.track_session()
        world.sessions.append(session)
        session.__enter__()
    elif isinstance(event, ExitSession) and world.sessions:
        world.sessions.pop(0).__exit__(None, None, None)
    elif isinstance(event, Activity):
        c.report_activity()
    elif isinstance(event, Shutdown):
        world.in_request = True
        try:
            c.request_shutdown(
                "test",
                escalate=event.escalate,
                immediate=event.immediate,
                drain_now=event.drain_now,
            )
        finally:
            world.in_request = False
    elif isinstance(event, KillDeadline):
        c.set_kill_deadline(time.time() + event.in_s, source="test")
        if c.shutdown_requested:
            world.replanned_at.append(trio.current_time())
    elif isinstance(event, Sleep):
        await trio.sleep(event.seconds)
    # a checkpoint after every event: the coordinator reacts before the next one
    await trio.lowlevel.checkpoint()


def run_scenario(config: Config, script: list[Event]) -> Outcome:
    result: list[Outcome] = []

    async def main() -> None:
        result.append(await simulate(config, script))

    trio.run(main, clock=trio_testing.MockClock(autojump_threshold=0))
    return result[0]


@SETTINGS
@given(config=configs(), script=events)
def test_random_shutdowns_keep_the_promises(config: Config, script: list[Event]) -> None:
    seen, c, replanned_at = run_scenario(config, script)
    phases = [s.phase for s in seen]

    # Phases only move forward, and the shutdown always completes.
    assert phases == sorted(set(phases)), phases
    assert phases[-1] is Phase.STOPPED
    assert Phase.STOPPING in phases

    for s in seen:
        # The coordinator's counts are the adapters' counts.
        assert s.counts == s.adapters
        assert s.draining == (s.phase >= Phase.DRAINING)

    stopping = next(s for s in seen if s.phase is Phase.STOPPING)
    previous = phases[phases.index(Phase.STOPPING) - 1] if len(phases) > 1 else Phase.SERVING
    left = sum(stopping.counts)
    if previous is not Phase.DRAINING:
        # only an escalation skips draining
        assert stopping.in_request, stopping
    elif left:
        # draining ended with work left: its deadline passed, or an escalation
        assert stopping.in_request or stopping.drain_time_left == 0, stopping
        assert stopping.reason != "drained"
    if stopping.reason == "drained":
        assert left == 0

    # Stopping begins by stop_by, or at once when a late kill deadline moved it back.
    latest = max([stopping.stop_by, *replanned_at])
    assert stopping.at <= latest + EPSILON, (stopping, latest)
    draining = [s for s in seen if s.phase is Phase.DRAINING]
    if draining:
        assert draining[0].at <= max([draining[0].stop_by, *replanned_at]) + EPSILON

    # With no stopping steps or hooks, stopping takes no time at all.
    stopped = seen[-1]
    assert stopped.at == pytest.approx(stopping.at)
    d = c.deadlines
    assert d is not None
    assert stopped.at <= max([d.exit_by, *replanned_at]) + EPSILON


# ------------------------------------------------------------------ the pure parts


@SETTINGS
@given(
    script=st.lists(
        st.one_of(
            st.tuples(st.just("request"), st.booleans(), st.booleans(), st.booleans()),
            st.tuples(st.just("advance"), st.sampled_from([p for p in Phase if p > Phase.SERVING])),
        ),
        max_size=12,
    )
)
def test_phase_table_never_goes_backwards(script: list[tuple[object, ...]]) -> None:
    table = PhaseTable()
    phase = Phase.SERVING
    escalating = 0
    for step in script:
        if step[0] == "request":
            _, escalate, immediate, drain_now = step
            assert isinstance(escalate, bool)
            assert isinstance(immediate, bool)
            assert isinstance(drain_now, bool)
            if escalate or escalating == 0:
                escalating += 1
            outcome = table.request_shutdown(
                "r", escalate=escalate, immediate=immediate, drain_now=drain_now
            )
            transitions = outcome.transitions
            if outcome.exit_now:
                assert escalating >= 3
                assert escalate
            if not escalate and not immediate:
                assert all(t.phase <= Phase.DRAINING for t in transitions)
        else:
            target = step[1]
            assert isinstance(target, Phase)
            one = table.advance(target, "a")
            transitions = () if one is None else (one,)
        for t in transitions:
            assert t.phase > phase
            phase = t.phase
        assert table.phase is phase


finite = functools.partial(st.floats, allow_nan=False, allow_infinity=False)


@SETTINGS
@given(
    requested_at=finite(min_value=0, max_value=1e6),
    grace=st.none() | finite(min_value=0.2, max_value=1000),
    kill_in=st.none() | finite(min_value=-100, max_value=1000),
    drain=finite(min_value=0, max_value=600),
    margin=finite(min_value=0, max_value=10),
    longest=st.none() | finite(min_value=0, max_value=100),
)
def test_planned_deadlines_are_ordered(
    requested_at: float,
    grace: float | None,
    kill_in: float | None,
    drain: float,
    margin: float,
    longest: float | None,
) -> None:
    d = plan(
        requested_at=requested_at,
        grace_period_s=grace,
        kill_at=None if kill_in is None else requested_at + kill_in,
        kill_source=None,
        drain_timeout_s=drain,
        kill_margin_s=margin,
        longest_request_s=longest,
    )
    tolerance = 1e-9 * max(1.0, abs(requested_at))
    assert requested_at - tolerance <= d.accept_by <= d.stop_by <= d.exit_by
    assert d.exit_by <= max(d.kill, requested_at) + tolerance
    # the promise: stopping ends (and the hard exit fires) before kill - margin
    assert d.exit_by <= max(d.kill - margin, requested_at) + tolerance
    assert d.stop_by - d.accept_by <= drain + tolerance
    assert d.stop_budget_s >= 0
    assert d.assumed == (kill_in is None and grace is None)
    assert math.isfinite(d.kill)
