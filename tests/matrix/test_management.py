"""The management listener (``--management-port``) on every server ``graceful run``
serves: readiness, liveness, preStop and metrics on a port of their own, the app's port
left to the app — ``GET /prestop`` and ``/metrics`` there are the app's (404 from these
apps).  Probes on the management port never count as traffic, and it closes last: a
preStop answered once drained arrives after the app's listener closed.  Every wait is
on a log line, a response or an exit."""

from __future__ import annotations

import http.client
import re
import resource
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_cli import assert_usage_error, clean_environment, graceful_run
from tests.cli.test_cli_servers import (
    AIOHTTP_APP,
    AIOHTTP_RUNNING,
    HYPERCORN_RUNNING,
    UVICORN_RUNNING,
)
from tests.support.servers import RawHTTP, ServerProcess, connection_refused, wait_for

pytest.importorskip("prometheus_client")

SERVERS = [
    pytest.param(("uvicorn", "examples.asgi_app:app", UVICORN_RUNNING), id="uvicorn"),
    pytest.param(("hypercorn", "examples.asgi_app:app", HYPERCORN_RUNNING), id="hypercorn"),
    pytest.param(("aiohttp", AIOHTTP_APP, AIOHTTP_RUNNING), id="aiohttp"),
]
MANAGEMENT = r"management listener on 127\.0\.0\.1 port (\d+): (.*)"


