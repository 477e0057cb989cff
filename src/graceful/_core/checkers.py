"""Health checkers: who probes readiness, how often, and when they have let go.

A balancer that only health-checks — HAProxy (``inter 2s fall 3``), a cloud load
balancer's target health check, Consul, or the kubelet of a pod whose SIGTERM came without
a deletion (node shutdown, a failed liveness probe) or without the RBAC to watch its
EndpointSlice — stops routing to this process only once it has seen enough failed checks
in a row.  Until then it sends traffic, however sparse; an idle window alone can end
accepting between two of its requests.  The readiness endpoint answers 503 from the
shutdown request on: this module counts those answers per checker, and accept-until-idle
starts its idle window only once every checker that was probing before the request has
been answered as many 503s as it needs to mark the process down
(``AcceptUntilIdle.readiness_failures``, ``--readiness-failures``), or has gone quiet.

Who is a checker
----------------
A checker is who probes: the peer's address and the probe's ``User-Agent``
(``kube-probe/1.31``, ``ELB-HealthChecker/2.0``, ``GoogleHC/1.0``, ``Consul Health
Check``; HAProxy sends none by default), so that a node's kubelet and an agent on the same
address are told apart.  It counts only when it was probing *regularly* before the
request: at least two probes (its period is learned from them: the median gap), the last
within three periods of the request — a script that polled readiness once at start-up,
or a test waiting for the server, is not a balancer.  A checker can also be *declared*
with its threshold and period (``expect``): ``--kubernetes`` declares the kubelet's
``readinessProbe`` (``failureThreshold``, ``periodSeconds``) and releases it once the pod
left its EndpointSlice — then Kubernetes itself no longer routes here.

When a checker has let go
-------------------------
Once it has been answered its threshold of 503s since the request (the time of that
answer), or once it has not probed for two of its periods (it stopped checking: its
balancer let go or is gone; a checker that marked a backend down keeps probing it, to see
it come back).  One answered 200 after the request (``--readiness-on-shutdown keep``
while accepting, or a pod still served by other workers) is not told to let go at all:
it is not waited for.  Who first probes after the request is not recorded; when more
than 64 are remembered, the one with the fewest probes is forgotten (a crawler's one-off
requests before a balancer that has probed for a while).  Two checkers on one address
with one ``User-Agent`` are one to graceful: the faster one's failures count for both —
give each its own ``User-Agent`` (HAProxy: ``http-check send hdr User-Agent …``).  The
kill deadline and ``max_wait_s`` still bound the wait.

Several worker processes behind one port each see their share of the probes; each waits
for its own count (longer, never shorter, than the checker needs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Final

__all__ = ("HealthCheckers",)

#: Probes remembered per checker (to learn its period), and checkers remembered at all:
#: a flood of made-up user agents must not grow the process.
_PROBES_KEPT: Final = 8
_CHECKERS_KEPT: Final = 64
_FAILURES_KEPT: Final = 64
#: How often a hold (``HealthCheckers.hold``) is looked at while waited for.
HELD_RECHECK_S: Final = 0.25
#: The kubelet's probes' ``User-Agent`` starts with this (``kube-probe/1.31``).
KUBELET_AGENT: Final = "kube-probe/"
#: A checker quiet for this many of its periods has stopped checking.
_QUIET_PERIODS: Final = 2.0
#: A checker whose last probe before the request is older than this many periods was no
#: longer probing.
_ACTIVE_PERIODS: Final = 3.0


# Plain classes, not dataclasses: building a dataclass costs every process's start-up
# milliseconds, for two records.
class _Checker:
    __slots__ = ("failed", "failures", "last", "period_s", "probes", "released", "threshold")

    def __init__(self) -> None:
        self.probes: deque[float] = deque(maxlen=_PROBES_KEPT)  # before the request
        self.last = 0.0
        self.failures = 0
        self.failed: list[float] = []  # when each 503 was answered
        self.threshold: int | None = None  # declared
        self.period_s: float | None = None  # declared
        self.released = False  # not waited for: its pod left the endpoints, or answered 200


class _Declared:
    __slots__ = ("agent_prefix", "period_s", "threshold")

    def __init__(self, agent_prefix: str, threshold: int, period_s: float) -> None:
        self.agent_prefix = agent_prefix
        self.threshold = threshold
        self.period_s = period_s


class HealthCheckers:
    """The readiness probes seen, per checker; see the module's text.

    Args:
        now: The coordinator's clock.
        changed: Called when a checker may have let go (wakes the policy).
        requested_at: When shutdown was requested (``None`` before): from then on a
            503 answered is a failure seen by the checker.
    """

    def __init__(
        self,
        now: Callable[[], float],
        changed: Callable[[], None],
        requested_at: Callable[[], float | None],
    ) -> None:
        self._now = now
        self._changed = changed
        self._requested_at = requested_at
        self._checkers: dict[tuple[str, str], _Checker] = {}
        self._declared: list[_Declared] = []
        self._held: str | None = None  # see hold
        self._was_held = False
        self._released_at: float | None = None  # when the hold was seen released

    def expect(self, agent_prefix: str, *, failures: int, period_s: float) -> None:
        """Declare a checker: probes whose ``User-Agent`` starts with ``agent_prefix``
        mark this process down after ``failures`` 503s, one every ``period_s``."""
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
            raise ValueError(f"failures must be an int >= 0, got {failures!r}")
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        declared = _Declared(agent_prefix, failures, float(period_s))
        self._declared.append(declared)
        for (_peer, agent), checker in self._checkers.items():  # probes seen before
            if checker.threshold is None and agent.startswith(agent_prefix):
                _declare(checker, declared)

    def hold(self, by: str) -> None:
        """Wait, besides the checkers seen here, until ``release_held`` (at most until
        accepting must end): the checkers probe another process — a ``--workers``
        parent's management port — which says when they have let go."""
        self._held = by
        self._was_held = True

    def release_held(self) -> None:
        """The other process's checkers have let go.  Only sets a flag: callable from a
        signal handler; the policy sees it at its next look (``HELD_RECHECK_S``)."""
        self._held = None

    @property
    def held(self) -> str | None:
        """Who is waited for besides the checkers seen here (``hold``), if anyone."""
        return self._held

    def release_declared(self) -> None:
        """The declared checkers have let go (the pod left its EndpointSlice)."""
        for checker in self._checkers.values():
            if checker.threshold is not None:
                checker.released = True
        self._changed()

    def answered(
        self,
        peer: str | None,
        user_agent: str | None,
        status: int,
        shutting_down: bool | None = None,
    ) -> None:
        """A readiness probe from ``peer`` (its address) with ``user_agent`` was answered
        ``status``; ``shutting_down``: whether shutdown was requested when the answer was
        decided, where that was in another thread (WSGI: a 200 decided before the request
        but reported after it is a probe before it, not a checker kept ready)."""
        now = self._now()
        requested = self._requested_at() is not None
        if shutting_down is not None:
            requested = shutting_down
        key = (peer or "", user_agent or "")
        checker = self._checkers.get(key)
        if checker is None:
            if requested:
                return  # only who probed before the request is waited for
            checker = self._checkers[key] = _Checker()
            for declared in self._declared:
                if key[1].startswith(declared.agent_prefix):
                    _declare(checker, declared)
                    break
            if len(self._checkers) > _CHECKERS_KEPT:
                self._forget_one()
        checker.last = now
        if not requested:
            checker.probes.append(now)
        elif status >= 500:
            checker.failures += 1
            if len(checker.failed) < _FAILURES_KEPT:
                checker.failed.append(now)
            self._changed()
        elif not checker.released:
            # Answered ready after the request (readiness kept while accepting, or the
            # pod still serving through other workers): this checker is not told to let
            # go of the process, so waiting for it buys nothing.
            checker.released = True
            self._changed()

    def _forget_one(self) -> None:
        """Make room: forget the checker with the fewest probes (one-off requests — a
        crawler, a script — before a balancer that has probed for a while), the one
        heard from least recently among those."""
        key = min(
            self._checkers, key=lambda k: (len(self._checkers[k].probes), self._checkers[k].last)
        )
        del self._checkers[key]

    def let_go(self, failures: int, now: float) -> tuple[float | None, float | None]:
        """When every checker probing before the request let go, given ``failures``
        (the threshold of a checker not declared).

        Returns:
            ``(when, None)`` once all have, ``(None, when to look again)`` while one
            has not, ``(None, None)`` when none was to be waited for (or no shutdown
            was requested).
        """
        requested = self._requested_at()
        if requested is None:
            return None, None
        latest: float | None = None
        recheck: float | None = None
        if self._held is not None:
            recheck = now + HELD_RECHECK_S
        elif self._released_at is None and self._was_held:
            self._released_at = now
        if self._released_at is not None:
            latest = self._released_at
        for checker in self._checkers.values():
            threshold = failures if checker.threshold is None else checker.threshold
            period = checker.period_s or _period(checker.probes)
            if threshold <= 0 or period is None or checker.released:
                continue
            before = checker.probes[-1] if checker.probes else None
            if before is None or before < requested - _ACTIVE_PERIODS * period:
                continue  # not probing (any more) when shutdown was requested
            if checker.failures >= threshold:
                failed = checker.failed
                at = failed[threshold - 1] if threshold <= len(failed) else now
                latest = at if latest is None else max(latest, at)
                continue
            quiet_at = checker.last + _QUIET_PERIODS * period
            if now >= quiet_at:
                latest = quiet_at if latest is None else max(latest, quiet_at)
                continue
            recheck = quiet_at if recheck is None else min(recheck, quiet_at)
        if recheck is not None:
            return None, recheck
        return latest, None

    def pending(self, failures: int) -> str:
        """The checkers still waited for, in a few words (for the log)."""
        waiting = []
        kubelet = False
        for (peer, agent), c in self._checkers.items():
            threshold = failures if c.threshold is None else c.threshold
            known = len(c.probes) >= 2 or (c.threshold is not None and c.probes)
            if known and not c.released and c.failures < threshold:
                waiting.append(f"{peer or '?'} {agent or '-'} {c.failures}/{threshold}")
                kubelet = kubelet or (c.threshold is None and agent.startswith(KUBELET_AGENT))
        said = ", ".join([self._held, *waiting[:3]] if self._held else waiting[:3])
        if kubelet:  # a deleted pod's endpoint goes without them; only the API tells
            said += "; the kubelet's probes: --kubernetes stops waiting for them at a deletion"
        return said


def _declare(checker: _Checker, declared: _Declared) -> None:
    checker.threshold = declared.threshold
    checker.period_s = declared.period_s


def _period(probes: deque[float]) -> float | None:
    """A checker's period: the median gap between its probes (two at least)."""
    if len(probes) < 2:
        return None
    # The median by hand: ``statistics`` costs ~10 ms of every process's start-up.
    gaps = sorted(b - a for a, b in zip(probes, list(probes)[1:], strict=False))
    middle = len(gaps) // 2
    period = gaps[middle] if len(gaps) % 2 else (gaps[middle - 1] + gaps[middle]) / 2
    return period if period > 0 else None
