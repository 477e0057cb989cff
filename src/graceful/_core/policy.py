"""Shutdown phases and the policies that decide when *accepting* ends.

Why this module is pure
-----------------------
Everything that decides *when* the server stops accepting new connections lives here,
and nothing here does I/O or reads a clock.  A policy is a frozen value; its
``Policy.decide`` method is a function of a ``PolicyInput`` snapshot (which
contains ``now``) and returns a ``Decision``: either "stop accepting now, because …"
or "keep accepting and ask me again at time T".  The coordinator runs that function on
anyio; tests run it on plain numbers, so a 30 s window takes microseconds to check and
its edges (a connection exactly at the idle boundary, a kill deadline earlier than
``max_wait_s``) are exact.

Time is a float in seconds on the coordinator's clock (anyio's clock: the event loop's
monotonic time).  Only the *kill deadline* arrives from the outside; the coordinator turns
it into ``PolicyInput.accept_deadline``, the latest moment accepting may last so that
draining still fits before SIGKILL.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Final

from typing_extensions import final

__all__ = (
    "AcceptUntilIdle",
    "Decision",
    "Phase",
    "Policy",
    "PolicyInput",
    "RefuseImmediately",
    "ServeUntilKilled",
    "policy_from_name",
)


class Phase(enum.IntEnum):
    """The life of a server process, in order; a coordinator only ever moves forward.

    * ``SERVING``: normal operation.
    * ``ACCEPTING``: shutdown was requested; new connections are still accepted and
      served, the readiness endpoint fails, clients may be nudged away
      (``Connection: close``).
    * ``DRAINING``: the listener is closed (connections already in the kernel's accept
      backlog are still served); idle keep-alive connections are closed; in-flight
      requests finish; websockets and streams are asked to end.
    * ``STOPPING``: the drain finished, hit its deadline, or a second shutdown request
      arrived: remaining work is cancelled and shutdown hooks run.
    * ``STOPPED``: everything is done; the process may exit.
    """

    SERVING = 0
    ACCEPTING = 1
    DRAINING = 2
    STOPPING = 3
    STOPPED = 4

    def __str__(self) -> str:
        return self.name.lower()


@final
@dataclass(frozen=True, slots=True)
class PolicyInput:
    """What a policy may look at; all times in seconds on the coordinator's clock.

    Attributes:
        now: The current time.
        requested_at: When shutdown was first requested (signal, code or preStop).
        last_connection_at: When the most recent new connection arrived, or ``None``
            if none ever did.
        accept_deadline: The latest time accepting may last so that draining still ends
            before the kill deadline, or ``None`` when no kill deadline is known.
        endpoint_removed_at: When the pod was seen gone from its EndpointSlice, or
            ``None`` if that is not (yet) known.
        health_checks_failed_at: When every health checker that was probing readiness
            before the request had been answered enough 503s to mark this process down
            (see ``graceful._core.checkers``), or ``None``: none was probing, or one
            still may route here (then ``health_checks_recheck_at`` is set).
        health_checks_recheck_at: While a health checker is still waited for: when to
            look again if no probe comes (it may have gone quiet by then).
    """

    now: float
    requested_at: float
    last_connection_at: float | None = None
    accept_deadline: float | None = None
    endpoint_removed_at: float | None = None
    health_checks_failed_at: float | None = None
    health_checks_recheck_at: float | None = None


@final
@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer.

    Attributes:
        stop_accepting: ``True``: close the listener now and start draining.
        reason: Why, in a few words (it goes to the log).
        recheck_at: When to ask again if nothing else happens; ``None`` means only an
            event (endpoint removal, escalation) can change the answer.
    """

    stop_accepting: bool
    reason: str
    recheck_at: float | None = None


def _check_seconds(name: str, value: object) -> float:
    """Return ``value`` as float seconds, or raise naming ``name``.

    Raises:
        TypeError: not an ``int`` or ``float`` (``bool`` and strings included).
        ValueError: NaN, infinite or negative.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a finite number of seconds >= 0, got {type(value).__name__} {value!r}"
        )
    try:
        seconds = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}") from None
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def _check_count(name: str, value: object) -> int:
    """Return ``value`` if it is an ``int`` >= 0, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``, else raise a ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def _check_optional_seconds(name: str, value: object) -> float | None:
    """Like ``_check_seconds``, but ``None`` (no limit) is allowed too."""
    if value is None:
        return None
    try:
        return _check_seconds(name, value)
    except TypeError:
        raise TypeError(
            f"{name} must be a finite number of seconds >= 0 or None, got "
            f"{type(value).__name__} {value!r}"
        ) from None
    except ValueError:
        raise ValueError(
            f"{name} must be a finite number of seconds >= 0 or None, got {value!r}"
        ) from None


