"""The context managers the counters hand out: ``graceful.Session`` and the request tracker.

``Tracking.track_session`` returns a ``Session`` (a websocket, a streaming response) and
``Tracking.track_request`` the coordinator's one ``_RequestTracker``.  Both are on the hot
path, so they are what ``graceful._core.tracking`` is: plain attribute arithmetic on the
coordinator's counters, with ``__slots__`` and no allocation per request (the request
tracker is shared: ``with`` re-enters the same object).  Like the counters, they notify
waiters only while someone waits (``_zero_waiters``; see "Waking waiters" there).

They reach the counters through ``Counters``, a protocol of the attributes they touch,
rather than ``Tracking`` itself: ``graceful._core.tracking`` imports this module, and an
import back (even for typing only) would be a cycle.

A session's ``on_drain`` may run from an event-loop callback (a phase listener, a
protocol's ``connection_lost``) rather than a task: it must only *signal* the session to
end, and an exception in it is logged, never raised into whoever began the drain.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

from typing_extensions import final

__all__ = ("Counters", "Session")

logger = logging.getLogger("graceful")


class Counters(Protocol):
    """The counters of ``graceful._core.tracking.Tracking`` a session and a request touch."""

    _requests_total: int
    _requests_done: int
    _zero_waiters: int
    _sessions: set[Session]
    _draining: bool

    def _notify(self) -> None: ...


@final
class _RequestTracker:
    """The reusable context manager behind ``Tracking.track_request`` (one per
    coordinator, so tracking a request allocates nothing)."""

    __slots__ = ("_c",)

    def __init__(self, coordinator: Counters) -> None:
        self._c = coordinator

    def __enter__(self) -> None:
        self._c._requests_total += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        c = self._c
        c._requests_done += 1
        if c._zero_waiters and c._requests_done == c._requests_total:
            c._notify()


@final
class Session:
    """A long-lived session (websocket, streaming response) registered with a coordinator.

    Returned by ``graceful.ShutdownCoordinator.track_session``; use it as a context
    manager around the session.  ``on_drain`` is called once when draining begins (or at
    once if it already has) so the session can finish its current message and end.  It
    may be called from an event-loop callback rather than a task, so it must only
    *signal* (set an event, a flag) — never start tasks or await.
    """

    __slots__ = ("_c", "_on_drain", "drain_requested")

    def __init__(self, coordinator: Counters, on_drain: Callable[[], None] | None) -> None:
        self._c = coordinator
        self._on_drain = on_drain
        #: ``True`` once the coordinator asked this session to end.
        self.drain_requested = False

    def __enter__(self) -> Session:
        c = self._c
        c._sessions.add(self)
        if c._draining:
            self._request_drain()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        c = self._c
        c._sessions.discard(self)
        if c._zero_waiters and not c._sessions:
            c._notify()

    def _request_drain(self) -> None:
        if self.drain_requested:
            return
        self.drain_requested = True
        if self._on_drain is not None:
            try:
                self._on_drain()
            except Exception:
                logger.exception("session drain callback %r failed", self._on_drain)
