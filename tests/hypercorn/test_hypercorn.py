"""graceful.hypercorn on asyncio, uvloop and trio: real servers, real clients, real signals —
what only hypercorn has: HTTP/2 (GOAWAY, streams in flight, websockets over HTTP/2), serving
in a running loop, gunicorn's hypercorn workers, a rolling restart over both protocols.

The behaviour every server shares (HTTP/1.1 requests in flight, keep-alive, websockets,
health, preStop, escalation) is in ``test_server_matrix.py``, with a row per worker.  Every
test starts hypercorn through ``hypercorn_apps/launch.py`` (``graceful.hypercorn.run``
on ``examples.asgi_app:app``) as a subprocess on a free loopback port and waits on log
lines — the coordinator logs every phase change — or on what the client receives, never
on the clock.  HTTP/2 is h2c with prior knowledge: httpx (``http1=False, http2=True``)
where a real client's behaviour matters, and a frame-level client
(``hypercorn_apps/h2frames.py``) where the frames themselves — GOAWAY and its
last-stream-id, END_STREAM, RST_STREAM — are the point.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("hypercorn")  # and with it h2, hpack, hyperframe

from tests.support.hypercorn_apps.h2frames import RawH2
from tests.support.hypercorn_apps.rollout import backend_command, rolling_restart
from tests.support.servers import (
    ACCEPTING,
    DRAINING,
    HYPERCORN_RUNNING,
    POLICIES,
    STOPPED,
    RawHTTP,
    ServerProcess,
    hypercorn_launch,
    metric,
    sigkill_expected_in,
)

WORKERS = ["asyncio", "uvloop", "trio"]


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    RawHTTP.close_all()
    RawH2.close_all()
    for server in started:
        server.stop()


def start(servers: list[ServerProcess], *options: str, worker: str = "asyncio") -> ServerProcess:
    server = hypercorn_launch(*options, worker=worker)
    servers.append(server)
    return server


def in_thread(function: Any, *args: Any) -> dict[str, Any]:
    """Run ``function(*args)`` in a thread; the dict gets ``result`` or ``error``, and
    ``join`` (the thread's join)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = function(*args)
        except Exception as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    box["join"] = thread.join
    return box


def httpx_h2_get(port: int, path: str) -> httpx.Response:
    with httpx.Client(http1=False, http2=True, timeout=15) as client:
        return client.get(f"http://127.0.0.1:{port}{path}")


def assert_goaways(h2: RawH2, *, last_stream_id: int) -> None:
    """The first GOAWAY is graceful (NO_ERROR) and names ``last_stream_id``; no stream
    was reset.  A frame the client sent before it read the GOAWAY (a WINDOW_UPDATE) may
    draw a second one from h2, with PROTOCOL_ERROR (see graceful.hypercorn's docs): its
    last-stream-id must not grow."""
    assert h2.goaways, h2
    assert h2.goaways[0].error_code == 0, h2
    assert {g.last_stream_id for g in h2.goaways} == {last_stream_id}, h2
    assert {g.error_code for g in h2.goaways} <= {0, 1}, h2
    assert not [e for e in h2.events if e.startswith("rst")], h2


def httpx_client_ports(server: ServerProcess, count: int) -> list[int]:
    """The client ports of the first ``count`` HTTP/2 requests httpx made, from the
    access log (a connection hypercorn closed has no port left to ask for)."""
    pattern = r'127\.0\.0\.1:(\d+) .*"GET / 2" 200 .*python-httpx'
    server.wait_for_line(pattern, count=count)
    return [int(m.group(1)) for m in re.finditer(pattern, server.output())][:count]


# ----------------------------------------------------------- requests in flight


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_in_flight_http2_streams_finish_then_goaway_names_the_last(
    servers: list[ServerProcess], policy: str, worker: str
) -> None:
    """HTTP/2 streams in flight at SIGTERM finish and are not reset, on a raw frame
    client and on httpx; the GOAWAY names the highest stream accepted and comes once
    the connection has no response in flight, then the connection is closed."""
    server = start(servers, *POLICIES[policy], worker=worker)
    h2 = RawH2(server.port)
    assert h2.response(h2.request("/")) == (200, b"hello\n")
    slow = h2.request("/slow?s=2")  # stream 3
    client = in_thread(httpx_h2_get, server.port, "/slow?s=2")
    server.wait_for_line(r"slow request started", count=2)
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING)

    assert h2.response(slow) == (200, b"slept 2\n")
    h2.wait("eof")
    assert h2.events[:3] == ["end 1", "end 3", "goaway 3"], h2
    assert h2.events[-1] == "eof"
    assert_goaways(h2, last_stream_id=3)

    client["join"](15)
    assert "error" not in client, (client.get("error"), server.output())
    assert (client["result"].status_code, client["result"].text) == (200, "slept 2\n")

    assert server.wait_exit() == 0
    assert server.has_line(STOPPED)
    assert not server.has_line(r"Traceback|ERROR")


