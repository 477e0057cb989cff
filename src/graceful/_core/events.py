"""Phase changes as JSON lines, for whoever watches a server from another process.

Why events and not log lines
----------------------------
The log line ``accepting -> draining: idle for 1.0 s (3 connections, …)`` is written for
people: its wording may change in any release, a watcher that pattern-matches it breaks
without a word, and it learns the moment it *read* the line rather than the moment the
phase changed.  An event is a contract instead: one JSON object per line, fixed keys,
stamped with the wall clock inside the process at the change, so a supervisor (a test
harness, the demo, a sidecar) can place it on its own timeline, even on another host.

Why an ordinary phase listener
------------------------------
The writer uses only what every adapter uses — ``ShutdownCoordinator.subscribe``
and ``ShutdownCoordinator.statistics`` — so it cannot disagree with the log or the
readiness probe, and a process that does not subscribe it pays nothing.  Listeners run
synchronously inside the transition, so the writer writes one short line and flushes at
once: a process that exits hard right after ``stopped`` must not take its last event
with it.  A stream that fails (the reader went away) is reported once and then left
alone, rather than failing every later transition and drowning the log.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Final, Protocol

from typing_extensions import final

from .coordinator import ShutdownCoordinator
from .policy import Phase

__all__ = ("PhaseEvent", "TextSink", "json_event_writer", "parse_event")

logger: Final = logging.getLogger("graceful")

#: The ``event`` key of a phase change; other kinds may come, readers skip them.
PHASE_EVENT: Final = "phase"


class TextSink(Protocol):
    """Where events go: a text file, a pipe opened in text mode, ``io.StringIO``."""

    def write(self, text: str, /) -> object: ...

    def flush(self) -> object: ...


@final
@dataclass(frozen=True, slots=True)
class PhaseEvent:
    """One phase change, as written and as read back.

    Attributes:
        phase: The phase just entered.
        reason: Why (``"SIGTERM"``, ``"idle for 1.0 s"``, …), as in the log.
        t: Wall-clock time of the change (``time.time``), seconds.
        pid: The process that changed phase.
        connections: Open connections at the change.
        requests: Requests in flight at the change.
        sessions: Websockets and streams in flight at the change.
    """

    phase: Phase
    reason: str | None
    t: float
    pid: int
    connections: int
    requests: int
    sessions: int

    def to_json(self) -> str:
        """One line of JSON (no newline): ``{"event": "phase", "phase": "draining", …}``."""
        fields = asdict(self)
        fields["phase"] = str(self.phase)
        return json.dumps({"event": PHASE_EVENT, **fields})


def parse_event(line: str | bytes) -> PhaseEvent | None:
    """Read back one line a ``json_event_writer`` wrote.

    Returns:
        The event, or ``None`` for a blank line or an event of another kind.

    Raises:
        ValueError: if the line is not JSON or a phase event misses or mangles a key.
    """
    if not line.strip():
        return None
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        raise ValueError(f"an event is a line of JSON, got {line!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"an event is a JSON object, got {line!r}")
    if data.get("event") != PHASE_EVENT:
        return None
    try:
        return PhaseEvent(
            phase=Phase[str(data["phase"]).upper()],
            reason=None if data["reason"] is None else str(data["reason"]),
            t=float(data["t"]),
            pid=int(data["pid"]),
            connections=int(data["connections"]),
            requests=int(data["requests"]),
            sessions=int(data["sessions"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed phase event {line!r}: {exc!r}") from None


def json_event_writer(
    coordinator: ShutdownCoordinator, stream: TextSink
) -> Callable[[Phase], None]:
    """A phase listener that writes each change to ``stream`` as one line of JSON.

    Subscribe it yourself: ``coordinator.subscribe(json_event_writer(coordinator, f))``
    (``subscribe`` returns the function that unsubscribes it).  Each line is flushed as
    it is written; if writing fails, the failure is logged once and later changes are
    not written.
    """
    broken = False

    def write(phase: Phase) -> None:
        nonlocal broken
        if broken:
            return
        stats = coordinator.statistics()
        event = PhaseEvent(
            phase=phase,
            reason=stats.reason,
            t=time.time(),
            pid=os.getpid(),
            connections=stats.connections,
            requests=stats.requests,
            sessions=stats.sessions,
        )
        try:
            stream.write(event.to_json() + "\n")
            stream.flush()
        except (OSError, ValueError) as exc:  # ValueError: the stream was closed
            broken = True
            logger.warning("phase events: cannot write to %r (%s); no more events", stream, exc)

    return write