def _hard_end(inp: PolicyInput, max_wait_s: float | None) -> tuple[float, str]:
    """The time accepting must end at the latest, and why."""
    end, why = math.inf, ""
    if max_wait_s is not None:
        end, why = inp.requested_at + max_wait_s, f"max_wait_s={max_wait_s:g} reached"
    if inp.accept_deadline is not None and inp.accept_deadline < end:
        end, why = inp.accept_deadline, "kill deadline approaching"
    return end, why


class Policy(ABC):
    """Decides when the *accepting* phase ends.  Subclasses are frozen values.

    Attributes:
        name: The policy's name on the command line and in ``GRACEFUL_POLICY``.
        nudge_clients: Whether HTTP/1.1 responses carry ``Connection: close`` (and
            HTTP/2 connections get GOAWAY) already while *accepting*.  While draining,
            clients are always told to close.
    """

    name: ClassVar[str]
    nudge_clients: bool
    #: Accepting ends at the latest this long after the request (``None``: no limit).
    max_wait_s: float | None = None

    @abstractmethod
    def decide(self, inp: PolicyInput) -> Decision:
        """Return whether accepting ends at ``inp.now``, else when to ask again."""

    def describe(self) -> str:
        """The policy and its settings in a few words, for the start-up line."""
        return self.name


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ServeUntilKilled(Policy):
    """Keep serving normally until the process is killed.

    With a known kill deadline (``grace_period_s``) accepting still ends in time for a
    clean drain before SIGKILL; with ``max_wait_s`` it ends after that long.

    Args:
        nudge_clients: Send ``Connection: close`` while accepting, so keep-alive
            clients reconnect (through the load balancer, to another backend).
        max_wait_s: Stop accepting this long after the shutdown request (``None``: never).
    """

    name: ClassVar[str] = "serve-until-killed"
    nudge_clients: bool = False
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        _check_optional_seconds("max_wait_s", self.max_wait_s)
        _check_bool("nudge_clients", self.nudge_clients)

    def decide(self, inp: PolicyInput) -> Decision:
        """Accepting ends at ``max_wait_s`` or when draining must begin to fit before the
        kill deadline, whichever comes first; until then, serve."""
        end, why = _hard_end(inp, self.max_wait_s)
        if inp.now >= end:
            return Decision(True, why)
        return Decision(False, "serving until killed", None if math.isinf(end) else end)

    def describe(self) -> str:
        return self.name + ("" if self.max_wait_s is None else f" (at most {self.max_wait_s:g} s)")


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class AcceptUntilIdle(Policy):
    """Keep accepting until no new connection has arrived for ``idle_s`` seconds.

    The idle window starts at the shutdown request (or, with
    ``wait_for_endpoint_removal``, when the pod is seen gone from its EndpointSlice) and
    restarts at every new connection.  Accepting lasts at least ``min_wait_s`` and at most
    ``max_wait_s`` after the request, and never past the point where draining would no
    longer fit before the kill deadline.  A connection arriving exactly at the idle
    boundary restarts the window.

    Args:
        idle_s: The quiet period that shows load balancers stopped sending traffic.
        min_wait_s: Accept at least this long (e.g. the known propagation delay).
        max_wait_s: Accept at most this long, whatever the traffic.
        nudge_clients: Send ``Connection: close`` while accepting.
        wait_for_endpoint_removal: Start the idle window only once the pod has left its
            EndpointSlice (needs the Kubernetes integration to report it).
        readiness_failures: Start the idle window only once every health checker that
            was probing readiness before the request has been answered this many 503s
            in a row (what it needs to mark this process down: HAProxy's ``fall``,
            Kubernetes' ``failureThreshold``, a cloud balancer's unhealthy threshold), or
            has gone quiet; a checker declared with its own threshold (the pod's
            ``readinessProbe`` under ``--kubernetes``) uses that.  ``0``: do not wait
            for health checkers.  See ``graceful._core.checkers``.
    """

    name: ClassVar[str] = "accept-until-idle"
    idle_s: float = 2.0
    min_wait_s: float = 0.0
    max_wait_s: float = 30.0
    nudge_clients: bool = True
    wait_for_endpoint_removal: bool = False
    readiness_failures: int = 3

    def __post_init__(self) -> None:
        _check_seconds("idle_s", self.idle_s)
        _check_count("readiness_failures", self.readiness_failures)
        _check_seconds("min_wait_s", self.min_wait_s)
        _check_seconds("max_wait_s", self.max_wait_s)
        _check_bool("nudge_clients", self.nudge_clients)
        _check_bool("wait_for_endpoint_removal", self.wait_for_endpoint_removal)
        if self.min_wait_s > self.max_wait_s:
            raise ValueError(
                f"min_wait_s ({self.min_wait_s:g}) must not exceed max_wait_s ({self.max_wait_s:g})"
            )

    def decide(self, inp: PolicyInput) -> Decision:
        """Accepting ends once no new connection arrived for ``idle_s`` (counted from
        the request, or from the endpoint removal), after at least ``min_wait_s``; at
        the latest at ``max_wait_s`` or when draining must begin before the kill
        deadline."""
        hard, why = _hard_end(inp, self.max_wait_s)
        if inp.now >= hard:
            return Decision(True, why)
        if self.wait_for_endpoint_removal:
            if inp.endpoint_removed_at is None:
                return Decision(False, "waiting for endpoint removal", hard)
            window_start = inp.endpoint_removed_at
        else:
            window_start = inp.requested_at
        if self.readiness_failures:
            if inp.health_checks_recheck_at is not None:
                recheck = min(inp.health_checks_recheck_at, hard)
                return Decision(False, "waiting for health checkers to fail", recheck)
            if inp.health_checks_failed_at is not None:
                window_start = max(window_start, inp.health_checks_failed_at)
        last = window_start
        if inp.last_connection_at is not None and inp.last_connection_at > last:
            last = inp.last_connection_at
        end = max(last + self.idle_s, inp.requested_at + self.min_wait_s)
        if inp.now >= end:
            return Decision(True, f"no new connection for {inp.now - last:.3g} s")
        return Decision(False, "new connections may still arrive", min(end, hard))

    def describe(self) -> str:
        after = ", after endpoint removal" if self.wait_for_endpoint_removal else ""
        least = f", at least {self.min_wait_s:g} s" if self.min_wait_s else ""
        n = self.readiness_failures
        checks = "" if n == 3 else f", {n} readiness failures" if n else ", no health checkers"
        return (
            f"{self.name} (idle {self.idle_s:g} s{after}{least}{checks}, "
            f"at most {self.max_wait_s:g} s)"
        )


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class RefuseImmediately(Policy):
    """Stop accepting at once and drain in-flight work (stock servers' intent, done right:
    the accept backlog is served, in-flight requests finish, clients get a clean close)."""

    name: ClassVar[str] = "refuse-immediately"
    nudge_clients: bool = True

    def __post_init__(self) -> None:
        _check_bool("nudge_clients", self.nudge_clients)

    def decide(self, inp: PolicyInput) -> Decision:
        """Accepting ends at once."""
        return Decision(True, "policy refuses new connections immediately")