# -------------------------------------------------------------------- accepting


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize(
    ("policy", "nudges"), [("accept-until-idle", True), ("serve-until-killed", False)]
)
def test_accepting_serves_new_connections_and_moves_http2_clients(
    servers: list[ServerProcess], policy: str, nudges: bool, worker: str
) -> None:
    """While accepting, an idle HTTP/2 connection gets a GOAWAY at once if the policy
    nudges (httpx moves to a new connection, still served here), or stays usable if it
    does not; once draining, every idle HTTP/2 connection gets GOAWAY and is closed."""
    options = {
        "accept-until-idle": ["--policy", "accept-until-idle", "--idle", "2"],
        "serve-until-killed": ["--policy", "serve-until-killed", "--max-wait", "2"],
    }[policy]
    server = start(servers, *options, worker=worker)
    idle = RawH2(server.port)
    assert idle.response(idle.request("/"))[0] == 200
    with httpx.Client(http1=False, http2=True, timeout=15) as client:
        first = client.get(f"http://127.0.0.1:{server.port}/")
        assert (first.http_version, first.status_code) == ("HTTP/2", 200)
        server.signal(signal.SIGTERM)
        server.wait_for_line(ACCEPTING)
        if nudges:
            # The idle HTTP/2 connection is told to go away at once, naming the last
            # stream it had; httpx's next request goes over a new connection, served by
            # this backend while it still accepts.
            idle.wait("goaway")
            assert not server.has_line(DRAINING)
            assert (idle.goaways[0].last_stream_id, idle.goaways[0].error_code) == (1, 0)
            second = client.get(f"http://127.0.0.1:{server.port}/")
            assert (second.http_version, second.status_code) == ("HTTP/2", 200)
        else:
            # Not nudged: the connection stays usable until draining.
            second = client.get(f"http://127.0.0.1:{server.port}/")
            assert second.status_code == 200
            assert not idle.goaways
        assert not server.has_line(DRAINING)
        ports = httpx_client_ports(server, count=2)
        assert (ports[0] != ports[1]) is nudges  # a new connection, or the same one
        server.wait_for_line(DRAINING)
        idle.wait("eof")  # idle HTTP/2 connections: GOAWAY, then closed
        assert idle.events[:2] == ["end 1", "goaway 1"], idle
        assert_goaways(idle, last_stream_id=1)
    assert server.wait_exit() == 0


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_busy_http2_connection_opening_streams_while_draining_gets_goaway_at_once(
    servers: list[ServerProcess], worker: str
) -> None:
    """A multiplexing client that is never idle must still be told: the stream it
    opens while draining is served, GOAWAY names it, the streams in flight finish."""
    server = start(servers, "--policy", "refuse-immediately", worker=worker)
    h2 = RawH2(server.port)
    slow = h2.request("/slow?s=1.5")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING)
    late = h2.request("/")  # stream 3, on the busy connection, while draining
    h2.wait("goaway")
    assert [g.last_stream_id for g in h2.goaways] == [late]
    assert h2.response(late) == (200, b"hello\n")
    assert h2.response(slow) == (200, b"slept 1.5\n")
    assert h2.events.index(f"goaway {late}") < h2.events.index(f"end {slow}"), h2
    h2.wait("eof")
    assert_goaways(h2, last_stream_id=late)
    assert server.wait_exit() == 0


# ------------------------------------------------------------------- websockets


