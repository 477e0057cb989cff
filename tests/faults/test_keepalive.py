"""Idle keep-alive connections when draining starts.

A client holds an idle keep-alive connection and sends its next request at the very
moment draining starts: the server is stopped (SIGSTOP), the request is written into the
connection, SIGTERM is sent (and seen pending), then SIGCONT — the request and the
signal reach the event loop in the same wake-up; or the request is sent the moment
draining is logged.  The request must be answered (with ``Connection: close`` if it was
read after the signal), never met with a reset or a bare close.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from tests.support.harness import (
    DRAINING,
    Client,
    Harness,
    handled,
    signal_pending,
    stopped,
    wait_for,
)


@pytest.mark.parametrize(
    ("loop", "http", "policy"),
    [
        ("asyncio", "h11", ["--policy", "refuse-immediately"]),
        ("asyncio", "httptools", ["--policy", "refuse-immediately"]),
        ("uvloop", "h11", ["--policy", "refuse-immediately"]),
        ("uvloop", "httptools", ["--policy", "refuse-immediately"]),
        ("asyncio", "httptools", ["--policy", "accept-until-idle", "--idle", "0"]),
    ],
    ids=[
        "asyncio-h11-refuse",
        "asyncio-httptools-refuse",
        "uvloop-h11-refuse",
        "uvloop-httptools-refuse",
        "asyncio-httptools-idle0",
    ],
)
def test_request_on_idle_keep_alive_as_draining_starts(
    harness: Harness, record: Callable[[str], None], loop: str, http: str, policy: list[str]
) -> None:
    """Next request on 5 idle keep-alive connections, sent as draining starts: each is
    answered 200 (Connection: close, or keep-alive if handled before the signal) and then
    closed cleanly"""
    server = harness.graceful(*policy, "--loop", loop, "--http", http, "--grace-period", "10")
    clients = [Client.connect(server.port) for _ in range(5)]
    for i, client in enumerate(clients):
        client.request("/", f"first{i}")
        assert client.response().status == 200
    pid = server.proc.pid
    with stopped(pid):
        for i, client in enumerate(clients):
            client.request("/", f"next{i}")
        server.signal(signal.SIGTERM)
        wait_for(lambda: signal_pending(pid, signal.SIGTERM), 5, "SIGTERM pending")
    seen = []
    for client in clients:
        try:
            response = client.response()
            seen.append(f"{response.status} {response.headers.get('connection', 'keep-alive')}")
        except AssertionError:
            seen.append(f"connection {client.end}")
    closed = [client.closed_by_peer(5) and client.end for client in clients]
    code = server.wait_exit(10)
    counts = ", ".join(f"{seen.count(s)} x {s}" for s in sorted(set(seen)))
    ends = ", ".join(sorted(set(map(str, closed))))
    record(f"{counts}; then closed by the server ({ends}); exit {code}")
    # Handled before the loop saw the signal: a plain keep-alive answer, the connection
    # closed once idle; handled after: Connection: close.  Never a reset or a bare close.
    assert set(seen) <= {"200 close", "200 keep-alive"}
    assert closed == ["eof"] * len(clients)
    assert sorted(handled(server)) == sorted(
        [f"first{i}" for i in range(5)] + [f"next{i}" for i in range(5)]
    )
    assert code == 0


@pytest.mark.parametrize(
    ("loop", "http"),
    [("asyncio", "h11"), ("asyncio", "httptools"), ("uvloop", "httptools")],
)
def test_request_on_idle_keep_alive_just_after_draining_began(
    harness: Harness, record: Callable[[str], None], loop: str, http: str
) -> None:
    """Next request on an idle keep-alive connection, sent the moment 'draining' is
    logged (the listener is already closed): answered 200 with Connection: close"""
    server = harness.graceful(
        "--policy", "refuse-immediately", "--loop", loop, "--http", http, "--grace-period", "10"
    )
    client = Client.connect(server.port)
    client.request("/", "first")
    assert client.response().status == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING)
    client.request("/", "next")
    try:
        response = client.response()
        seen = f"{response.status} {response.headers.get('connection', 'keep-alive')}"
    except AssertionError:
        seen = f"connection {client.end}"
    code = server.wait_exit(10)
    record(f"{seen}; exit {code}")
    assert seen == "200 close"
    assert handled(server) == ["first", "next"]
    assert client.closed_by_peer(5)
    assert code == 0
