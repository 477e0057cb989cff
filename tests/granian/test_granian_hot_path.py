"""graceful's granian hot path (``graceful.granian._hot``) against real granian
processes: the self-test at the first request, intact and broken on purpose
(``tests/granian/selftest_app.py``), and the requests it started adopted at SIGTERM —
counted, nudged, answered, cut with a 503.  Waits are on log lines and on what the
client receives."""

from __future__ import annotations

import re
import signal
import sys
import threading
from collections.abc import Iterator

import pytest

granian = pytest.importorskip("granian")

from tests.support.servers import (  # noqa: E402
    ACCEPTING,
    POLICIES,
    RawHTTP,
    ServerProcess,
    decoded_body,
)

SELF_TEST_FAILED = r"hot path self-test failed"
RUNNING = r"running on http://127\.0\.0\.1:(\d+)"
SLOW_STARTED = r"slow request started"


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    RawHTTP.close_all()
    for server in started:
        server.stop()


def start(servers: list[ServerProcess], broken: str, *options: str) -> ServerProcess:
    """``graceful run --server granian`` of the self-test app, ``SELFTEST_BREAK=broken``."""
    args = [
        sys.executable, "-m", "graceful", "run", "tests.granian.selftest_app:app",
        "--server", "granian", "--port", "0", *options,
    ]  # fmt: skip
    server = ServerProcess(args, env={"SELFTEST_BREAK": broken})
    servers.append(server)
    server.port = int(server.wait_for_line(RUNNING).group(1))
    return server


@pytest.mark.parametrize("broken", ["", "watcher"], ids=["intact", "watcher"])
def test_granian_hot_path_self_test(servers: list[ServerProcess], broken: str) -> None:
    """The first request is answered; broken, one warning naming granian, its version
    and what did not hold, and every later request through the middleware.  Either way a
    slow request in flight at SIGTERM is counted (intact: the hot path's finder adopts
    it; broken: the middleware counts it) and answered 200, not cut."""
    server = start(
        servers, broken, *("--policy", "accept-until-idle", "--idle", "0.5"),
        "--grace-period", "30",
    )  # fmt: skip
    client = RawHTTP(server.port)
    assert client.get("/")[::2] == (200, b"hello\n")
    if broken:
        line = server.wait_for_line(SELF_TEST_FAILED).string
        assert f"granian {granian.__version__}" in line, line
        assert "future_watcher" in line, line
    for _ in range(3):
        assert client.get("/")[::2] == (200, b"hello\n")
    slow = RawHTTP(server.port)
    slow.send("/slow?s=1.5")
    server.wait_for_line(SLOW_STARTED)
    server.signal(signal.SIGTERM)
    assert re.search(r"connections?, 1 request[;)]", server.wait_for_line(ACCEPTING).string)
    status, headers, body = slow.response()
    assert (status, body) == (200, b"slept 1.5\n")
    assert headers["connection"] == "close"  # nudged: its response began after SIGTERM
    assert server.wait_exit() == 0
    output = server.output()
    assert output.count("self-test failed") == (1 if broken else 0), output
    assert "cutting" not in output, output


def test_adopted_requests_cut_with_503_and_counted(servers: list[ServerProcess]) -> None:
    """Two requests the hot path started, in flight at SIGTERM past the drain deadline:
    both adopted (the shutdown line counts them), both answered 503 with ``Connection:
    close`` by the cut, and the process exits 0 well before the kill deadline."""
    server = start(
        servers, "", *POLICIES["refuse-immediately"], "--drain-timeout", "1",
        "--grace-period", "10",
    )  # fmt: skip
    assert RawHTTP(server.port).get("/")[0] == 200  # the self-test's request
    clients = [RawHTTP(server.port) for _ in range(2)]
    for started, client in enumerate(clients, 1):
        client.send("/slow?s=30")
        server.wait_for_line(SLOW_STARTED, count=started)
    server.signal(signal.SIGTERM)
    assert re.search(r"connections?, 2 requests[;)]", server.wait_for_line(ACCEPTING).string)
    killer = threading.Timer(10, server.proc.send_signal, (signal.SIGKILL,))
    killer.start()
    try:
        for client in clients:
            status, headers, body = client.response()
            assert (status, decoded_body(headers, body)) == (503, b"server shutting down\n")
            assert headers["connection"] == "close"
        assert server.wait_exit(timeout_s=15) == 0  # 0, not -9: out before the SIGKILL
    finally:
        killer.cancel()
    assert server.has_line(r"cutting 2 request")
    assert len(re.findall(r"request /slow cut", server.output())) == 2
