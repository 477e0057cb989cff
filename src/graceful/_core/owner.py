"""What the phase engine takes of its coordinator, stated as a protocol: ``Owner``.

``graceful.ShutdownCoordinator`` owns a ``PhaseEngine`` (``graceful._core.engine``) and
hands itself in; the engine never imports the coordinator — not even for typing, which
would close an import cycle (``tests/core/test_import_graph.py`` counts ``TYPE_CHECKING``
imports).  So what the engine touches is written down here, checked by mypy where the
coordinator hands itself in:

* ``Tracking``'s counters and hot-path flags (``graceful._core.tracking``): the engine
  reads the counters at each phase change, and sets the two flags the hot path reads
  (``_draining``, ``_nudging``) — one attribute test per request, never a call into the
  engine;
* the facade's configuration, and the calls the engine makes back through it
  (``signal_received``, ``request_shutdown``, ``exit_soon``): a signal caught by the run
  task, or its trigger, takes the path an adapter's call does.

The engine's parts (``graceful._core.timetable``, ``graceful._core.engine``) share it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import anyio

    from .policy import Policy
    from .sessions import Session

__all__ = ("Owner",)


class Owner(Protocol):
    """What the engine takes of its coordinator (``graceful.ShutdownCoordinator``, which
    owns the engine and hands itself in: the engine does not import it).  Its counters
    and hot-path flags are ``Tracking``'s; its configuration and the calls the engine
    makes back are the facade's."""

    # Tracking: the counters and flags the engine reads and sets.
    _sessions: set[Session]
    _zero_waiters: int
    _requests_total: int
    _last_activity_at: float | None
    _connections_total: int
    _connections: int
    _changed: anyio.Event | None
    _draining: bool
    _nudging: bool
    _closed_draining: int

    @property
    def _requests(self) -> int: ...
    @property
    def drained(self) -> bool: ...
    def _now(self) -> float: ...
    def _notify(self) -> None: ...
    def _idle(self, include_connections: bool = True, include_requests: bool = True) -> bool: ...
    def _external_requests(self) -> tuple[int, int]: ...
    def _start_timing(self, now: float) -> None: ...
    def oldest_request_age_s(self) -> float | None: ...
    def longest_request_s(self, *, running: bool = True) -> float | None: ...

    # The facade: its configuration and the calls the engine makes back.
    @property
    def policy(self) -> Policy: ...
    @property
    def drain_timeout_s(self) -> float: ...
    @property
    def grace_period_s(self) -> float | None: ...
    @property
    def kill_margin_s(self) -> float: ...
    @property
    def hook_timeout_s(self) -> float: ...
    @property
    def hard_exit(self) -> bool: ...
    @property
    def exit_on_third_request(self) -> bool: ...
    def drain_time_left(self) -> float | None: ...
    def time_left_s(self, until: float | None, *, at_most_s: float = ...) -> float: ...
    def signal_received(self, signum: int, *, quick: Collection[int] = ...) -> None: ...
    def request_shutdown(
        self,
        reason: str = ...,
        *,
        escalate: bool = ...,
        immediate: bool = ...,
        drain_now: bool = ...,
    ) -> None: ...
    def exit_soon(self, within_s: float = ...) -> None: ...
