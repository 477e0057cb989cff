"""graceful's uvicorn server off the middleware while nothing shuts down (the hot path),
against real clients: what the app sees, what is counted, what changes at SIGTERM."""

from __future__ import annotations

import re
import signal

import pytest

from tests.support.servers import ACCEPTING, RawHTTP, ServerProcess, graceful_run


def start(servers: list[ServerProcess], *options: str) -> ServerProcess:
    server = graceful_run(*options)
    servers.append(server)
    return server


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize(
    "options",
    [(), ("--reset-contextvars",), ("--limit-concurrency", "50"), ("--lifespan", "off")],
    ids=["default", "reset-contextvars", "limit-concurrency", "lifespan-off"],
)
def test_hot_path_requests_get_the_drain_signal_and_are_counted(
    servers: list[ServerProcess], options: tuple[str, ...], loop: str
) -> None:
    """graceful's server takes the middleware off the httptools hot path while nothing
    shuts down (whatever uvicorn's task options): the app still finds the DrainSignal
    in its scope (the lifespan state, also with lifespan off), every request is
    counted, health and metrics paths still reach the middleware; after SIGTERM
    requests take the middleware again and see the drain."""
    pytest.importorskip("prometheus_client")
    server = start(
        servers,
        *("--http", "httptools", "--loop", loop, "--metrics-path", "/metrics"),
        *("--policy", "accept-until-idle", "--idle", "0.5", *options),
    )
    client = RawHTTP(server.port)
    assert client.get("/signal")[::2] == (200, b"draining=False\n")
    for _ in range(3):
        assert client.get("/")[::2] == (200, b"hello\n")
    assert client.get("/readyz")[0] == 200
    status, _, metrics = client.get("/metrics")
    assert status == 200
    assert re.search(rb"(?m)^graceful_requests_total 4\.0$", metrics), metrics  # not health
    assert re.search(rb"(?m)^graceful_requests_in_flight 0\.0$", metrics), metrics
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, headers, body = client.get("/signal")
    assert (status, body) == (200, b"draining=False\n")  # accepting: not draining yet
    assert headers["connection"] == "close"  # the middleware's nudge
    late = RawHTTP(server.port)
    status, _, metrics = late.get("/metrics")
    assert re.search(rb"(?m)^graceful_requests_total 5\.0$", metrics), metrics
    assert server.wait_exit() == 0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_hot_path_request_in_flight_is_counted_then_adopted(
    servers: list[ServerProcess], loop: str
) -> None:
    """A request running on the hot path is in flight for the metrics (found in
    uvicorn's own task set), is adopted at SIGTERM — the drain waits for it, and its
    client gets its answer with ``Connection: close`` — and a request started after
    SIGTERM takes the middleware: the total counts each request once."""
    pytest.importorskip("prometheus_client")
    server = start(
        servers,
        *("--http", "httptools", "--loop", loop, "--metrics-path", "/metrics"),
        *("--policy", "accept-until-idle", "--idle", "5", "--grace-period", "30"),
    )
    slow = RawHTTP(server.port)
    slow.send("/slow?s=1.5")
    server.wait_for_line(r"slow request started")
    status, _, metrics = RawHTTP(server.port).get("/metrics")
    assert status == 200
    assert re.search(rb"(?m)^graceful_requests_in_flight 1\.0$", metrics), metrics
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, _, metrics = RawHTTP(server.port).get("/metrics")  # adopted: still 1
    assert re.search(rb"(?m)^graceful_requests_in_flight 1\.0$", metrics), metrics
    other = RawHTTP(server.port)
    assert other.get("/")[::2] == (200, b"hello\n")  # the middleware's path
    status, headers, _ = slow.response()
    assert status == 200
    assert headers["connection"] == "close"  # nudged: its response had not started
    status, _, metrics = RawHTTP(server.port).get("/metrics")
    assert re.search(rb"(?m)^graceful_requests_in_flight 0\.0$", metrics), metrics
    assert re.search(rb"(?m)^graceful_requests_total 2\.0$", metrics), metrics