def ws_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame (payloads under 126 bytes)."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_websocket_over_http2_gets_going_away(servers: list[ServerProcess], worker: str) -> None:
    """A websocket over HTTP/2 (RFC 8441's extended CONNECT) gets a close frame with
    1001 at draining on its stream; the stream is not reset."""
    server = start(
        servers, "--policy", "refuse-immediately", "--websocket-close-grace", "0.2", worker=worker
    )
    h2 = RawH2(server.port)
    ws = h2.websocket("/ws")
    h2.wait("headers", ws)
    assert h2.streams[ws].status == 200  # accepted
    h2.send_data(ws, ws_frame(0x1, b"ping"))
    assert h2.wait_body(ws, 6) == b"\x81\x04ping"  # the echo, unmasked
    server.signal(signal.SIGTERM)
    body = h2.wait_body(ws, 6 + 4)
    close = body[6:]
    assert close[0] == 0x88, body  # a close frame ...
    assert int.from_bytes(close[2:4], "big") == 1001, body  # ... going away
    h2.send_data(ws, ws_frame(0x8, close[2:4]))  # the client answers the close
    server.wait_for_line(r"websocket disconnected with code")
    assert server.wait_exit() == 0
    assert not [e for e in h2.events if e.startswith("rst")], h2


# ------------------------------------------------------------------- in process


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_serve_in_a_running_loop_with_a_shutdown_trigger(backend: str) -> None:
    """In-process, hypercorn's convention: the trigger starts the shutdown and no signal
    handler is installed; ``serve`` returns once the coordinator stopped."""
    import anyio
    from hypercorn.config import Config, Sockets

    import graceful
    import graceful.hypercorn

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"in process"})
        elif scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections wait in the backlog until serve() accepts them
    port = sock.getsockname()[1]
    coordinator = graceful.ShutdownCoordinator(
        policy=graceful.RefuseImmediately(), grace_period_s=5
    )

    async def main() -> None:
        handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: graceful.hypercorn.serve(
                    app, Config(), coordinator=coordinator, shutdown_trigger=stop.wait,
                    sockets=Sockets([], [sock], []),
                )
            )  # fmt: skip
            async with httpx.AsyncClient() as client:
                response = await client.get(f"http://127.0.0.1:{port}/")
            assert (response.status_code, response.text) == (200, "in process")
            assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
            stop.set()
        assert coordinator.phase is graceful.Phase.STOPPED

    anyio.run(main, backend=backend)
    assert sock.fileno() == -1  # closed when draining began


# ------------------------------------------------------------- rolling restart


@pytest.mark.parametrize(
    ("backend", "worker", "fails"),
    [
        ("stock", "asyncio", True),
        ("accept-until-idle", "asyncio", False),
        ("accept-until-idle", "uvloop", False),
        ("accept-until-idle", "trio", False),
    ],
)
def test_rolling_restart(backend: str, worker: str, fails: bool) -> None:
    """Backend A gets SIGTERM while the L4 balancer keeps routing new connections to it
    for 1 s; keep-alive, fresh-connection and long-request clients run throughout over
    HTTP/1.1 and HTTP/2.  Counts, not timings, are asserted."""
    outcome = asyncio.run(rolling_restart(backend_command(backend, worker, grace_period_s=6)))
    print(f"\n{backend} {worker}: failed {dict(outcome.failed)} of {dict(outcome.requests)}")
    assert outcome.requests["HTTP/1.1"] >= 10  # load ran throughout (fewer on a busy machine)
    assert outcome.requests["HTTP/2"] >= 10
    assert outcome.exit_code == 0
    if fails:  # stock hypercorn closes its listener at SIGTERM: the balancer's new
        # connections are refused, over either protocol
        assert outcome.failed["HTTP/1.1"] > 0, outcome
        assert outcome.failed["HTTP/2"] > 0, outcome
    else:
        assert sum(outcome.failed.values()) == 0, outcome.errors


# --------------------------------------------------------------------- gunicorn


