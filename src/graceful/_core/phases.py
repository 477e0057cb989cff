"""The phase machine: every rule that moves a coordinator from one phase to the next.

After h11's ``_state.py``: everything that affects a transition lives in this one table,
with no I/O, no clock and no callbacks, so it can be tested exhaustively on plain values.
The coordinator feeds it events (a shutdown request, "the policy stopped accepting",
"drained", "deadline", "stopping done") and *queues* the transitions it returns; the
queue is what keeps listeners and log lines in order when a listener itself requests a
shutdown (it enqueues STOPPING behind the ACCEPTING that is being announced).

Escalation
----------
The first shutdown request starts ``ACCEPTING`` (or goes on to ``DRAINING`` with
``drain_now``).  A second *escalating* request, or any ``immediate`` one (SIGQUIT),
goes to ``STOPPING``.  A third escalating request asks for an immediate exit, which the
coordinator honours only if the application opted in (``exit_on_third_request``).
Non-escalating requests (the preStop endpoint asking again) never escalate.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing_extensions import final

from .policy import Phase

__all__ = ("PhaseTable", "RequestOutcome", "Transition")


@final
@dataclass(frozen=True, slots=True)
class Transition:
    """One phase change and why it happened."""

    phase: Phase
    reason: str


@final
@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What a shutdown request did.

    Attributes:
        transitions: The phase changes it causes, in order (possibly none).
        exit_now: A third escalating request: exit at once if the application allows.
        ignored: It changed nothing (the shutdown is already further along).
    """

    transitions: tuple[Transition, ...]
    exit_now: bool = False
    ignored: bool = False


@final
class PhaseTable:
    """The phase and the escalation count; methods return the transitions to announce."""

    __slots__ = ("phase", "requests")

    def __init__(self) -> None:
        self.phase = Phase.SERVING
        self.requests = 0

    def advance(self, phase: Phase, reason: str) -> Transition | None:
        """Move forward to ``phase``; ``None`` if already there or beyond."""
        if phase <= self.phase:
            return None
        self.phase = phase
        return Transition(phase, reason)

    def request_shutdown(
        self, reason: str, *, escalate: bool, immediate: bool, drain_now: bool
    ) -> RequestOutcome:
        """A shutdown request (signal, API call, preStop); see the module docs."""
        if escalate or self.requests == 0:
            self.requests += 1
        count = self.requests
        if immediate or (escalate and count == 2):
            step = self.advance(Phase.STOPPING, f"{reason} (escalated)")
            return RequestOutcome(() if step is None else (step,), ignored=step is None)
        if escalate and count >= 3:
            return RequestOutcome((), exit_now=self.phase < Phase.STOPPED)
        if self.phase is Phase.SERVING:
            steps = [self.advance(Phase.ACCEPTING, reason)]
            if drain_now:
                steps.append(self.advance(Phase.DRAINING, f"{reason} (no accepting period)"))
            return RequestOutcome(tuple(s for s in steps if s is not None))
        return RequestOutcome((), ignored=True)
