"""The hot paths' self-test against real servers whose request handling was changed on
purpose (``tests/support/selftest_apps``): one warning naming the server, its version
and what did not hold, and every later request through the middleware — a request in
flight at SIGTERM is still waited for."""

from __future__ import annotations

import re
import signal
import sys
from importlib.metadata import version

import pytest
import uvicorn

from tests.support.servers import ACCEPTING, RawHTTP, ServerProcess, hypercorn_launch

SELF_TEST_FAILED = r"hot path self-test failed"


def start(servers: list[ServerProcess], app: str, broken: str, *options: str) -> ServerProcess:
    """``graceful run`` on a free port with ``SELFTEST_BREAK=broken``."""
    args = [sys.executable, "-m", "graceful", "run", app, "--port", "0", *options]
    server = ServerProcess(args, env={"SELFTEST_BREAK": broken})
    servers.append(server)
    server.port = int(server.wait_for_line(r"running on http://127\.0\.0\.1:(\d+)").group(1))
    return server


def assert_self_test(server: ServerProcess, broken: bool, *said: str) -> str:
    """The first request is answered; broken, one warning saying each of ``said``; a
    slow request in flight at SIGTERM is counted (broken: by the middleware; without
    the self-test the line would say 0 requests and only the connection would keep the
    drain going) and answered 200, not cut.  Returns the server's output."""
    client = RawHTTP(server.port)
    assert client.get("/")[::2] == (200, b"hello\n")
    if broken:
        line = server.wait_for_line(SELF_TEST_FAILED).string
        for part in said:
            assert part in line, line
    for _ in range(3):
        assert client.get("/")[::2] == (200, b"hello\n")
    slow = RawHTTP(server.port)
    slow.send("/slow?s=1.5")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    assert re.search(r"connections?, 1 request[;)]", server.wait_for_line(ACCEPTING).string)
    status, _, body = slow.response()
    assert (status, body) == (200, b"slept 1.5\n")
    assert server.wait_exit() == 0
    output = server.output()
    assert output.count("self-test failed") == (1 if broken else 0), output
    assert "cutting" not in output, output
    return output


@pytest.mark.parametrize(
    ("broken", "loop"),
    [("", "asyncio"), ("task", "asyncio"), ("task", "uvloop"), ("scope", "asyncio")],
    ids=["intact", "task", "task-uvloop", "scope"],
)
def test_uvicorn_hot_path_self_test(servers: list[ServerProcess], broken: str, loop: str) -> None:
    """With the contract broken the first request logs one warning (uvicorn, its
    version, what did not hold) and is answered; a slow request in flight at SIGTERM
    is counted (the middleware's) and waited for (200, not cut).  Intact: no warning,
    the same drain (the hot path's finder counts it)."""
    server = start(
        servers,
        "tests.support.selftest_apps.uvicorn_broken:app",
        broken,
        *("--http", "httptools", "--loop", loop),
        *("--policy", "accept-until-idle", "--idle", "0.5", "--grace-period", "30"),
    )
    what = {"": "", "task": "server_state.tasks", "scope": "scope"}[broken]
    assert_self_test(server, bool(broken), f"uvicorn {uvicorn.__version__}", what)


@pytest.mark.parametrize(
    ("broken", "worker"),
    [("", "asyncio"), ("config", "asyncio"), ("config", "trio")],
    ids=["intact", "config", "config-trio"],
)
def test_hypercorn_hot_path_self_test(
    servers: list[ServerProcess], broken: str, worker: str
) -> None:
    """hypercorn, its application call changed: one warning at the first request, the
    slow request in flight at SIGTERM counted by the middleware and answered."""
    if worker == "trio":
        pytest.importorskip("trio")
    server = hypercorn_launch(
        *("--app", "tests.support.selftest_apps.hypercorn_broken:app"),
        *("--policy", "accept-until-idle", "--idle", "0.5", "--grace-period", "30"),
        worker=worker,
        env={"SELFTEST_BREAK": broken},
    )
    servers.append(server)
    assert_self_test(server, bool(broken), f"hypercorn {version('hypercorn')}", "Config")
