"""graceful run / graceful.uvicorn.Server against real clients, real signals.

Every test starts ``graceful run examples.asgi_app:app`` (or stock uvicorn) as a
subprocess on a free loopback port and waits on its log lines — the coordinator logs
every phase change (``serving -> accepting: SIGTERM``) — never on the clock.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterator

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

import graceful._demo as demo

from .servers import (
    ACCEPTING,
    DRAINING,
    POLICIES,
    STOPPED,
    RawHTTP,
    ServerProcess,
    connection_refused,
    graceful_run,
)


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    RawHTTP.close_all()
    for server in started:
        server.stop()


def start(servers: list[ServerProcess], *options: str) -> ServerProcess:
    server = graceful_run(*options)
    servers.append(server)
    return server


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # uvloop hides accept races
@pytest.mark.parametrize("http", ["h11", "httptools"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_request_in_flight_at_sigterm_completes(
    servers: list[ServerProcess], policy: str, http: str, loop: str
) -> None:
    server = start(servers, *POLICIES[policy], "--http", http, "--loop", loop)
    client = RawHTTP(server.port)
    client.send("/slow?s=1")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    status, headers, body = client.response()
    assert (status, body) == (200, b"slept 1\n")
    if policy == "serve-until-killed":  # no nudge: closed when draining begins
        assert "connection" not in headers
        assert client.closed_by_peer()
    else:
        assert headers["connection"] == "close"
    assert server.wait_exit() == 0
    assert server.has_line(ACCEPTING)
    assert server.has_line(STOPPED)
    assert server.has_line("lifespan shutdown")


@pytest.mark.parametrize("http", ["h11", "httptools"])
@pytest.mark.parametrize("policy", ["accept-until-idle", "serve-until-killed"])
def test_new_connection_during_accepting_is_served(
    servers: list[ServerProcess], policy: str, http: str
) -> None:
    server = start(servers, *POLICIES[policy], "--http", http)
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, _, body = RawHTTP(server.port).get("/")
    assert (status, body) == (200, b"hello\n")
    server.wait_for_line(DRAINING)
    lines = server.output().splitlines()
    served = next(i for i, line in enumerate(lines) if '"GET / HTTP/1.1" 200' in line)
    drained = next(i for i, line in enumerate(lines) if "accepting -> draining" in line)
    assert served < drained
    assert server.wait_exit() == 0


@pytest.mark.parametrize("http", ["h11", "httptools"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_new_connections_are_refused_once_draining(
    servers: list[ServerProcess], policy: str, http: str
) -> None:
    server = start(servers, *POLICIES[policy], "--http", http)
    client = RawHTTP(server.port)
    client.send("/slow?s=1.5")  # keeps the process alive while draining
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING)
    assert connection_refused(server.port)
    assert client.response()[0] == 200
    assert server.wait_exit() == 0


@pytest.mark.parametrize("http", ["h11", "httptools"])
@pytest.mark.parametrize(
    ("policy", "nudges"), [("accept-until-idle", True), ("serve-until-killed", False)]
)
def test_keep_alive_after_sigterm_is_nudged_per_policy(
    servers: list[ServerProcess], policy: str, nudges: bool, http: str
) -> None:
    server = start(servers, *POLICIES[policy], "--http", http)
    client = RawHTTP(server.port)
    status, headers, _ = client.get("/")
    assert status == 200
    assert headers.get("connection") != "close"
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, headers, _ = client.get("/")  # the same keep-alive connection
    assert status == 200
    assert (headers.get("connection") == "close") is nudges
    assert server.wait_exit() == 0


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_idle_keep_alive_is_closed_at_draining_not_before(
    servers: list[ServerProcess], http: str
) -> None:
    server = start(servers, *POLICIES["serve-until-killed"], "--http", http)
    client = RawHTTP(server.port)
    assert client.get("/")[0] == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, headers, _ = client.get("/")  # still open and usable while accepting
    assert status == 200
    assert headers.get("connection") != "close"
    server.wait_for_line(DRAINING)
    assert client.closed_by_peer(timeout_s=5)
    assert server.wait_exit() == 0


def test_accept_until_idle_exits_soon_after_the_last_new_connection(
    servers: list[ServerProcess],
) -> None:
    server = start(servers, "--policy", "accept-until-idle", "--idle", "1")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    for _ in range(3):  # new connections keep the listener open
        assert RawHTTP(server.port).get("/")[0] == 200
    last_connection = time.monotonic()
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - last_connection < 1 + 3  # idle + small (noisy machine)
    assert server.has_line(r"accepting -> draining: no new connection for")


def test_request_longer_than_drain_deadline_is_cut_cleanly(
    servers: list[ServerProcess],
) -> None:
    server = start(
        servers,
        "--policy",
        "refuse-immediately",
        "--drain-timeout",
        "1",
        "--grace-period",
        "6",
    )
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(r"slow request started")
    began = time.monotonic()
    server.signal(signal.SIGTERM)
    status, headers, _ = client.response()  # a clean answer, not a hang
    assert status == 503
    assert headers["connection"] == "close"
    assert client.closed_by_peer()
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - began < 6  # before the kill deadline
    assert server.has_line(r"drain deadline reached with \d+ connections?, 1 request\b")
    assert server.has_line("lifespan shutdown")


def test_websocket_gets_going_away(servers: list[ServerProcess]) -> None:
    server = start(servers, "--policy", "refuse-immediately", "--websocket-close-grace", "0.2")
    with ws_connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=10) as ws:
        ws.send("ping")
        assert ws.recv(timeout=10) == "ping"
        server.signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1001
    server.wait_for_line(r"websocket disconnected with code 1001")
    assert server.wait_exit() == 0


@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGQUIT,)], ids=["twice", "sigquit"]
)
def test_websocket_gets_going_away_on_escalation(
    servers: list[ServerProcess], signals: tuple[signal.Signals, ...]
) -> None:
    # The session's drain is requested from a loop callback (the signal), not a task.
    server = start(servers, *POLICIES["serve-until-killed"])
    with ws_connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=10) as ws:
        ws.send("ping")
        assert ws.recv(timeout=10) == "ping"
        for sig in signals:
            server.signal(sig)
            server.wait_for_line(ACCEPTING if sig is signal.SIGTERM else "stopping")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1001
    assert server.wait_exit() == 0
    assert not server.has_line(r"ERROR|Traceback|never awaited")


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_idle_keep_alive_may_send_one_more_request_at_draining(
    servers: list[ServerProcess], http: str
) -> None:
    server = start(servers, "--policy", "refuse-immediately", "--http", http)
    holder = RawHTTP(server.port)
    holder.send("/slow?s=2")  # keeps the drain going
    server.wait_for_line(r"slow request started")
    idle = RawHTTP(server.port)
    assert idle.get("/")[0] == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING)
    status, headers, _ = idle.get("/")  # sent right after draining began: answered
    assert status == 200
    assert headers["connection"] == "close"
    assert idle.closed_by_peer()
    assert holder.response()[0] == 200
    assert server.wait_exit() == 0


def test_readiness_flips_to_503_at_sigterm(servers: list[ServerProcess]) -> None:
    server = start(servers, *POLICIES["serve-until-killed"])
    assert RawHTTP(server.port).get("/readyz")[:1] == (200,)
    assert RawHTTP(server.port).get("/livez")[:1] == (200,)
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, _, body = RawHTTP(server.port).get("/readyz")
    assert status == 503
    assert body.startswith(b"shutting down")
    assert RawHTTP(server.port).get("/livez")[:1] == (200,)
    assert server.wait_exit() == 0


def test_prestop_endpoint_blocks_until_drained(servers: list[ServerProcess]) -> None:
    server = start(servers, "--policy", "refuse-immediately", "--prestop-path", "/prestop")
    slow = RawHTTP(server.port)
    slow.send("/slow?s=1")
    server.wait_for_line(r"slow request started")
    prestop = RawHTTP(server.port)
    prestop.send("/prestop")
    server.wait_for_line(r"serving -> accepting: preStop")
    assert slow.response()[0] == 200
    status, _, body = prestop.response()
    assert status == 200
    assert b"0 requests, 0 sessions left" in body
    lines = server.output().splitlines()
    order = [i for i, line in enumerate(lines) if "/slow" in line and " 200" in line]
    order += [i for i, line in enumerate(lines) if "/prestop" in line and " 200" in line]
    assert order == sorted(order)
    server.signal(signal.SIGTERM)  # the kubelet's SIGTERM after preStop returned
    assert server.wait_exit() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_second_signal_escalates(servers: list[ServerProcess], sig: signal.Signals) -> None:
    server = start(servers, *POLICIES["accept-until-idle"], "--drain-timeout", "60")
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    began = time.monotonic()
    server.signal(sig)
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - began < 5
    assert server.has_line(rf"accepting -> stopping: {sig.name} \(escalated\)")
    assert client.response()[0] == 503


def test_sigquit_stops_at_once(servers: list[ServerProcess]) -> None:
    server = start(servers, *POLICIES["serve-until-killed"])
    server.signal(signal.SIGQUIT)
    assert server.wait_exit(timeout_s=10) == 0
    assert server.has_line(r"serving -> stopping: SIGQUIT")


def test_bad_policy_exits_2_naming_it(servers: list[ServerProcess]) -> None:
    server = ServerProcess(
        [
            __import__("sys").executable,
            "-m",
            "graceful",
            "run",
            "examples.asgi_app:app",
            "--policy",
            "drain-slowly",
        ]
    )
    servers.append(server)
    assert server.wait_exit() == 2
    assert "unknown policy 'drain-slowly'" in server.output()
    assert "accept-until-idle" in server.output()


@pytest.mark.parametrize(
    ("server", "fails"), [("graceful:accept-until-idle", False), ("uvicorn", True)]
)
def test_rolling_restart(server: str, fails: bool) -> None:
    """Backend A gets SIGTERM while the balancer keeps routing new connections to it for
    1 s (graceful._demo's balancer: L4, no retries); keep-alive, fresh-connection and long
    requests run throughout.  Counts, not timings, are asserted."""
    args = demo.parse(
        ["--servers", server, "--propagation-delay", "1", "--keepalive-clients", "3",
         "--fresh-clients", "3", "--long-requests", "1"]
    )  # fmt: skip
    outcome = asyncio.run(demo.run_scenario(args.kinds[0], args))
    tally = outcome.tally
    assert tally.requests > 200
    assert outcome.terminating is not None
    assert outcome.terminating.ended != "killed"
    if fails:
        assert tally.failed > 0, tally.results  # stock uvicorn refuses new connections
    else:
        assert tally.failed == 0, tally.results


def test_workers_drain_together(servers: list[ServerProcess]) -> None:
    server = ServerProcess(
        [sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0",
         "--workers", "2", *POLICIES["accept-until-idle"]]
    )  # fmt: skip
    servers.append(server)
    server.port = int(server.wait_for_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(r"Application startup complete", count=2)
    clients = [RawHTTP(server.port) for _ in range(4)]
    for client in clients:
        client.send("/slow?s=1")
    server.wait_for_line(r"slow request started", count=4)
    server.signal(signal.SIGTERM)  # to the parent only, as in a container
    server.wait_for_line(ACCEPTING, count=2)  # forwarded to both workers
    assert [client.response()[0] for client in clients] == [200] * 4
    assert server.wait_exit() == 0
    assert server.output().count("stopping -> stopped") == 2


def test_third_signal_exits_at_once(servers: list[ServerProcess]) -> None:
    script = (
        "import anyio, graceful, logging\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "c = graceful.ShutdownCoordinator(hook_timeout_s=60, exit_on_third_request=True)\n"
        "async def hang():\n"
        "    print('hook hanging', flush=True)\n"
        "    await anyio.sleep(60)\n"
        "c.add_hook(hang)\n"
        "async def main():\n"
        "    async with anyio.create_task_group() as tg:\n"
        "        await tg.start(c.run)\n"
        "        print('ready', flush=True)\n"
        "anyio.run(main)\n"
    )
    server = ServerProcess([sys.executable, "-c", script])
    servers.append(server)
    server.wait_for_line("ready")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    server.signal(signal.SIGTERM)
    server.wait_for_line("hook hanging")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(timeout_s=10) == 1
    assert server.has_line("third shutdown request, exiting immediately")