def get(port: int, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("GET", path)
        answer = connection.getresponse()
        return answer.status, answer.read().decode("utf-8", "replace")
    finally:
        connection.close()


def start(
    servers: list[ServerProcess], server: tuple[str, str, str], *options: str
) -> tuple[ServerProcess, int]:
    """``graceful run`` of ``server`` on free ports: the process and its management port."""
    name, app, running = server
    process = ServerProcess(
        [sys.executable, "-m", "graceful", "run", app, "--server", name, "--port", "0",
         "--management-port", "0", *options]
    )  # fmt: skip
    servers.append(process)
    management = int(process.wait_for_line(MANAGEMENT).group(1))
    process.port = int(process.wait_for_line(running).group(1))
    return process, management


@pytest.mark.parametrize("server", SERVERS)
def test_endpoints_move_to_the_management_port(
    servers: list[ServerProcess], server: tuple[str, str, str]
) -> None:
    process, management = start(
        servers, server, "--prestop-path", "/prestop", "--metrics-path", "/metrics"
    )
    listed = process.wait_for_line(MANAGEMENT).group(2)
    assert listed == "readiness /readyz, liveness /livez, prestop /prestop, metrics /metrics"
    # The app's port: the app's own routes, not graceful's.
    for path in ("/prestop", "/metrics", "/readyz", "/livez"):
        assert get(process.port, path)[0] == 404, path
    assert get(process.port, "/")[0] == 200
    # The management port: graceful's, and nothing else.
    assert get(management, "/readyz") == (200, "ready\n")
    assert get(management, "/livez")[0] == 200
    status, body = get(management, "/metrics")
    assert status == 200
    assert re.search(r"^graceful_phase", body, re.M), body[:2000]
    assert get(management, "/")[0] == 404
    assert not process.has_line("answered on the app's port")  # no preStop warning
    # preStop drains, answers once drained; the app's listener is closed by then.
    status, body = get(management, "/prestop", timeout_s=20)
    assert status == 200, body
    assert connection_refused(process.port)
    assert process.wait_exit() == 0


@pytest.mark.parametrize("server", SERVERS)
def test_probes_on_the_management_port_are_not_traffic(
    servers: list[ServerProcess], server: tuple[str, str, str]
) -> None:
    """accept-until-idle with a 1 s window ends its window while the management port is
    probed every 0.1 s (the kubelet's probes would otherwise keep it open forever)."""
    process, management = start(servers, server, "--policy", "accept-until-idle", "--idle", "1")
    process.signal(signal.SIGTERM)
    process.wait_for_line(r"serving -> accepting")
    readiness: list[int] = []
    deadline = time.monotonic() + 20
    while not process.has_line(r"accepting -> draining") and time.monotonic() < deadline:
        try:
            readiness.append(get(management, "/readyz")[0])
        except (ConnectionRefusedError, ConnectionResetError):
            # The process drained and closed its port before its output reached us (the
            # reader lags under load; a probe in the port's accept queue at the close is
            # reset): the lines below still show how the window ended.
            break
        time.sleep(0.1)  # the probe period of this scenario
    line = process.wait_for_line(r"accepting -> draining: (.*)", timeout_s=5).group(1)
    # The window is a second; the line gives what was measured (1.01 s on a busy loop).
    assert re.match(r"no new connection for 1(\.\d+)? s", line), process.output()
    assert set(readiness) == {503}, readiness
    assert process.wait_exit() == 0


def raw(port: int, data: bytes) -> bytes:
    """What the management port answers to ``data``, read until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("server", SERVERS)
def test_what_a_client_sends_ends_only_its_connection(
    servers: list[ServerProcess], server: tuple[str, str, str]
) -> None:
    """A malformed target (urlsplit raises), a head above the limit in one write, a
    POST, junk: each gets its status, and the listener keeps answering."""
    process, management = start(servers, server)
    cases = [
        (b"GET http://[::1/readyz HTTP/1.1\r\n\r\n", b"HTTP/1.1 400 "),
        (b"GET /readyz HTTP/1.1\r\nx: " + b"a" * 60000 + b"\r\n\r\n", b"HTTP/1.1 431 "),
        (b"POST /readyz HTTP/1.1\r\ncontent-length: 0\r\n\r\n", b"HTTP/1.1 405 "),
        (b"\x16\x03\x01\x00\xa5junk\r\n\r\n", b"HTTP/1.1 400 "),
        (b"HEAD /readyz HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 "),
    ]
    for request, status in cases:
        assert raw(management, request).startswith(status), request[:40]
        assert get(management, "/livez")[0] == 200, request[:40]
    assert not process.has_line("Traceback|background task .* failed"), process.output()


TRIO = pytest.param(("hypercorn", "examples.asgi_app:app", HYPERCORN_RUNNING), id="hypercorn-trio")


@pytest.mark.parametrize("server", [*SERVERS, TRIO])
def test_the_listener_outlives_running_out_of_descriptors(
    servers: list[ServerProcess], server: tuple[str, str, str], request: pytest.FixtureRequest
) -> None:
    """EMFILE at accept (the server's limit lowered to 64 descriptors, 80 connections
    held): one warning, and once they are closed the probes are answered again."""
    trio = ("--loop", "trio") if request.node.callspec.id.endswith("trio") else ()
    process, management = start(servers, server, *trio)
    resource.prlimit(process.proc.pid, resource.RLIMIT_NOFILE, (64, 64))
    held = [socket.create_connection(("127.0.0.1", management), timeout=10) for _ in range(80)]
    try:
        process.wait_for_line(r"management listener: accept failed")
    finally:
        for sock in held:
            sock.close()
    wait_for_status(management, "/readyz", 200)
    assert not process.has_line("Traceback|background task .* failed"), process.output()


def test_health_on_app_port_serves_both(servers: list[ServerProcess]) -> None:
    process, management = start(
        servers, SERVERS[0].values[0], "--health-on-app-port", "--prestop-path", "/prestop"
    )
    assert get(process.port, "/readyz") == (200, "ready\n")
    assert get(management, "/readyz") == (200, "ready\n")
    process.wait_for_line(r"--prestop-path /prestop is answered on the app's port: anyone")


def test_a_prestop_path_on_the_app_port_is_warned_of(servers: list[ServerProcess]) -> None:
    process = ServerProcess(
        [sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0",
         "--prestop-path", "/prestop"]
    )  # fmt: skip
    servers.append(process)
    line = process.wait_for_line(r"--prestop-path /prestop is answered on the app's port.*")
    assert "--management-port" in line.group(0)


def test_bad_management_options_are_one_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        line = assert_usage_error(
            graceful_run("examples.asgi_app:app", "--management-port", port), "--management-port"
        )
        assert f"port {port} on 127.0.0.1 is in use" in line
        line = assert_usage_error(
            graceful_run("examples.asgi_app:app", "--port", "8123", "--management-port", "8123")
        )
        assert "--management-port 8123 is the app's --port" in line
    assert_usage_error(
        graceful_run("examples.asgi_app:app", "--management-host", "127.0.0.1"),
        "--management-host",
        "--management-port",
    )
    workers = ("--workers", "2", "--management-port", "0")
    assert_usage_error(
        graceful_run("examples.asgi_app:app", *workers, "--readiness-on-shutdown", "keep"),
        "--readiness-on-shutdown",
        "--workers",
    )
    env = clean_environment()
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    assert_usage_error(
        graceful_run("examples.asgi_app:app", *workers, "--metrics-path", "/metrics", env=env),
        "--metrics-path",
        "PROMETHEUS_MULTIPROC_DIR",
    )
    assert_usage_error(
        graceful_run("examples.asgi_app:app", "--management-port", "65536"), "--management-port"
    )


def test_workers_share_one_management_listener_in_the_parent(
    servers: list[ServerProcess], tmp_path: Path
) -> None:
    """``--workers 2``: the parent answers for the pod — every worker's metrics (from
    PROMETHEUS_MULTIPROC_DIR), readiness 503 from its SIGTERM on while the workers drain
    (a request in flight keeps them), and closes after the last worker exited."""
    process = ServerProcess(
        [sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0",
         "--workers", "2", "--management-port", "0", "--metrics-path", "/metrics",
         "--prestop-path", "/prestop", "--policy", "refuse-immediately"],
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )  # fmt: skip
    servers.append(process)
    line = process.wait_for_line(MANAGEMENT_PARENT)
    management = int(line.group(1))
    assert line.group(2) == "readiness /readyz, liveness /livez, prestop /prestop, metrics /metrics"
    process.port = int(process.wait_for_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
    process.wait_for_line(r"worker \d+ serves", count=2)
    wait_until_ready(management)
    assert get(management, "/readyz") == (200, "ready (2 workers)\n")
    for path in ("/prestop", "/metrics", "/readyz"):
        assert get(process.port, path)[0] == 404, path  # the app's
    status, body = get(management, "/metrics")
    assert status == 200
    assert re.search(r"^graceful_phase", body, re.M), body[:2000]
    assert not process.has_line(r"management listener on 127\.0\.0\.1 port \d+: ")  # no worker's
    # A request in flight holds its worker; meanwhile the pod is not ready.
    slow = RawHTTP(process.port)
    slow.send("/slow?s=2")
    process.wait_for_line(r"slow request started")
    process.signal(signal.SIGTERM)
    process.wait_for_line(r"SIGTERM: stopping 2 workers")
    assert get(management, "/readyz")[0] == 503
    assert get(management, "/livez")[0] == 200
    assert slow.response()[0] == 200
    assert process.wait_exit() == 0
    assert connection_refused(management)


def test_a_prestop_on_the_parents_port_drains_every_worker(
    servers: list[ServerProcess],
) -> None:
    process = ServerProcess(
        [sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0",
         "--workers", "2", "--management-port", "0", "--prestop-path", "/prestop",
         "--policy", "accept-until-idle", "--idle", "1"]
    )  # fmt: skip
    servers.append(process)
    management = int(process.wait_for_line(MANAGEMENT_PARENT).group(1))
    process.wait_for_line(r"worker \d+ serves", count=2)
    wait_until_ready(management)
    status, body = get(management, "/prestop", timeout_s=30)
    assert (status, body) == (200, "stopped: every worker exited\n")
    assert process.wait_for_line(r"serving -> accepting: SIGTERM", count=2)
    assert process.has_line(r"exited \(exit status 0\)")
    assert process.wait_exit() == 0


MANAGEMENT_PARENT = r"management listener on 127\.0\.0\.1 port (\d+), for every worker: (.*)"


def wait_until_ready(port: int, timeout_s: float = 15.0) -> None:
    """Until the parent's readiness says a worker serves (its first byte on the pipe)."""
    wait_for(
        lambda: get(port, "/readyz")[0] == 200, timeout_s, "the pod's readiness 200", poll_s=0.02
    )


