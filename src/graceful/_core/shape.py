"""The shape every server adapter shares: what it provides, what it gets back.

An adapter — graceful's uvicorn server, the hypercorn workers, aiohttp's runner — is
the same thing filled in for a different server.  It reports connections and requests
through the coordinator's public adapter API (``docs/adapters.md``) and it obeys the
phases.  Obeying is the same sequence for every server, so it is written once, here:

* at the shutdown request (the first phase change): ``shutdown_requested`` — adopt what
  the server counted itself, note where HTTP/2 streams stood;
* when the policy starts nudging: ``nudge`` — requests whose response has not started
  close their connection after it;
* at *draining*: the listeners close, serving their backlog (``close_listeners``, once),
  and every connection with no request in progress gets ``idle_grace_s`` to send one
  (``close_idle``);
* at *stopping*, the coordinator's first stopping step (``finish``), each part bounded by
  a share of what is left of stopping's budget so that the last always gets its turn:
  listeners closed and their backlog handed over (``listeners_closed``, at most 0.5 s),
  the server's own shutdown hooks (``before_cut``), websockets' close frames (a third of
  at most a second), what still runs cut (``cut``, half of at most a second), every
  connection closed (``close_connections``), lifespan shutdown (``lifespan_shutdown``,
  until just before ``exit_by``).

A subclass fills in the hooks its server needs; each default does nothing.  The
hooks run on the server's event loop (asyncio or trio: waits use anyio).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from .coordinator import ShutdownCoordinator
from .policy import Phase

__all__ = (
    "ServerShape",
    "awaited",
    "called_from",
    "finisher",
    "self_test_failed",
    "stack_frames",
)

logger = logging.getLogger("graceful")


def self_test_failed(server: str, version: str, what: str) -> None:
    """The one warning of a hot path whose self-test failed (its first request was not
    found by the finder the drain uses): loud, once, naming the server, its version and
    what did not hold."""
    logger.warning(
        "%s %s: hot path self-test failed (%s); graceful cannot find the requests in "
        "flight on the hot path, every request now goes through the middleware",
        server,
        version,
        what,
    )


#: The share of stopping's budget the listeners get to hand their backlog over.
LISTENERS_CLOSED_S = 0.5
#: Lifespan shutdown ends this long before ``exit_by``, so that its own timeout reports.
LIFESPAN_MARGIN_S = 0.05


class ServerShape:
    """A server adapter: the hooks it fills in, the phases and stopping it gets.

    Call ``attach`` (or subscribe ``on_phase`` and add ``finish`` as a stopping step)
    before the server starts: from then on the phases reach the hooks and ``finish`` is
    the coordinator's first stopping step.  Call ``listeners_opened`` once the server
    listens.

    Args:
        coordinator: The coordinator the server follows.
        idle_grace_s: At draining, how long a connection with no request in progress
            may still send one (it is answered with ``Connection: close``).
    """

    def __init__(self, coordinator: ShutdownCoordinator, *, idle_grace_s: float) -> None:
        self.coordinator = coordinator
        self.idle_grace_s = idle_grace_s
        self._listening = False
        self._shutdown_seen = False
        self._nudged = False

    def attach(self) -> None:
        """Follow the coordinator: phases reach the hooks, ``finish`` runs at stopping."""
        self.coordinator.subscribe(self.on_phase)
        self.coordinator.add_stopping_step(self.finish)

    # ------------------------------------------------- what the server provides

    def shutdown_requested(self) -> None:
        """The first phase change: adopt what the server counted itself."""

    def nudge(self) -> None:
        """Nudging began: requests whose response has not started close after it."""

    def close_listeners(self) -> None:
        """Close the listeners without resetting their backlog (called once)."""

    async def listeners_closed(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, until the backlog accepted at the close is
        handed over."""

    def close_idle(self, grace_s: float) -> None:
        """Draining began: connections with no request in progress get ``grace_s`` to
        send one, then close; busy ones close after their response."""

    def stopping(self) -> None:
        """Stopping began (wake a server loop that polls)."""

    async def before_cut(self, exit_by: float | None) -> None:
        """Stopping, before websockets close: the server's own shutdown hooks."""

    async def cut(self, timeout_s: float) -> None:
        """Cancel what still runs (a 503 where no response started), waiting at most
        ``timeout_s``."""

    def close_connections(self) -> None:
        """Close every connection left."""

    async def lifespan_shutdown(self) -> None:
        """Run the app's shutdown (ASGI lifespan, aiohttp's ``on_cleanup``)."""

    # ---------------------------------------------------------- what it gets

    @property
    def listening(self) -> bool:
        """Whether the listeners are still open."""
        return self._listening

    def listeners_opened(self) -> None:
        """The server listens now; if draining began meanwhile (a signal during the
        app's start-up), the listeners close at once."""
        self._listening = True
        if self.coordinator.draining:
            self.stop_listening()

    def stop_listening(self) -> None:
        """Close the listeners, once (at draining, or earlier for a server's own
        reasons)."""
        if self._listening:
            self._listening = False
            self.close_listeners()

    def on_phase(self, phase: Phase) -> None:
        """The coordinator's phase listener (``subscribe``; ``attach`` does it)."""
        c = self.coordinator
        if not self._shutdown_seen:
            self._shutdown_seen = True
            self.shutdown_requested()
        if c.nudging and not self._nudged:
            self._nudged = True
            self.nudge()
        if phase >= Phase.DRAINING:
            self.stop_listening()
        if phase is Phase.DRAINING:
            self.close_idle(self.idle_grace_s)
        if phase >= Phase.STOPPING:
            self.stopping()

    async def finish(self) -> None:
        """Stopping: the listeners' backlog, the server's hooks, websockets' 1001, the
        cut, the connections, lifespan shutdown — each bounded by a share of what is
        left of stopping's budget."""
        c = self.coordinator
        d = c.deadlines
        exit_by = None if d is None else d.exit_by
        self.stop_listening()
        await self.listeners_closed(c.time_left_s(exit_by, at_most_s=LISTENERS_CLOSED_S))
        await self.before_cut(exit_by)
        # Sessions were told to end when stopping began; their 1001 goes out first.
        await c.wait_drained(
            include_connections=False,
            include_requests=False,
            until_stopping=False,
            timeout_s=c.time_left_s(exit_by, at_most_s=1.0) / 3,
        )
        await self.cut(c.time_left_s(exit_by, at_most_s=1.0) / 2)
        self.close_connections()
        left = max(0.0, c.time_left_s(exit_by) - LIFESPAN_MARGIN_S)
        with anyio.move_on_after(left) as scope:
            await self.lifespan_shutdown()
        if scope.cancelled_caught:
            logger.error("lifespan shutdown did not finish within %.3g s; abandoned", left)


