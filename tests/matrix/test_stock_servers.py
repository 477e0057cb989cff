"""GracefulMiddleware under a server that is not graceful's — plain ``uvicorn app:app``
and ``hypercorn app:app`` — does what it honestly can, and says the rest.

* Alone, nothing runs the coordinator: the health endpoints answer (readiness never
  fails), the server stops as it always does, and one warning at start-up says so.
* With ``coordinator.run()`` in the app's lifespan under uvicorn, the coordinator takes
  SIGTERM: the readiness endpoint fails, new requests are still served while accepting,
  the request in flight completes, and once the coordinator stopped it hands the signal
  back to the server, which then stops too (it used to wait for SIGKILL).  Under
  ``hypercorn.asyncio.serve``, whose event loop handles SIGTERM itself, a warning says
  that the server stops at the signal.  (The ``hypercorn`` command runs the app in a
  child process and handles the signals in its parent: nothing in the app can see them.)

Real server processes, real signals, raw HTTP clients."""

from __future__ import annotations

import re
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.servers import RawHTTP, ServerProcess

APP = "tests.support.stock_apps.starlette_app:app"
WARNING = "GracefulMiddleware: no graceful server runs this app"
SERVERS = {
    "uvicorn": ([sys.executable, "-m", "uvicorn", APP, "--port", "0"],
                r"Uvicorn running on http://127\.0\.0\.1:(\d+)"),
    "hypercorn": ([sys.executable, "-m", "hypercorn", APP, "--bind", "127.0.0.1:0"],
                  r"Running on http://127\.0\.0\.1:(\d+)"),
}  # fmt: skip


def start(server: str, **env: str) -> tuple[ServerProcess, int]:
    args, running = SERVERS[server]
    process = ServerProcess(args, env=env)
    return process, int(process.wait_for_line(running).group(1))


def readiness_fails(port: int, timeout_s: float = 5.0) -> bool:
    """Whether ``/readyz`` answers 503 within ``timeout_s`` (a signal is handled
    asynchronously; each probe is a new connection, as the kubelet's)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if RawHTTP(port).get("/readyz")[0] == 503:
            return True
    return False


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    RawHTTP.close_all()


@pytest.mark.parametrize("server", SERVERS)
def test_alone_it_warns_once_and_the_server_stops_as_it_does(server: str) -> None:
    process, port = start(server, RUN_COORDINATOR="0")
    try:
        process.wait_for_line(WARNING)
        assert RawHTTP(port).get("/readyz")[0] == 200
        process.signal(signal.SIGTERM)
        process.wait_exit()
    finally:
        process.stop()
    assert process.output().count(WARNING) == 1


def test_with_run_in_the_lifespan_the_policy_runs_then_the_server_stops() -> None:
    process, port = start("uvicorn", RUN_COORDINATOR="1")
    try:
        slow = RawHTTP(port)
        slow.send("/slow?s=2")
        process.wait_for_line(r"slow request started")
        process.signal(signal.SIGTERM)
        assert readiness_fails(port)  # the balancer is told
        assert RawHTTP(port).get("/")[0] == 200  # while accepting, still served
        assert slow.response()[0] == 200
        process.wait_exit(timeout_s=15)  # not SIGKILL at the grace period
    finally:
        process.stop()
    assert WARNING not in process.output()


#: The coordinator's lines, in uvicorn's format (``INFO:     …``).
PHASE_LINES = (
    r"policy accept-until-idle \(idle 1 s, at most 30 s\); kill deadline: grace period 20 s",
    r"serving -> accepting: SIGTERM",
    r"accepting -> draining: ",
    r"draining -> stopping: ",
    r"stopping -> stopped: ",
)


def test_with_run_in_the_lifespan_the_phases_are_in_uvicorns_log_once() -> None:
    """Stock uvicorn configures its own loggers only: graceful's lines go through its
    handler (they used to go nowhere, so "no phase line" looked like a lost SIGTERM)."""
    process, _ = start("uvicorn", RUN_COORDINATOR="1")
    try:
        process.wait_for_line(PHASE_LINES[0])
        process.signal(signal.SIGTERM)
        process.wait_for_line(PHASE_LINES[-1])
        process.wait_exit(timeout_s=15)
    finally:
        process.stop()
    output = process.output()
    for line in PHASE_LINES:
        assert len(re.findall(rf"^INFO:     {line}", output, re.MULTILINE)) == 1, output


#: hypercorn's documented API, ``hypercorn.asyncio.serve(app, config)``, which handles
#: SIGTERM and SIGINT in its event loop when given no shutdown trigger.
HYPERCORN_SERVE = f"""\
import asyncio, hypercorn.asyncio, hypercorn.config
from {APP.split(":")[0]} import app
config = hypercorn.config.Config()
config.bind = ["127.0.0.1:0"]
asyncio.run(hypercorn.asyncio.serve(app, config))
"""


def test_under_hypercorn_serve_run_in_the_lifespan_says_the_server_stops_at_the_signal() -> None:
    """``hypercorn.asyncio.serve`` handles SIGTERM in its event loop, which no
    Python-level handler can take over: the coordinator says so at start-up; the
    server's own shutdown then lets the request in flight finish."""
    process = ServerProcess([sys.executable, "-c", HYPERCORN_SERVE], env={"RUN_COORDINATOR": "1"})
    port = int(process.wait_for_line(SERVERS["hypercorn"][1]).group(1))
    try:
        process.wait_for_line(r"also handled by the event loop")
        slow = RawHTTP(port)
        slow.send("/slow?s=1")
        process.wait_for_line(r"slow request started")
        process.signal(signal.SIGTERM)
        assert slow.response()[0] == 200
        process.wait_exit(timeout_s=15)
    finally:
        process.stop()
    assert WARNING not in process.output()
