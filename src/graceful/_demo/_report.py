"""What the demo shows: live progress while a scenario runs, then one table of outcomes.

Why live progress
-----------------
A scenario takes several seconds of real time — it has to, the delays it plays are the
point — and four of them run back to back.  A line per server that ticks while it runs
(requests, failures, A's phase as A reports it) shows the story as it happens: the
failures of the stock server pile up during the propagation delay, the graceful ones
stay at zero while A moves through accepting and draining.  The display goes to stderr,
so stdout carries only the table (the integration test reads it); without a terminal
rich prints plain lines instead of redrawing.

Why one table
-------------
The comparison is the product: the same timeline for every server, side by side, with
failures split by kind (a refusal and a reset have different causes and different
fixes) and two columns a failure count hides — how A ended (exited on its own, died of
the signal, or was killed at the grace period) and how long it stayed alive with
nothing to do.  Both cost something in a real rollout: a killed pod cut work, an idle
one held up the next step.

``--json FILE`` writes the same outcomes for programs (the integration test reads it):
per server the counts by kind, how A ended, its phase changes, the wasted idle time.

``rich`` is imported when it is needed, so ``graceful demo --help`` and a bad option
work without the ``demo`` extra; the entry point checks for it first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from ._clients import FAILURE_KINDS
from ._scenario import Outcome, ServerKind

__all__ = ("Progress", "outcome_record", "print_table", "write_json")


class Progress:
    """Live progress on a rich console, one line per scenario; an ``Observer``.

    Args:
        name_width: Characters kept for the server's name, the first column.
    """

    def __init__(self, *, name_width: int = 30) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self.console = Console(stderr=True)
        self._rich = RichProgress(
            TextColumn(f"{{task.description:<{name_width}}}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._tasks: dict[str, object] = {}

    def __enter__(self) -> Progress:
        self._rich.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._rich.__exit__(None, None, None)

    async def wait(self, outcome: Outcome, seconds: float) -> None:
        """Wait ``seconds`` of the scenario, refreshing its line five times a second."""
        from rich.progress import TaskID

        name = outcome.kind.name
        if name not in self._tasks:
            self._tasks[name] = self._rich.add_task(name, total=None, status="")
        task = self._tasks[name]
        assert isinstance(task, int)
        end = time.monotonic() + seconds
        while True:
            tally = outcome.tally
            self._rich.update(
                TaskID(task),
                status=f"{tally.requests:6d} requests, {tally.failed:4d} failed, "
                f"A: {_state_of_a(outcome):<10} t={tally.elapsed():5.1f} s",
            )
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(0.2, left))

    def done(self, kind: ServerKind) -> None:
        """Mark ``kind``'s scenario finished."""
        from rich.progress import TaskID

        task = self._tasks.get(kind.name)
        if isinstance(task, int):
            self._rich.update(TaskID(task), total=1, completed=1)


def _state_of_a(outcome: Outcome) -> str:
    a = outcome.terminating
    if a is None:
        return "serving"
    if a.ended_at is not None:
        return a.ended
    return a.phases[-1].phase if a.phases else "serving"


def print_table(outcomes: list[Outcome], args: argparse.Namespace) -> None:
    """Print the outcomes to stdout, one row per server."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Rolling restart: propagation delay {args.propagation_delay:g} s, grace "
        f"period {args.grace_period:g} s, {args.keepalive_clients} keep-alive + "
        f"{args.fresh_clients} fresh-connection clients + {args.long_requests} long requests",
        caption="failed = requests without a complete successful response. wasted idle = "
        "time the terminating backend A stayed alive after its last served response (or "
        "after SIGTERM, if later).",
    )
    for column in ("server", "requests", "failed", *FAILURE_KINDS, "A ended", "wasted idle"):
        table.add_column(column, justify="left" if column in ("server", "A ended") else "right")
    for o in outcomes:
        wasted = o.wasted_idle_s()
        table.add_row(
            o.kind.name,
            str(o.tally.requests),
            str(o.tally.failed),
            *(str(o.tally.results[k]) for k in FAILURE_KINDS),
            o.ended(),
            "?" if wasted is None else f"{wasted:.1f} s",
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    console.print(table)


def outcome_record(outcome: Outcome) -> dict[str, Any]:
    """One outcome as plain data (times in seconds from the scenario's start)."""
    a = outcome.terminating
    return {
        "server": outcome.kind.name,
        "server_kind": outcome.kind.server,
        "policy": outcome.kind.policy,
        "requests": outcome.tally.requests,
        "failed": outcome.tally.failed,
        "results": dict(sorted(outcome.tally.results.items())),
        "sigterm_at": outcome.sigterm_at,
        "a_ended": None if a is None else a.ended,
        "a_ended_after_sigterm_s": (
            None if a is None or a.ended_at is None else a.ended_at - outcome.sigterm_at
        ),
        "a_phases": [] if a is None else [mark._asdict() for mark in a.phases],
        "wasted_idle_s": outcome.wasted_idle_s(),
    }


def write_json(outcomes: list[Outcome], path: str) -> None:
    """Write the outcomes to ``path``: ``{"outcomes": [record, ...]}``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"outcomes": [outcome_record(o) for o in outcomes]}, f, indent=1)
        f.write("\n")