def gunicorn(worker_class: str, env: dict[str, str]) -> ServerProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    return ServerProcess(
        [sys.executable, "-m", "gunicorn", "examples.asgi_app:app",
         "-k", f"graceful.gunicorn.{worker_class}", "-w", "2",
         "-b", "127.0.0.1:0", "--graceful-timeout", "10", "--timeout", "3"],
        env={**environment, **env},
    )  # fmt: skip


@pytest.mark.parametrize("worker_class", ["HypercornWorker", "HypercornTrioWorker"])
def test_gunicorn_sigterm_drains_requests_in_flight(
    servers: list[ServerProcess], worker_class: str
) -> None:
    """SIGTERM to gunicorn's master: both hypercorn workers accept, drain their requests
    in flight and stop, with heartbeats going on (no WORKER TIMEOUT)."""
    pytest.importorskip("gunicorn")
    server = gunicorn(worker_class, {"GRACEFUL_POLICY": "accept-until-idle", "GRACEFUL_IDLE": "1"})
    servers.append(server)
    server.port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(HYPERCORN_RUNNING, count=2)
    clients = []
    for _ in range(4):  # spread over both workers
        client = RawHTTP(server.port)
        client.send("/slow?s=1.5")
        clients.append(client)
    server.wait_for_line(r"slow request started", count=4)
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting: SIGTERM .*SIGKILL expected in", count=2)
    # The master's --graceful-timeout, less what the worker took to log it (under load).
    expected = sigkill_expected_in(server.output())
    assert len(expected) == 2, server.output()
    assert all(9.0 <= n <= 10.0 for n in expected), expected
    assert RawHTTP(server.port).get("/")[0] == 200  # still accepting
    assert [client.response()[0] for client in clients] == [200] * 4
    assert server.wait_exit(timeout_s=15) == 0
    output = server.output()
    assert output.count("stopping -> stopped") == 2, output
    assert "WORKER TIMEOUT" not in output  # heartbeats continued while draining


def test_gunicorn_bad_graceful_option_stops_the_master_with_one_line(
    servers: list[ServerProcess],
) -> None:
    """A bad ``GRACEFUL_*`` value stops gunicorn's master before any worker boots, with
    one ``Error: graceful: …`` line naming the variable and the value."""
    pytest.importorskip("gunicorn")
    server = gunicorn("HypercornTrioWorker", {"GRACEFUL_POLICY": "drain-slowly"})
    servers.append(server)
    assert server.wait_exit(timeout_s=20) == 1
    output = server.output()
    errors = [line for line in output.splitlines() if line.startswith("Error: graceful: ")]
    assert len(errors) == 1, output
    assert "GRACEFUL_POLICY" in errors[0]
    assert "drain-slowly" in errors[0]
    assert "Booting worker" not in output  # checked in the master, before any worker
    assert "Traceback" not in output


def test_gunicorn_sigquit_is_quick_shutdown(servers: list[ServerProcess]) -> None:
    """SIGQUIT to gunicorn's master reaches both workers as a stop: the request in
    flight is cut with a 503 and the process exits 0 at once."""
    pytest.importorskip("gunicorn")
    server = gunicorn("HypercornWorker", {"GRACEFUL_POLICY": "serve-until-killed"})
    servers.append(server)
    server.port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(HYPERCORN_RUNNING, count=2)
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGQUIT)  # the master sends SIGQUIT to the workers
    assert client.response()[0] == 503
    assert server.wait_exit(timeout_s=10) == 0
    assert server.output().count("-> stopping: SIGQUIT") == 2


# Not trio: hypercorn 0.18's own trio worker fails at start-up with a WSGI app (its
# lifespan channel is closed: `hypercorn --worker-class trio flask_app:app`).
@pytest.mark.parametrize("worker", ["asyncio", "uvloop"])
def test_a_wsgi_app_is_tracked_and_drained(servers: list[ServerProcess], worker: str) -> None:
    """A WSGI app (Flask) under graceful.hypercorn goes through hypercorn's WSGI wrapper
    behind the middleware: its request in flight at SIGTERM is counted, holds the drain
    and completes."""
    pytest.importorskip("flask")
    server = start(
        servers, *POLICIES["refuse-immediately"],
        "--app", "tests.support.wsgi_apps.flask_app:app", worker=worker,
    )  # fmt: skip
    assert RawHTTP(server.port).get("/readyz")[0] == 200
    client = RawHTTP(server.port)
    client.send("/slow?s=1")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING)
    assert server.has_line(r"1 request")  # the phase lines count it
    assert client.response()[::2] == (200, b"slow done after 1 s\n")
    assert server.wait_exit() == 0
    assert not server.has_line(r"Traceback|ERROR")


