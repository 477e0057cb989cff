"""graceful run --server granian: granian's embedded server as a real process, real
clients, real signals — and stock granian beside it ("never worse than stock").

Every test starts ``graceful run --server granian`` (or ``python -m granian``) on
``examples.asgi_app:app`` as a subprocess on a loopback port and waits on log lines —
the coordinator logs every phase change, the adapter logs granian's ``stop()`` — or on
what the client receives, never on the clock.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

pytest.importorskip("granian")

from tests.support.servers import (
    ACCEPTING,
    DRAINING,
    POLICIES,
    STOPPED,
    RawHTTP,
    ServerProcess,
    connection_refused,
    decoded_body,
    graceful_run,
    wait_for,
)

GRANIAN = ("--server", "granian")
#: The adapter's line when it calls granian's ``stop()``.
STOP_CALLED = r"granian: listener closed, idle connections closed"
SLOW_STARTED = r"slow request started"
MANAGEMENT = r"management listener on 127\.0\.0\.1 port (\d+)"


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    RawHTTP.close_all()
    for server in started:
        server.stop()


def start(servers: list[ServerProcess], *options: str) -> ServerProcess:
    server = graceful_run(*GRANIAN, *options)
    servers.append(server)
    return server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stock_granian(servers: list[ServerProcess]) -> ServerProcess:
    port = free_port()
    server = ServerProcess(
        [sys.executable, "-m", "granian", "--interface", "asgi", "--port", str(port),
         "examples.asgi_app:app"]
    )  # fmt: skip
    servers.append(server)
    server.wait_for_line(r"Started worker-1")
    server.port = port
    # Each granian worker binds its own listener (SO_REUSEPORT) once it runs.
    wait_for(lambda: not connection_refused(port), 10, "stock granian listens")
    return server


def assert_clean_exit(server: ServerProcess) -> None:
    assert server.wait_exit() == 0, server.output()
    assert server.has_line(STOPPED)
    assert server.has_line(r"lifespan shutdown")


# ----------------------------------------------------------- requests in flight


@pytest.mark.parametrize("policy", list(POLICIES))
def test_request_in_flight_at_sigterm_completes(servers: list[ServerProcess], policy: str) -> None:
    """A request in flight at SIGTERM gets its whole response (with ``Connection:
    close``), granian's ``stop()`` comes only at draining, and the process exits 0
    after the app's lifespan shutdown."""
    server = start(servers, *POLICIES[policy])
    client = RawHTTP(server.port)
    client.send("/slow?s=2")
    server.wait_for_line(SLOW_STARTED)
    server.signal(signal.SIGTERM)
    status, headers, body = client.response()
    assert (status, body) == (200, b"slept 2\n")
    assert headers["connection"] == "close"
    assert client.closed_by_peer()
    assert_clean_exit(server)
    lines = server.output()
    assert lines.index("-> draining") < lines.index("granian: listener closed")


@pytest.mark.parametrize("policy", ["accept-until-idle", "serve-until-killed"])
def test_new_connections_served_while_accepting_then_refused(
    servers: list[ServerProcess], policy: str
) -> None:
    """While the policy accepts, granian still accepts: a new connection is served (its
    response nudged with ``Connection: close``) and readiness answers 503; once the
    adapter called granian's ``stop()``, connections are refused."""
    server = start(servers, *POLICIES[policy])
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, headers, body = RawHTTP(server.port).get("/")
    assert (status, body) == (200, b"hello\n")
    nudged = policy == "accept-until-idle"  # serve-until-killed does not nudge by default
    assert (headers.get("connection") == "close") is nudged
    assert RawHTTP(server.port).get("/readyz")[0] == 503
    assert RawHTTP(server.port).get("/livez")[0] == 200
    server.wait_for_line(STOP_CALLED)
    # granian's Rust listener closes a moment after stop() returned.
    wait_for(lambda: connection_refused(server.port), 10, "granian's listener closed")
    assert_clean_exit(server)


