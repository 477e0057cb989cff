"""gunicorn -k graceful.gunicorn.UvicornWorker: real master, real workers, real signals."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator

import pytest

from .servers import RawHTTP, ServerProcess

pytest.importorskip("gunicorn")


@pytest.fixture
def gunicorn() -> Iterator[ServerProcess]:
    server = ServerProcess(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "examples.asgi_app:app",
            "-k",
            "graceful.gunicorn.UvicornWorker",
            "-w",
            "2",
            "-b",
            "127.0.0.1:0",
            "--graceful-timeout",
            "10",
            "--timeout",
            "3",
        ],
        env={"GRACEFUL_POLICY": "accept-until-idle", "GRACEFUL_IDLE": "1"},
    )
    server.port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(r"Application startup complete", count=2)
    yield server
    RawHTTP.close_all()
    server.stop()


def test_sigterm_to_master_drains_both_workers(gunicorn: ServerProcess) -> None:
    clients = []
    for _ in range(6):  # spread over both workers
        client = RawHTTP(gunicorn.port)
        client.send("/slow?s=1.5")
        clients.append(client)
    gunicorn.wait_for_line(r"slow request started", count=6)
    gunicorn.signal(signal.SIGTERM)
    gunicorn.wait_for_line(r"serving -> accepting: SIGTERM .*SIGKILL expected in 10\.0 s", count=2)
    assert RawHTTP(gunicorn.port).get("/")[0] == 200  # still accepting
    assert [client.response()[0] for client in clients] == [200] * 6
    assert gunicorn.wait_exit(timeout_s=15) == 0
    output = gunicorn.output()
    assert output.count("stopping -> stopped") == 2, output
    assert output.count("draining -> stopping: drained") == 2
    assert "WORKER TIMEOUT" not in output  # heartbeats continued while draining


def test_sigquit_is_quick_shutdown(gunicorn: ServerProcess) -> None:
    client = RawHTTP(gunicorn.port)
    client.send("/slow?s=30")
    gunicorn.wait_for_line(r"slow request started")
    gunicorn.signal(signal.SIGQUIT)  # the master sends SIGQUIT to the workers
    assert client.response()[0] == 503
    assert gunicorn.wait_exit(timeout_s=10) == 0
    assert gunicorn.output().count("-> stopping: SIGQUIT (escalated)") == 2


def test_max_requests_recycling_drains_without_failures() -> None:
    server = ServerProcess(
        [
            sys.executable, "-m", "gunicorn", "examples.asgi_app:app",
            "-k", "graceful.gunicorn.UvicornWorker", "-w", "1", "-b", "127.0.0.1:0",
            "--max-requests", "3", "--graceful-timeout", "10",
        ],
        env={"GRACEFUL_POLICY": "accept-until-idle", "GRACEFUL_IDLE": "5"},
    )  # fmt: skip
    try:
        port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
        server.wait_for_line(r"Application startup complete")
        slow = RawHTTP(port)
        slow.send("/slow?s=1")  # in flight when the worker decides to recycle
        server.wait_for_line(r"slow request started")
        statuses = [RawHTTP(port).get("/")[0] for _ in range(3)]
        assert slow.response()[0] == 200
        assert statuses == [200, 200, 200]
        # The worker drained at once (not after the 5 s idle window) and a new one booted.
        server.wait_for_line(r"serving -> accepting: server exit")
        server.wait_for_line(r"accepting -> draining: server exit \(no accepting period\)")
        server.wait_for_line(r"Application startup complete", count=2)
        assert RawHTTP(port).get("/")[0] == 200
    finally:
        RawHTTP.close_all()
        server.stop()
