"""graceful run --workers 2: the parent, its workers, and signals to the parent only.

In a container only PID 1 — the parent — gets SIGTERM.  It must drain every worker, and
no worker may outlive it whatever it was sent (a worker left behind keeps the port and
its requests, and is SIGKILLed with the pod's cgroup at best).  A worker that dies is
replaced, as ``uvicorn --workers`` does.  Process states are read from ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from tests.support.harness import (
    Client,
    Harness,
    alive,
    children,
    collect,
    outcomes,
    summarize,
    wait_for,
)
from tests.support.servers import ServerProcess

OPTIONS = ["--policy", "accept-until-idle", "--idle", "0.5", "--grace-period", "10"]


def worker_pids(harness: Harness, server: ServerProcess) -> list[int]:
    match = re.search(r"with \d+ workers \(pids ([\d, ]+)\)", server.output())
    assert match, server.output()
    pids = [int(pid) for pid in match.group(1).split(", ")]
    harness.adopt(pids)
    return pids


def test_sigterm_to_parent_drains_all_workers(
    harness: Harness, record: Callable[[str], None]
) -> None:
    """SIGTERM to the parent: 6 in-flight requests (both workers) get 200, every worker
    drains and exits, the parent exits 0"""
    server = harness.graceful(*OPTIONS, workers=2)
    workers = worker_pids(harness, server)
    clients = [Client.connect(server.port) for _ in range(6)]
    for i, client in enumerate(clients):
        client.request("/slow?s=1", f"w{i}")
    server.wait_for_line(r"started w\d ", count=6)
    began = time.monotonic()
    server.signal(signal.SIGTERM)
    collect(clients, 10)
    code = server.wait_exit(15)
    took = time.monotonic() - began
    left = [pid for pid in workers if alive(pid)]
    results = outcomes(clients)
    record(f"{summarize(results)}; parent exit {code} {took:.1f} s; workers left: {len(left)}")
    assert [r.status for r in results] == [200] * 6
    assert server.output().count("stopping -> stopped") == 2
    assert code == 0
    assert left == []


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(signal.SIGTERM, id="SIGTERM"),
        pytest.param(signal.SIGINT, id="SIGINT"),
        pytest.param(signal.SIGQUIT, id="SIGQUIT"),
        pytest.param(
            signal.SIGKILL,
            id="SIGKILL",
        ),
    ],
)
def test_no_worker_outlives_the_parent(
    harness: Harness, record: Callable[[str], None], sig: signal.Signals
) -> None:
    """A signal to the parent: once the parent has exited, no worker is alive (SIGKILL:
    within 5 s)"""
    server = harness.graceful(*OPTIONS, workers=2)
    workers = worker_pids(harness, server)
    began = time.monotonic()
    server.signal(sig)
    code = server.wait_exit(15)
    took = time.monotonic() - began
    if sig is signal.SIGKILL:  # nobody can act before the parent is gone; soon after
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not any(alive(pid) for pid in workers), 5, "workers gone")
    left = [pid for pid in workers if alive(pid)]
    record(
        f"parent exit {code} {took:.1f} s after {sig.name}; "
        f"workers still alive: {len(left)}{still_serving(server, left)}"
    )
    assert left == []
    assert code == (-signal.SIGKILL if sig is signal.SIGKILL else 0)


def still_serving(server: ServerProcess, left: list[int]) -> str:
    if not left:
        return ""
    client = Client.connect(server.port)
    answered = client.request("/", "orphan") and client.wait(5).responses
    return " (the port still answers)" if answered else ""


def test_sighup_to_parent_leaves_no_worker_behind(
    harness: Harness, record: Callable[[str], None]
) -> None:
    """SIGHUP to the parent: whether it reloads (old workers replaced) or exits, no
    worker outlives the parent; then SIGTERM ends everything"""
    server = harness.graceful(*OPTIONS, workers=2)
    workers = worker_pids(harness, server)
    server.signal(signal.SIGHUP)
    try:
        code: int | None = server.proc.wait(2)  # exited (the default action, or by design)
    except subprocess.TimeoutExpired:
        code = None
    if code is not None:
        left = [pid for pid in workers if alive(pid)]
        record(
            f"SIGHUP: parent exit {code}; workers still alive: {len(left)}"
            f"{still_serving(server, left)}"
        )
        assert left == []
        return
    # A reload: the old workers drain and exit, new ones serve.
    wait_for(lambda: not any(alive(pid) for pid in workers), 15, "old workers gone", poll_s=0.05)
    new = children(server.proc.pid)
    harness.adopt(new)
    client = Client.connect(server.port)
    client.request("/", "after-reload")
    status = client.response().status
    server.signal(signal.SIGTERM)
    code = server.wait_exit(15)
    left = [pid for pid in workers + new if alive(pid)]
    record(
        f"SIGHUP: reload, {len(new)} new workers, request {status}; SIGTERM: parent exit "
        f"{code}, workers still alive: {len(left)}"
    )
    assert status == 200
    assert left == []
    assert code == 0


def test_killed_worker_is_replaced(harness: Harness, record: Callable[[str], None]) -> None:
    """kill -9 one worker: the parent starts a new one (as uvicorn --workers does)"""
    server = harness.graceful(*OPTIONS, workers=2)
    workers = worker_pids(harness, server)
    victim = workers[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not alive(victim), 5, f"worker {victim} dead")
    try:
        wait_for(
            lambda: len([p for p in children(server.proc.pid) if p not in workers]) == 1,
            6,
            "a new worker",
            poll_s=0.05,
        )
        replaced = True
    except AssertionError:
        replaced = False
    now = children(server.proc.pid)
    record(f"after kill -9 of one worker: {len(now)} worker(s), replaced: {replaced}")
    assert replaced
    server.wait_for_line(r"Application startup complete", count=3)
    assert Client.connect(server.port).request("/", "after")