def test_keep_alive_is_nudged_then_idle_connection_closed_not_cut(
    servers: list[ServerProcess],
) -> None:
    """A keep-alive connection that sends a request while accepting gets ``Connection:
    close`` and is closed after the response; one that stays idle is closed with a FIN
    (no reset) when granian stops, after draining began."""
    server = start(servers, *POLICIES["accept-until-idle"])
    busy, idle = RawHTTP(server.port), RawHTTP(server.port)
    assert busy.get("/")[0] == 200
    assert idle.get("/")[0] == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, headers, _ = busy.get("/")
    assert (status, headers["connection"]) == (200, "close")
    assert busy.closed_by_peer()
    server.wait_for_line(DRAINING)
    idle.sock.settimeout(10)
    assert idle.sock.recv(1) == b""  # a FIN: ConnectionResetError would fail the test
    server.wait_for_line(STOP_CALLED)  # the FIN can reach us before the line is read
    assert server.output().index("-> draining") < server.output().index("granian: listener closed")
    assert_clean_exit(server)


def test_request_longer_than_the_drain_deadline_is_cut_with_503_before_sigkill(
    servers: list[ServerProcess],
) -> None:
    """A request that would outlast the drain deadline is answered 503 with
    ``Connection: close`` at stopping, and the process exits 0 before the kill deadline:
    the test is the kubelet, SIGKILLing it at the grace period (stock granian, with
    its kill timeout off by default, waits for the request)."""
    server = start(servers, *POLICIES["refuse-immediately"], "--drain-timeout", "1",
                   "--grace-period", "6")  # fmt: skip
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(SLOW_STARTED)
    server.signal(signal.SIGTERM)
    killer = threading.Timer(6, server.proc.send_signal, (signal.SIGKILL,))
    killer.start()
    try:
        status, headers, body = client.response()
        assert (status, decoded_body(headers, body)) == (503, b"server shutting down\n")
        assert headers["connection"] == "close"
        assert server.wait_exit(timeout_s=10) == 0  # 0, not -9: out before the SIGKILL
    finally:
        killer.cancel()
    assert server.has_line(r"drain deadline reached")
    assert server.has_line(r"cutting 1 request")
    assert server.has_line(r"lifespan shutdown")


# ------------------------------------------------- health, preStop, DrainSignal


def test_prestop_answers_once_drained(servers: list[ServerProcess]) -> None:
    """``GET /prestop`` starts the drain and answers once the requests in flight are
    done; the process then exits 0."""
    server = start(servers, *POLICIES["refuse-immediately"], "--prestop-path", "/prestop")
    slow = RawHTTP(server.port)
    slow.send("/slow?s=1")
    server.wait_for_line(SLOW_STARTED)
    prestop = RawHTTP(server.port)
    prestop.send("/prestop")
    assert slow.response()[2] == b"slept 1\n"
    status, _, body = prestop.response()
    assert status == 200
    assert b"0 requests" in body
    assert server.has_line(r"preStop")
    assert_clean_exit(server)


def test_drain_signal_ends_a_stream_at_draining(servers: list[ServerProcess]) -> None:
    """The app's ``DrainSignal`` (``graceful.asgi.drain_signal(scope)``) is there under
    granian and fires at draining: the server-sent-event stream says goodbye and ends."""
    server = start(servers, *POLICIES["refuse-immediately"])
    assert RawHTTP(server.port).get("/signal")[2] == b"draining=False\n"
    with (
        httpx.Client(timeout=10) as client,
        client.stream("GET", f"http://127.0.0.1:{server.port}/sse?n=1000") as stream,
    ):
        lines = stream.iter_lines()
        assert next(lines) == "data: 0"
        server.signal(signal.SIGTERM)
        rest = list(lines)
    assert "event: bye" in rest
    assert_clean_exit(server)


def test_websocket_closed_with_1001(servers: list[ServerProcess]) -> None:
    """An open websocket gets a close frame with code 1001 once draining has lasted
    ``--websocket-close-grace``; nothing is cut and the process exits 0."""
    server = start(servers, *POLICIES["refuse-immediately"], "--websocket-close-grace", "0.2")
    with ws_connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=10) as ws:
        ws.send("ping")
        assert ws.recv(timeout=10) == "ping"
        server.signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1001
    # granian reports the client's answering close frame to the app as 1005 (no code).
    server.wait_for_line(r"websocket disconnected with code")
    assert_clean_exit(server)
    assert not server.has_line(r"cutting|drain deadline reached")


