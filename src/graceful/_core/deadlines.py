"""Deadlines as data: pure functions from a few numbers to the times everything must end.

Why a module of its own
-----------------------
Every time limit of a shutdown derives from one fact — when SIGKILL lands — and a few
budgets.  Keeping the arithmetic here, free of clocks and I/O, lets the tests check it on
plain numbers (like ``graceful._core.policy``) and lets every adapter and the coordinator
agree on one answer.  All times are floats in seconds on the coordinator's clock.

The timeline of one shutdown::

    requested ──accepting──▶ accept_by ──draining──▶ stop_by ──stopping──▶ exit_by ▶ out ▶ kill
                                                     │◀─ stop budget ─▶│        │◀─ margin ─▶│
                                                     │◀────────── 2 * kill_margin_s ───────▶│

* ``kill``: when SIGKILL lands.  Known absolutely (Kubernetes' ``deletionTimestamp``,
  ``ShutdownCoordinator.set_kill_deadline``) or as ``requested + grace_period_s``.
  With neither, Kubernetes' default grace period (30 s) is assumed — a pod with the
  default configuration is killed then, so accepting or draining past it only loses
  work — and the coordinator warns once.
* ``out = kill - kill_margin_s``: the promise.  A process that owns its exit
  (``hard_exit``) is gone by then, whatever the application does: the margin absorbs
  what no clock here sees — a signal relayed late (gunicorn's master counts its
  ``--graceful-timeout`` from its own SIGTERM), a loaded machine, the interpreter's exit.
* ``exit_by = out - exit_margin(kill_margin_s)``: the last stopping step ends here; the
  hard exit fires half the exit margin later, so that stopping's own timeouts (at
  ``exit_by``) report what they abandoned first.
* ``stop_by = kill - 2 * kill_margin_s``: stopping begins at the latest here.  Its
  budget up to ``exit_by`` (``kill_margin_s - exit_margin``: 0.75 s by default) is shared
  by cutting what is left, the ASGI lifespan shutdown and the ``STOPPING`` hooks, in that
  order.  Hooks of earlier phases that still run at ``stop_by`` are cancelled; they never
  eat into it.
* ``accept_by``: the latest end of accepting that leaves draining the time it needs.
  That need is *measured*: the longest request to expect (``graceful._core.tracking``: the
  longest measured, or the age of the oldest still running) times a safety factor, at
  least ``MIN_DRAIN_BUDGET_S``.  It is bounded by the conservative rule that applies
  before anything was measured: the drain timeout, but at most half of what is left
  before ``stop_by``.  The plan at the shutdown request is a promise (the log's
  "accepting at most X s"): the engine lets later measurements end accepting sooner,
  never later.  So serve-until-killed with a 30 s grace period and 0.1 s requests
  measured before the SIGTERM accepts until 27 s; with nothing measured, 14 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from typing_extensions import final

__all__ = (
    "DEFAULT_GRACE_PERIOD_S",
    "Deadlines",
    "DRAIN_SAFETY_FACTOR",
    "MIN_DRAIN_BUDGET_S",
    "accept_by",
    "drain_budget",
    "drain_by",
    "exit_margin",
    "plan",
    "wall_to_loop",
)

#: Kubernetes' default ``terminationGracePeriodSeconds``, assumed when none is known.
DEFAULT_GRACE_PERIOD_S: Final = 30.0


def exit_margin(kill_margin_s: float) -> float:
    """Seconds between the end of stopping (``exit_by``) and the promised exit
    (``kill - kill_margin_s``): a quarter of the margin, ≤ 0.25 s.

    The hard exit fires halfway; the rest is for the interpreter to exit and the kernel
    to close sockets.
    """
    return min(0.25, kill_margin_s / 4)


#: The drain budget is this many times the longest recent request.
DRAIN_SAFETY_FACTOR: Final = 3.0
#: The drain budget is never shorter than this (connections in the backlog, a slow client).
MIN_DRAIN_BUDGET_S: Final = 1.0


def drain_budget(
    *, longest_request_s: float | None, drain_timeout_s: float, time_to_stop_s: float
) -> float:
    """Seconds to keep for draining before ``stop_by`` (see the module docs)."""
    time_to_stop_s = max(0.0, time_to_stop_s)
    if longest_request_s is None:
        return min(drain_timeout_s, time_to_stop_s / 2)
    wanted = max(MIN_DRAIN_BUDGET_S, DRAIN_SAFETY_FACTOR * longest_request_s)
    # Never more than the unmeasured rule keeps: requests too long to fit are cut at the
    # deadline either way, and accepting must not end the moment one is measured.
    return min(drain_timeout_s, time_to_stop_s / 2, wanted)


def accept_by(
    *,
    requested_at: float,
    stop_by: float,
    drain_timeout_s: float,
    longest_request_s: float | None = None,
) -> float:
    """The latest end of accepting that leaves draining its budget
    (``drain_budget``)."""
    return stop_by - drain_budget(
        longest_request_s=longest_request_s,
        drain_timeout_s=drain_timeout_s,
        time_to_stop_s=stop_by - requested_at,
    )


def drain_by(*, draining_at: float, drain_timeout_s: float, stop_by: float) -> float:
    """When draining must end: its timeout, or ``stop_by`` if that comes first."""
    return min(draining_at + drain_timeout_s, stop_by)


def wall_to_loop(wall_s: float, *, wall_now: float, loop_now: float) -> float:
    """A wall-clock time (``time.time()`` seconds) on the loop's monotonic clock."""
    return loop_now + (wall_s - wall_now)


