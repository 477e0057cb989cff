"""Accept edge: a burst queued while the server is stopped, then SIGTERM.

The server process is stopped (SIGSTOP), N connections complete their handshake in the
kernel's accept backlog and each sends a whole ``GET / HTTP/1.1``; SIGTERM is sent (and
seen pending in ``/proc``), then SIGCONT: the signal and the burst reach the event loop in
the same wake-up, which is when a server that closes its listener too early resets
connections that already sent a request.  Every client must get a 200, and the app must
have handled exactly the requests whose responses arrived.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from tests.support.harness import (
    Client,
    Harness,
    collect,
    handled,
    outcomes,
    signal_pending,
    stopped,
    summarize,
    wait_for,
    worker_pids,
)
from tests.support.servers import ServerProcess

POLICY_OPTIONS = {
    "accept-until-idle": ["--policy", "accept-until-idle", "--idle", "0"],
    "refuse-immediately": ["--policy", "refuse-immediately"],
    "serve-until-killed": ["--policy", "serve-until-killed", "--max-wait", "0.5"],
}
POLICY_ENV = {
    "accept-until-idle": {"GRACEFUL_POLICY": "accept-until-idle", "GRACEFUL_IDLE": "0"},
    "refuse-immediately": {"GRACEFUL_POLICY": "refuse-immediately"},
    "serve-until-killed": {"GRACEFUL_POLICY": "serve-until-killed", "GRACEFUL_MAX_WAIT": "0.5"},
}


def burst(server: ServerProcess, pid: int, n: int, record: Callable[[str], None]) -> None:
    """Stop ``pid``, queue ``n`` requests, SIGTERM ``server``, resume; check everything."""
    with stopped(pid):
        clients = [Client.connect(server.port) for _ in range(n)]
        for i, client in enumerate(clients):
            client.request("/", f"b{i}")
        began = time.monotonic()
        server.signal(signal.SIGTERM)  # gunicorn: the master, which signals the worker
        wait_for(lambda: signal_pending(pid, signal.SIGTERM), 10, f"SIGTERM pending in {pid}")
    collect(clients, 20)
    results = outcomes(clients)
    code = server.wait_exit(20)
    took = time.monotonic() - began
    record(f"{summarize(results)}; exit {code} {took:.1f} s after SIGTERM")
    assert [r for r in results if r.kind != "ok" or r.status != 200] == []
    answered = {r.rid for r in results}
    assert set(handled(server)) == answered
    assert code == 0
    assert "Traceback" not in server.output()


@pytest.mark.parametrize("n", [100, 200])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("policy", list(POLICY_OPTIONS))
def test_burst_graceful_run(
    harness: Harness, record: Callable[[str], None], policy: str, loop: str, n: int
) -> None:
    """graceful run: N requests queued while stopped, SIGTERM, SIGCONT: all answered 200"""
    server = harness.graceful(*POLICY_OPTIONS[policy], "--loop", loop)
    burst(server, server.proc.pid, n, record)


@pytest.mark.parametrize("repetition", range(5))
def test_burst_asyncio_refuse_immediately_repeated(
    harness: Harness, record: Callable[[str], None], repetition: int
) -> None:
    """The racy case again (asyncio, refuse-immediately, 200 queued): all answered 200"""
    server = harness.graceful(*POLICY_OPTIONS["refuse-immediately"], "--loop", "asyncio")
    burst(server, server.proc.pid, 200, record)


@pytest.mark.parametrize(
    ("worker", "policy"),
    [
        ("UvicornWorker", "accept-until-idle"),
        ("UvicornWorker", "refuse-immediately"),
        ("UvicornWorker", "serve-until-killed"),
        ("UvicornH11Worker", "refuse-immediately"),
    ],
)
def test_burst_gunicorn(
    harness: Harness, record: Callable[[str], None], worker: str, policy: str
) -> None:
    """gunicorn -w 1: 100 requests queued while the worker is stopped, SIGTERM to the
    master, SIGCONT: all answered 200"""
    server = harness.gunicorn(
        "--graceful-timeout", "10", worker_class=worker, env=POLICY_ENV[policy]
    )
    (pid,) = worker_pids(server)
    burst(server, pid, 100, record)