# ---------------------------------------------------------------------- workers


def test_two_workers_each_drain(servers: list[ServerProcess]) -> None:
    """``--workers 2``: one embedded granian per worker process on the parent's socket;
    a SIGTERM to the parent drains both, the request in flight completes."""
    server = start(servers, *POLICIES["accept-until-idle"], "--workers", "2")
    server.wait_for_line(r"granian running on", count=2)
    client = RawHTTP(server.port)
    client.send("/slow?s=1")
    server.wait_for_line(SLOW_STARTED)
    server.signal(signal.SIGTERM)
    assert client.response()[2] == b"slept 1\n"
    assert server.wait_exit() == 0, server.output()
    server.wait_for_line(STOPPED, count=2)
    server.wait_for_line(STOP_CALLED, count=2)


# ------------------------------------------------------------------ start-up


def test_unknown_app_exits_3(servers: list[ServerProcess]) -> None:
    server = ServerProcess(
        [sys.executable, "-m", "graceful", "run", *GRANIAN, "no_such_module:app", "--port", "0"]
    )
    servers.append(server)
    assert server.wait_exit() == 3
    assert server.has_line(r"failed to start: ModuleNotFoundError")


# -------------------------------------------------------------- stock, beside


def test_stock_granian_refuses_at_sigterm_graceful_keeps_serving(
    servers: list[ServerProcess],
) -> None:
    """Stock granian (``python -m granian``) at SIGTERM: its listener closes at once (a
    new connection is refused) and there is no readiness endpoint to fail; the request
    in flight finishes.  graceful's granian, same app, same signal: the new connection
    is served, readiness answers 503, the request in flight finishes too."""
    stock = stock_granian(servers)
    client = RawHTTP(stock.port)
    client.send("/slow?s=1")
    stock.wait_for_line(SLOW_STARTED)
    stock.signal(signal.SIGTERM)
    stock.wait_for_line(r"Shutting down granian")
    wait_for(lambda: connection_refused(stock.port), 10, "stock granian refuses")
    assert client.response()[2] == b"slept 1\n"
    assert stock.wait_exit() == 0, stock.output()

    ours = start(servers, *POLICIES["accept-until-idle"])
    client = RawHTTP(ours.port)
    client.send("/slow?s=1")
    ours.wait_for_line(SLOW_STARTED)
    ours.signal(signal.SIGTERM)
    ours.wait_for_line(ACCEPTING)
    assert RawHTTP(ours.port).get("/")[0] == 200
    assert RawHTTP(ours.port).get("/readyz")[0] == 503
    assert client.response()[2] == b"slept 1\n"
    assert_clean_exit(ours)


def test_management_port_serves_health_and_prestop(servers: list[ServerProcess]) -> None:
    """``--management-port``: readiness and preStop on a port of their own (the app's
    port has the app's routes only); preStop drains granian and answers."""
    server = start(servers, *POLICIES["refuse-immediately"], "--management-port", "0",
                   "--prestop-path", "/prestop")  # fmt: skip
    management = int(server.wait_for_line(MANAGEMENT).group(1))
    assert RawHTTP(management).get("/readyz")[0] == 200
    assert RawHTTP(server.port).get("/readyz")[0] == 404  # the app's own (none)
    status, _, body = RawHTTP(management).get("/prestop")
    assert status == 200
    assert b"0 requests" in body
    assert_clean_exit(server)


def test_run_example_drains(servers: list[ServerProcess]) -> None:
    """``examples/granian_run.py`` (the page's example, uvloop): a request in flight at
    SIGTERM completes and the process exits 0."""
    pytest.importorskip("uvloop")
    server = ServerProcess([sys.executable, "-m", "examples.granian_run", "--port", "0"])
    servers.append(server)
    server.port = int(server.wait_for_line(r"granian running on http://127\.0\.0\.1:(\d+)")[1])
    client = RawHTTP(server.port)
    client.send("/slow?s=1")
    server.wait_for_line(SLOW_STARTED)
    server.signal(signal.SIGTERM)
    assert client.response()[2] == b"slept 1\n"
    assert_clean_exit(server)
