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