# --------------------------------------------------------------------- hot path


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_hot_path_request_in_flight_is_counted_then_adopted(loop: str) -> None:
    """graceful's hypercorn server hands HTTP requests to the app past the middleware
    while nothing shuts down (``graceful.hypercorn._hot``): a request running there is
    in flight for the metrics (found in hypercorn's streams), is adopted at SIGTERM —
    the drain waits for it, and its client gets its answer with ``Connection: close``
    from hypercorn — the app still finds its drain signal, health and metrics routes
    are not counted, and a request started after SIGTERM takes the middleware: the
    total counts each request once."""
    pytest.importorskip("prometheus_client")
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    command = [
        sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0",
        "--server", "hypercorn", "--loop", loop, "--metrics-path", "/metrics",
        "--policy", "accept-until-idle", "--idle", "5", "--grace-period", "30",
    ]  # fmt: skip
    server = ServerProcess(command)
    try:
        server.port = int(server.wait_for_line(HYPERCORN_RUNNING)[1])

        client = RawHTTP(server.port)
        assert client.get("/signal")[::2] == (200, b"draining=False\n")
        assert client.get("/readyz")[0] == 200
        assert (
            metric(server.port, "graceful_requests_total") == 1
        )  # not the health routes, not /metrics
        slow = RawHTTP(server.port)
        slow.send("/slow?s=4")  # still running once SIGTERM is handled, even under load
        server.wait_for_line(r"slow request started")
        assert metric(server.port, "graceful_requests_in_flight") == 1
        server.signal(signal.SIGTERM)
        server.wait_for_line(ACCEPTING)
        assert metric(server.port, "graceful_requests_in_flight") == 1  # adopted
        other = RawHTTP(server.port)
        assert other.get("/")[::2] == (200, b"hello\n")  # the middleware's path
        status, headers, _ = slow.response()
        assert status == 200
        assert headers["connection"] == "close"  # nudged: its response had not started
        # Finished once hypercorn closed the stream, which may follow the last byte.
        deadline = time.monotonic() + 5
        while metric(server.port, "graceful_requests_in_flight") != 0:
            assert time.monotonic() < deadline, "the adopted request is still in flight"
        assert metric(server.port, "graceful_requests_total") == 3
        assert server.wait_exit() == 0
    finally:
        RawHTTP.close_all()
        server.stop()


@pytest.mark.parametrize("worker", [*WORKERS, "asyncio-wrapped"])
def test_work_after_the_response_is_waited_for(servers: list[ServerProcess], worker: str) -> None:
    """A request whose app works on after its response (a background task), running on
    the hot path at SIGTERM, is in flight until the app returns — as the middleware
    counts — so the drain waits for its work instead of cutting it; also when a task
    factory runs every task's coroutine inside a wrapper (``asyncio-wrapped``, as
    tracing integrations do)."""
    if worker == "uvloop":
        pytest.importorskip("uvloop")
    env = None
    if worker == "asyncio-wrapped":
        worker, env = "asyncio", {"TEST_WRAPPING_TASK_FACTORY": "1"}
    server = hypercorn_launch(
        "--app", "tests.support.hypercorn_apps.asgi_app:app",
        "--policy", "refuse-immediately", worker=worker, env=env,
    )  # fmt: skip
    servers.append(server)
    client = RawHTTP(server.port)
    assert client.get("/after?s=4")[::2] == (200, b"sent\n")  # works on past SIGTERM
    server.wait_for_line(r"work after the response started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting: SIGTERM \(\d+ connections?, 1 request")
    done = server.wait_for_line(r"work after the response done")
    drained = server.wait_for_line(r"draining -> stopping: drained")
    lines = server.output().splitlines()
    assert lines.index(done.string) < lines.index(drained.string), server.output()
    assert server.wait_exit() == 0