POLICIES: Final[dict[str, type[Policy]]] = {
    cls.name: cls for cls in (AcceptUntilIdle, RefuseImmediately, ServeUntilKilled)
}


def policy_from_name(
    name: str,
    *,
    idle_s: float | None = None,
    min_wait_s: float | None = None,
    max_wait_s: float | None = None,
    nudge_clients: bool | None = None,
    wait_for_endpoint_removal: bool | None = None,
    readiness_failures: int | None = None,
) -> Policy:
    """Build a policy from its command-line name and options (``None``: the default).

    Raises:
        TypeError: ``name`` is not a string, or an option has the wrong type.
        ValueError: for an unknown name, an option the policy does not take, or an
            invalid value; the message names the option, the value and what is allowed.
    """
    allowed = ", ".join(repr(n) for n in sorted(POLICIES))
    if not isinstance(name, str):
        raise TypeError(
            f"policy name must be a str, one of {allowed}, got {type(name).__name__} {name!r}"
        )
    key = name.strip().lower().replace("_", "-")
    cls = POLICIES.get(key)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; expected one of {allowed}")
    given = {
        "idle_s": idle_s,
        "min_wait_s": min_wait_s,
        "max_wait_s": max_wait_s,
        "nudge_clients": nudge_clients,
        "wait_for_endpoint_removal": wait_for_endpoint_removal,
        "readiness_failures": readiness_failures,
    }
    options = {k: v for k, v in given.items() if v is not None}
    takes = {
        AcceptUntilIdle: {
            "idle_s",
            "min_wait_s",
            "max_wait_s",
            "nudge_clients",
            "wait_for_endpoint_removal",
            "readiness_failures",
        },
        ServeUntilKilled: {"max_wait_s", "nudge_clients"},
        RefuseImmediately: set(),
    }[cls]
    for option in options:
        if option not in takes:
            raise ValueError(
                f"option {option}={options[option]!r} does not apply to policy {cls.name!r}"
                f" (it takes: {', '.join(sorted(takes)) or 'no options'})"
            )
    return cls(**options)


#: What readiness answers from the shutdown request on (see ``readiness_on_shutdown`` of
#: ``graceful.asgi.GracefulMiddleware``).
READINESS_ON_SHUTDOWN: Final = ("fail", "keep")


def _check_readiness_on_shutdown(value: object) -> str:
    if value not in READINESS_ON_SHUTDOWN:
        raise ValueError(f"readiness_on_shutdown must be 'fail' or 'keep', got {value!r}")
    return str(value)
