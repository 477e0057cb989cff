"""gunicorn -k graceful.gunicorn.UvicornWorker: real master, real workers, real signals."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import RawHTTP, ServerProcess, sigkill_expected_in

pytest.importorskip("gunicorn")

#: An app that says when it is imported and takes long to import.
SLOW_IMPORT_APP = """\
import sys, time
sys.stdout.write("importing app\\n")
sys.stdout.flush()
time.sleep(1.5)
from examples.asgi_app import app
"""


def start_gunicorn(
    *options: str, env: dict[str, str], app: str = "examples.asgi_app:app"
) -> ServerProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    return ServerProcess(
        [sys.executable, "-m", "gunicorn", app, "-k", "graceful.gunicorn.UvicornWorker",
         "-b", "127.0.0.1:0", *options],
        env={**environment, **env},
    )  # fmt: skip


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
    gunicorn.wait_for_line(r"serving -> accepting: SIGTERM .*SIGKILL expected in", count=2)
    # The master's --graceful-timeout, less what the worker took to log it (under load).
    expected = sigkill_expected_in(gunicorn.output())
    assert len(expected) == 2, gunicorn.output()
    assert all(9.0 <= n <= 10.0 for n in expected), expected
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


@pytest.mark.parametrize(
    ("options", "env", "names"),
    [
        ([], {"GRACEFUL_IDLE": "abc"}, ["GRACEFUL_IDLE", "'abc'"]),
        ([], {"GRACEFUL_POLICY": "drain-slowly"}, ["GRACEFUL_POLICY", "accept-until-idle"]),
        ([], {"GRACEFUL_NUDGE_CLIENTS": "maybe"}, ["GRACEFUL_NUDGE_CLIENTS"]),
        (
            [],
            {"GRACEFUL_READINESS_PATH": "/x", "GRACEFUL_LIVENESS_PATH": "/x"},
            ["GRACEFUL_READINESS_PATH", "GRACEFUL_LIVENESS_PATH"],
        ),
        (
            ["--graceful-timeout", "3"],
            {"GRACEFUL_KILL_MARGIN": "5"},
            ["--graceful-timeout", "GRACEFUL_KILL_MARGIN"],
        ),
        (["--graceful-timeout", "0"], {}, ["--graceful-timeout"]),
    ],
    ids=["idle", "policy", "boolean", "paths", "margin", "no-timeout"],
)
def test_bad_configuration_stops_the_master_with_one_line(
    options: list[str], env: dict[str, str], names: list[str]
) -> None:
    server = start_gunicorn("-w", "2", *options, env=env)
    try:
        assert server.wait_exit(timeout_s=15) == 1
        output = server.output()
        errors = [line for line in output.splitlines() if line.startswith("Error: graceful: ")]
        assert len(errors) == 1, output
        assert all(name in errors[0] for name in names), errors[0]
        assert "Booting worker" not in output  # checked in the master, before any worker
        assert "Traceback" not in output
    finally:
        server.stop()


def test_short_graceful_timeout_shrinks_the_kill_margin() -> None:
    server = start_gunicorn("-w", "1", "--graceful-timeout", "1", env={"GRACEFUL_IDLE": "0.2"})
    try:
        server.wait_for_line(r"--graceful-timeout 1 leaves no room for the default kill margin")
        port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
        server.wait_for_line(r"Application startup complete")
        assert RawHTTP(port).get("/")[0] == 200
        server.signal(signal.SIGTERM)
        line = server.wait_for_line(
            r"serving -> accepting: SIGTERM .*SIGKILL expected in ([\d.]+) s \(grace period 1 s\)"
        )
        # The grace period, less what the worker took to log it (sigkill_expected_in).
        assert 0 < float(line.group(1)) <= 1.0, line.string
        assert server.wait_exit() == 0
        assert server.has_line(r"stopping -> stopped")
    finally:
        RawHTTP.close_all()
        server.stop()


def test_graceful_variables_reach_the_workers() -> None:
    server = start_gunicorn(
        "-w",
        "1",
        env={
            "GRACEFUL_READINESS_PATH": "/ready-custom",
            "GRACEFUL_LIVENESS_PATH": "none",
            "GRACEFUL_PRESTOP_PATH": "/stop-now",
            "GRACEFUL_POLICY": "refuse-immediately",
        },
    )
    try:
        port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
        server.wait_for_line(r"Application startup complete")
        assert RawHTTP(port).get("/ready-custom")[0] == 200
        assert RawHTTP(port).get("/readyz")[0] == 404  # the app's: no endpoint there
        assert RawHTTP(port).get("/livez")[0] == 404
        assert RawHTTP(port).get("/stop-now")[0] == 200  # answered once drained
        server.wait_for_line(r"serving -> accepting: preStop")
    finally:
        RawHTTP.close_all()
        server.stop()


def test_sigterm_while_the_app_is_imported_is_not_lost(tmp_path: Path) -> None:
    (tmp_path / "slowapp.py").write_text(SLOW_IMPORT_APP)
    server = start_gunicorn(
        "-w",
        "1",
        "--graceful-timeout",
        "10",
        env={"PYTHONPATH": str(tmp_path), "GRACEFUL_POLICY": "refuse-immediately"},
        app="slowapp:app",
    )
    try:
        server.wait_for_line(r"importing app")
        server.signal(signal.SIGTERM)  # the master sends SIGTERM to the importing worker
        server.wait_for_line(r"serving -> accepting: SIGTERM")
        assert server.wait_exit() == 0
        assert server.has_line(r"stopping -> stopped")
        assert not server.has_line(r"was sent SIGTERM|exited with code")
    finally:
        server.stop()