@final
@dataclass(frozen=True, slots=True)
class Deadlines:
    """The deadlines of one shutdown, on the coordinator's clock.

    Attributes:
        kill: When SIGKILL lands.
        kill_source: Where ``kill`` came from (``"grace period 30 s"``, ``"pod"``, …).
        assumed: ``True`` when no grace period was known and the default was assumed.
        stop_by: Stopping begins at the latest here (``kill - 2 * kill_margin_s``).
        exit_by: Stopping ends here; the hard exit, if enabled, fires half the exit
            margin later, and the process is gone by ``kill - kill_margin_s``.
        accept_by: The latest end of accepting.
    """

    kill: float
    kill_source: str
    assumed: bool
    stop_by: float
    exit_by: float
    accept_by: float

    @property
    def stop_budget_s(self) -> float:
        """Seconds stopping may take: ``exit_by - stop_by``."""
        return self.exit_by - self.stop_by


def plan(
    *,
    requested_at: float,
    grace_period_s: float | None,
    kill_at: float | None,
    kill_source: str | None,
    drain_timeout_s: float,
    kill_margin_s: float,
    longest_request_s: float | None = None,
) -> Deadlines:
    """The deadlines for a shutdown requested at ``requested_at``.

    Args:
        requested_at: When shutdown was first requested.
        grace_period_s: Seconds from the request to SIGKILL, if configured.
        kill_at: An absolute kill time (wins over ``grace_period_s``), if known.
        kill_source: Where ``kill_at`` came from, for the log.
        drain_timeout_s: The longest drain.
        kill_margin_s: The process is gone this long before SIGKILL; stopping begins
            twice this long before it (see the module docs).
        longest_request_s: The longest recent request, if measured.
    """
    assumed = False
    if kill_at is not None:
        kill, source = kill_at, kill_source or "set by the application"
    elif grace_period_s is not None:
        kill, source = requested_at + grace_period_s, f"grace period {grace_period_s:g} s"
    else:
        kill = requested_at + DEFAULT_GRACE_PERIOD_S
        source, assumed = f"assumed default grace period {DEFAULT_GRACE_PERIOD_S:g} s", True
    stop = max(requested_at, kill - 2 * kill_margin_s)
    exit_ = max(stop, kill - kill_margin_s - exit_margin(kill_margin_s))
    return Deadlines(
        kill=kill,
        kill_source=source,
        assumed=assumed,
        stop_by=stop,
        exit_by=exit_,
        accept_by=accept_by(
            requested_at=requested_at,
            stop_by=stop,
            drain_timeout_s=drain_timeout_s,
            longest_request_s=longest_request_s,
        ),
    )