def stack_frames() -> list[Any]:
    """The frames of the current call stack, innermost first (a running coroutine's
    frames link to the ones that resumed it)."""
    frames = []
    frame = inspect.currentframe()
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def called_from(code: Any) -> bool:
    """Whether a frame of ``code`` is on the current call stack."""
    return any(frame.f_code is code for frame in stack_frames())


def awaited(coroutine: Any) -> list[Any]:
    """``coroutine`` and the coroutines it awaits, outermost first (of a suspended
    task: a running one's are on the call stack instead)."""
    chain = []
    while coroutine is not None:
        chain.append(coroutine)
        coroutine = getattr(coroutine, "cr_await", None)
    return chain


_T = TypeVar("_T")


def local_of(
    coroutine: Any, kind: type[_T], accept: Callable[[_T], bool] | None = None
) -> _T | None:
    """The first local of type ``kind`` (that ``accept`` takes) of ``coroutine`` and the
    coroutines it awaits, outermost first (a request a task serves, its websocket)."""
    for awaiting in awaited(coroutine):
        if inspect.iscoroutine(awaiting):
            for value in inspect.getcoroutinelocals(awaiting).values():
                if isinstance(value, kind) and (accept is None or accept(value)):
                    return value
    return None


def finisher(
    coordinator: ShutdownCoordinator, sampled: float | None
) -> Callable[[asyncio.Task[Any]], None]:
    """A done callback that reports the end of an adopted request."""

    def finished(task: asyncio.Task[Any]) -> None:
        coordinator.request_finished(sampled)

    return finished
