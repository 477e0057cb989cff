"""The health checkers of a ``--workers`` pod whose parent has the management port.

The probes go to the parent (``--management-port``), so no worker sees them: each
worker's accept-until-idle would end at its idle window while a balancer that only
health-checks still routes to the pod (``graceful._core.checkers``).  So the parent
counts them — the readiness answers of its listener, per checker — and, once every
checker that probed before SIGTERM has been answered its 503s (or went quiet), sends
each worker ``RELEASED_SIGNAL``; until then the workers keep accepting
(``HealthCheckers.hold``), bounded as always by their accept budget.

The signal is ignored from the parent's start on, so that a worker still starting
(before its handler is installed) is not ended by it; a worker that serves only after
the release gets it then, and a worker retired by a reload gets it with its SIGTERM (the
pod stays in rotation: its new workers serve).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Final

from .._core.checkers import HealthCheckers
from .._core.coordinator import ShutdownCoordinator
from .._core.policy import AcceptUntilIdle, policy_from_name
from .._options import Values, policy_kwargs

__all__ = ("RELEASED_SIGNAL", "Relay", "wait_for_parents_checkers")

logger = logging.getLogger("graceful")

#: The parent's word to its workers: the health checkers probing it have let go.
RELEASED_SIGNAL: Final = getattr(signal, "SIGRTMIN", 34) + 1
#: How often the parent looks at its checkers after SIGTERM.
LOOK_S: Final = 0.05


def wait_for_parents_checkers(coordinator: ShutdownCoordinator) -> None:
    """In a worker: accept until the parent says its checkers let go."""
    checkers = coordinator.health_checkers
    checkers.hold("the health checkers probing the parent's management port")
    signal.signal(RELEASED_SIGNAL, lambda signum, frame: checkers.release_held())


class Relay:
    """In the parent: its checkers, and the word to the workers once they let go.

    Args:
        failures: ``--readiness-failures`` (the threshold of a checker).
        deadline: The parent's kill deadline (``time.monotonic``), once stopping.
    """

    def __init__(self, failures: int, deadline: Callable[[], float | None]) -> None:
        self.failures = failures
        self._deadline = deadline
        self._lock = threading.Lock()
        self._requested_at: float | None = None
        self._checkers = HealthCheckers(time.monotonic, lambda: None, lambda: self._requested_at)
        self.released = False

    @classmethod
    def of(cls, values: Values, deadline: Callable[[], float | None]) -> Relay | None:
        """The parent's relay when its workers wait for it: the same condition as
        theirs (``graceful._cli.serving._for_parent``)."""
        policy = policy_from_name(**policy_kwargs(values))
        if not isinstance(policy, AcceptUntilIdle) or not policy.readiness_failures:
            return None
        if values["readiness_path"] is None:
            return None
        return cls(policy.readiness_failures, deadline)

    def ignore_in_children(self) -> None:
        """Before the first worker starts: it inherits the signal ignored."""
        signal.signal(RELEASED_SIGNAL, signal.SIG_IGN)

    def answered(self, peer: str | None, user_agent: str | None, status: int) -> None:
        """A readiness probe the parent's listener answered (any thread)."""
        with self._lock:
            self._checkers.answered(peer, user_agent, status)

    def start(self, release: Callable[[], None]) -> None:
        """At SIGTERM: look at the checkers until they let go, then ``release()``
        (once; from a thread of its own)."""
        with self._lock:
            self._requested_at = time.monotonic()
            said = self._checkers.pending(self.failures)
        if said:
            logger.info(
                "workers accept until the health checkers have seen the pod fail (%s)", said
            )
        threading.Thread(target=self._watch, args=(release,), daemon=True).start()

    def _watch(self, release: Callable[[], None]) -> None:
        while True:
            with self._lock:
                at, recheck = self._checkers.let_go(self.failures, time.monotonic())
            deadline = self._deadline()
            if recheck is None or deadline is None or time.monotonic() >= deadline:
                break
            time.sleep(LOOK_S)
        if at is not None:
            logger.info("the health checkers probing the management port let go of the pod")
        release()
