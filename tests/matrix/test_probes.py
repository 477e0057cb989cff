"""Probes are not traffic, on every server: health checks on fresh connections (what the
kubelet sends, every second) do not keep accept-until-idle accepting; real requests do.
And ``--readiness-on-shutdown keep`` keeps readiness 200 while accepting.

Real ``graceful run`` processes (uvicorn, hypercorn on asyncio and trio, aiohttp), real
signals, a fresh TCP connection per request as the kubelet opens."""

from __future__ import annotations

import http.client
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tests.cli.test_cli_servers import (
    AIOHTTP_APP,
    AIOHTTP_RUNNING,
    HYPERCORN_RUNNING,
    UVICORN_RUNNING,
)
from tests.support.servers import ServerProcess

SERVERS = [
    pytest.param([], "examples.asgi_app:app", UVICORN_RUNNING, id="uvicorn"),
    pytest.param(["--server", "hypercorn", "--loop", "asyncio"], "examples.asgi_app:app",
                 HYPERCORN_RUNNING, id="hypercorn"),
    pytest.param(["--server", "hypercorn", "--loop", "trio"], "examples.asgi_app:app",
                 HYPERCORN_RUNNING, id="hypercorn-trio"),
    pytest.param(["--server", "aiohttp"], AIOHTTP_APP, AIOHTTP_RUNNING, id="aiohttp"),
]  # fmt: skip
#: Accepting ends 1 s after the last activity, at most 20 s after SIGTERM.
POLICY = ["--idle", "1", "--max-wait", "20", "--grace-period", "40"]
DRAINING = r"accepting -> draining: no new connection for"


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    yield servers
    for server in servers:
        server.stop()


def start(
    started: list[ServerProcess], options: list[str], app: str, running: str, *extra: str
) -> tuple[ServerProcess, int]:
    import sys

    server = ServerProcess(
        [sys.executable, "-m", "graceful", "run", app, "--port", "0", *options, *POLICY, *extra]
    )
    started.append(server)
    port = int(server.wait_for_line(running).group(1))
    return server, port


def get(port: int, path: str, user_agent: str | None = None) -> int:
    """One request on a fresh connection, closed after it (as the kubelet's probes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        headers = {"Connection": "close"}
        if user_agent is not None:
            headers["User-Agent"] = user_agent
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def every(period_s: float, stop: threading.Event, action: object) -> threading.Thread:
    def loop() -> None:
        for _ in range(200):  # bounded: 200 requests at most
            if stop.is_set():
                return
            try:
                action()  # type: ignore[operator]
            except OSError:
                return  # the listener closed
            stop.wait(period_s)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("options", "app", "running"), SERVERS)
@pytest.mark.parametrize(
    ("path", "user_agent"),
    [("/readyz", "kube-probe/1.30"), ("/livez", None), ("/", "kube-probe/1.30")],
    ids=["readiness-probe", "liveness-path", "probe-user-agent"],
)
def test_probes_do_not_keep_the_server_accepting(
    started: list[ServerProcess],
    options: list[str],
    app: str,
    running: str,
    path: str,
    user_agent: str | None,
) -> None:
    server, port = start(started, options, app, running)
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting")
    stop = threading.Event()
    # Three probes a second on fresh connections: counted, they would keep the 1 s idle
    # window from ever ending (until max-wait, 20 s).
    prober = every(0.3, stop, lambda: get(port, path, user_agent))
    try:
        server.wait_for_line(DRAINING, timeout_s=6)
    finally:
        stop.set()
        prober.join(10)
    assert server.wait_exit(15) == 0


@pytest.mark.parametrize(("options", "app", "running"), SERVERS)
def test_real_requests_keep_the_server_accepting(
    started: list[ServerProcess], options: list[str], app: str, running: str
) -> None:
    server, port = start(started, options, app, running)
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting")
    stop = threading.Event()
    served: list[int] = []
    traffic = every(0.3, stop, lambda: served.append(get(port, "/")))
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert "accepting -> draining" not in server.output(), "stopped accepting under traffic"
        time.sleep(0.05)
    stop.set()
    traffic.join(10)
    assert served
    assert set(served) == {200}
    server.wait_for_line(DRAINING, timeout_s=6)
    assert server.wait_exit(15) == 0


@pytest.mark.parametrize(("options", "app", "running"), SERVERS)
@pytest.mark.parametrize(("choice", "status"), [("fail", 503), ("keep", 200)])
def test_readiness_while_accepting(
    started: list[ServerProcess],
    options: list[str],
    app: str,
    running: str,
    choice: str,
    status: int,
) -> None:
    server, port = start(started, options, app, running, "--readiness-on-shutdown", choice)
    assert get(port, "/readyz") == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting")
    assert get(port, "/readyz", "kube-probe/1.30") == status
    server.wait_for_line(DRAINING, timeout_s=6)
    assert server.wait_exit(15) == 0
