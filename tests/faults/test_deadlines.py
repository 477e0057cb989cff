"""Deadline discipline: out before SIGKILL whatever the app does.

``graceful run --grace-period 4 --kill-margin 1``: SIGKILL is expected 4 s after SIGTERM,
and the kill margin promises the process is gone 1 s before it. Whatever the application
does — a handler that swallows cancellation, a thread that blocks for a minute, a
lifespan shutdown that hangs or raises — the process must exit by then (3 s, measured
from the SIGTERM to the process's exit) and say what it abandoned.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable

import pytest

from tests.support.harness import STOPPED, Client, Harness

GRACE = ["--policy", "refuse-immediately", "--grace-period", "4", "--kill-margin", "1"]
OUT_BY_S = 3.0  # the kill margin's promise: out 1 s before the SIGKILL at 4 s


def _sigterm_and_time_exit(server: object, timeout_s: float = 10) -> tuple[int, float]:
    began = time.monotonic()
    server.signal(signal.SIGTERM)  # type: ignore[attr-defined]
    code = server.wait_exit(timeout_s)  # type: ignore[attr-defined]
    return code, time.monotonic() - began


@pytest.mark.parametrize(
    "route",
    ["stubborn", "thread", "executor"],
    ids=["swallows-cancellation", "anyio-to-thread-sleep-60", "run-in-executor-sleep-60"],
)
def test_handler_that_will_not_end(
    harness: Harness, record: Callable[[str], None], route: str
) -> None:
    """A request whose handler cannot be ended: the process exits before the kill
    deadline and logs what it cut or abandoned"""
    server = harness.graceful(*GRACE)
    client = Client.connect(server.port)
    client.request(f"/{route}", "h")
    server.wait_for_line(r"started h ")
    code, took = _sigterm_and_time_exit(server)
    client.wait(5)
    saw = f"{client.responses[0].status}" if client.responses else f"connection {client.end}"
    record(f"client: {saw}; exit {code} {took:.2f} s after SIGTERM (grace 4 s, margin 1 s)")
    assert took < OUT_BY_S
    assert code in (0, 1)
    assert server.has_line(r"abandoning .*1 requests|request /\w+ cut"), server.output()


def test_lifespan_shutdown_hangs(harness: Harness, record: Callable[[str], None]) -> None:
    """Lifespan shutdown hangs (sleeps an hour): the process exits before the kill
    deadline"""
    server = harness.graceful(*GRACE, env={"FAULTS_SHUTDOWN": "hang"})
    code, took = _sigterm_and_time_exit(server)
    record(f"exit {code} {took:.2f} s after SIGTERM (grace 4 s, margin 1 s)")
    assert server.has_line("shutdown hanging")
    assert took < OUT_BY_S
    assert code in (0, 1)


def test_lifespan_shutdown_hang_is_named(harness: Harness, record: Callable[[str], None]) -> None:
    """Lifespan shutdown hangs: the log names the lifespan shutdown as what was
    abandoned"""
    server = harness.graceful(*GRACE, env={"FAULTS_SHUTDOWN": "hang"})
    code, took = _sigterm_and_time_exit(server)
    abandoned = [line for line in server.output().splitlines() if "abandon" in line]
    said = abandoned[-1].split(": ", 1)[-1] if abandoned else "nothing"
    record(f"exit {code} {took:.2f} s; log: {said}")
    assert any(re.search(r"lifespan", line) for line in abandoned), server.output()


def test_lifespan_shutdown_raises(harness: Harness, record: Callable[[str], None]) -> None:
    """Lifespan shutdown raises: the process exits at once, logging the failure"""
    server = harness.graceful(*GRACE, env={"FAULTS_SHUTDOWN": "raise"})
    code, took = _sigterm_and_time_exit(server)
    record(f"exit {code} {took:.2f} s after SIGTERM (grace 4 s)")
    assert server.has_line("shutdown raising")
    assert server.has_line(r"shutdown failed"), server.output()
    assert server.has_line(STOPPED)
    assert took < 2.0
    assert code in (0, 1)


def test_cut_request_logs_no_traceback(harness: Harness, record: Callable[[str], None]) -> None:
    """A request cut at the drain deadline: the client gets 503 and the log has no
    traceback"""
    server = harness.graceful(*GRACE, "--drain-timeout", "0.5")
    client = Client.connect(server.port)
    client.request("/slow?s=30", "cut")
    server.wait_for_line(r"started cut ")
    code, took = _sigterm_and_time_exit(server)
    status = client.response().status
    tracebacks = server.output().count("Traceback")
    record(f"client: {status}; exit {code} {took:.2f} s; {tracebacks} traceback(s) in the log")
    assert status == 503
    assert code == 0
    assert tracebacks == 0, server.output()
