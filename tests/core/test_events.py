"""Phase events (graceful._core.events): one JSON line per phase change, read back exactly.

The writer runs on a real coordinator on asyncio and trio (virtual clock); the stream is
an in-memory one, so there are no sockets and no processes here — the demo's backends
(tests/demo/test_demo.py) use it over a real pipe.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time

import anyio
import pytest

from graceful import Phase, RefuseImmediately, ShutdownCoordinator
from graceful._core.events import PhaseEvent, json_event_writer, parse_event

pytestmark = pytest.mark.anyio

KEYS = ["event", "phase", "reason", "t", "pid", "connections", "requests", "sessions"]


async def never() -> None:
    await anyio.sleep_forever()


async def shut_down(c: ShutdownCoordinator, *, with_connection: bool = False) -> None:
    """Run ``c`` until STOPPED, asking for shutdown once (with one connection open)."""
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))
        if with_connection:
            c.connection_opened()
        c.request_shutdown("SIGTERM")
        if with_connection:
            c.connection_closed()
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=10)


async def test_one_json_line_per_phase_change() -> None:
    c = ShutdownCoordinator(policy=RefuseImmediately(), grace_period_s=30)
    stream = io.StringIO()
    c.subscribe(json_event_writer(c, stream))
    before = time.time()
    await shut_down(c, with_connection=True)
    after = time.time()

    lines = stream.getvalue().splitlines()
    assert stream.getvalue().endswith("\n")
    raw = [json.loads(line) for line in lines]
    assert all(list(event) == KEYS for event in raw)
    assert [e["phase"] for e in raw] == ["accepting", "draining", "stopping", "stopped"]
    assert {e["event"] for e in raw} == {"phase"}
    assert {e["pid"] for e in raw} == {os.getpid()}
    assert raw[0]["reason"] == "SIGTERM"
    assert raw[0]["connections"] == 1  # counted at the change, before it closed
    assert raw[-1]["connections"] == raw[-1]["requests"] == raw[-1]["sessions"] == 0
    times = [e["t"] for e in raw]
    assert times == sorted(times)
    assert before <= times[0]
    assert times[-1] <= after


async def test_events_read_back_as_written() -> None:
    c = ShutdownCoordinator(policy=RefuseImmediately(), grace_period_s=30)
    stream = io.StringIO()
    c.subscribe(json_event_writer(c, stream))
    await shut_down(c)
    events = [parse_event(line) for line in stream.getvalue().splitlines()]
    assert [e.phase for e in events if e is not None] == [
        Phase.ACCEPTING,
        Phase.DRAINING,
        Phase.STOPPING,
        Phase.STOPPED,
    ]
    for line, event in zip(stream.getvalue().splitlines(), events, strict=True):
        assert event is not None
        assert event.to_json() == line


def test_parse_skips_blank_lines_and_other_events_and_rejects_garbage() -> None:
    event = PhaseEvent(Phase.DRAINING, "idle", 1.5, 7, 3, 2, 1)
    assert parse_event(event.to_json().encode() + b"\n") == event
    assert parse_event("  \n") is None
    assert parse_event('{"event": "hello"}') is None
    with pytest.raises(ValueError, match="malformed phase event"):
        parse_event('{"event": "phase", "phase": "napping"}')
    with pytest.raises(ValueError, match="line of JSON"):
        parse_event("accepting -> draining: idle")
    with pytest.raises(ValueError, match="JSON object"):
        parse_event("[1, 2]")


class BrokenPipeStream:
    def __init__(self) -> None:
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise BrokenPipeError("the reader went away")

    def flush(self) -> None:
        pass


async def test_a_broken_stream_is_reported_once_and_shutdown_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = ShutdownCoordinator(policy=RefuseImmediately(), grace_period_s=30)
    stream = BrokenPipeStream()
    c.subscribe(json_event_writer(c, stream))
    with caplog.at_level(logging.WARNING, logger="graceful"):
        await shut_down(c)
    assert c.phase is Phase.STOPPED
    assert stream.writes == 1
    warnings = [r for r in caplog.records if "phase events" in r.getMessage()]
    assert len(warnings) == 1
    assert not [r for r in caplog.records if "phase listener" in r.getMessage()]