GUNICORN_WORKERS = [
    pytest.param(("graceful.gunicorn.UvicornWorker", "examples.asgi_app:app"), id="UvicornWorker"),
    pytest.param(
        ("graceful.gunicorn.SyncWorker", "tests.support.wsgi_apps.flask_app:app"), id="SyncWorker"
    ),
]
MANAGEMENT_MASTER = (
    r"management listener on 127\.0\.0\.1 port (\d+), in gunicorn's master, for every "
    r"worker: (.*)"
)


@pytest.mark.parametrize("worker", GUNICORN_WORKERS)
def test_gunicorns_master_serves_the_management_port(
    servers: list[ServerProcess], tmp_path: Path, worker: tuple[str, str]
) -> None:
    """Two workers: the master answers for the pod — readiness 503 from its SIGTERM on
    while a request in flight holds a worker, every worker's metrics — and the workers
    leave the paths to the app."""
    pytest.importorskip("gunicorn")
    worker_class, app = worker
    process = ServerProcess(
        [sys.executable, "-m", "gunicorn", "-k", worker_class, "-w", "2", "-b", "127.0.0.1:0",
         "--graceful-timeout", "10", app],
        env={"GRACEFUL_MANAGEMENT_PORT": "0", "GRACEFUL_METRICS_PATH": "/metrics",
             "GRACEFUL_PRESTOP_PATH": "/prestop", "GRACEFUL_POLICY": "refuse-immediately",
             "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )  # fmt: skip
    servers.append(process)
    line = process.wait_for_line(MANAGEMENT_MASTER, timeout_s=20)
    management = int(line.group(1))
    assert line.group(2) == "readiness /readyz, liveness /livez, prestop /prestop, metrics /metrics"
    process.port = int(process.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
    wait_until_ready(management)
    for path in ("/prestop", "/metrics", "/readyz"):
        assert get(process.port, path)[0] == 404, path  # the app's
    status, body = get(management, "/metrics")
    assert status == 200
    assert re.search(r"^graceful_phase", body, re.M), body[:2000]
    slow = RawHTTP(process.port)
    slow.send("/slow?s=2")
    process.wait_for_line(r"slow request started")
    process.signal(signal.SIGTERM)
    wait_for_status(management, "/readyz", 503)
    assert get(management, "/livez")[0] == 200
    assert slow.response()[0] == 200
    assert process.wait_exit(timeout_s=20) == 0
    assert connection_refused(management)
    assert not process.has_line(r"ERROR|Traceback"), process.output()


@pytest.mark.parametrize("worker", GUNICORN_WORKERS)
def test_a_prestop_on_gunicorns_master_drains_every_worker(
    servers: list[ServerProcess], worker: tuple[str, str]
) -> None:
    pytest.importorskip("gunicorn")
    worker_class, app = worker
    process = ServerProcess(
        [sys.executable, "-m", "gunicorn", "-k", worker_class, "-w", "2", "-b", "127.0.0.1:0",
         "--graceful-timeout", "10", app],
        env={"GRACEFUL_MANAGEMENT_PORT": "0", "GRACEFUL_PRESTOP_PATH": "/prestop",
             "GRACEFUL_IDLE": "0.5"},
    )  # fmt: skip
    servers.append(process)
    management = int(process.wait_for_line(MANAGEMENT_MASTER, timeout_s=20).group(1))
    wait_until_ready(management)
    assert get(management, "/prestop", timeout_s=30) == (200, "stopped: every worker exited\n")
    assert process.wait_exit(timeout_s=20) == 0
    assert not process.has_line(r"ERROR|Traceback"), process.output()


def wait_for_status(port: int, path: str, status: int, timeout_s: float = 10.0) -> None:
    wait_for(
        lambda: get(port, path)[0] == status, timeout_s, f"{path} answering {status}", poll_s=0.02
    )
