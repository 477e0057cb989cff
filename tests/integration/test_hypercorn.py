"""graceful.hypercorn on asyncio, uvloop and trio: real servers, real clients, real signals.

Every test starts hypercorn through ``hypercorn_apps/launch.py`` (``graceful.hypercorn.run``
on ``examples.asgi_app:app``) as a subprocess on a free loopback port and waits on log
lines — the coordinator logs every phase change — or on what the client receives, never
on the clock.  HTTP/2 is h2c with prior knowledge: httpx (``http1=False, http2=True``)
where a real client's behaviour matters, and a frame-level client
(``hypercorn_apps/h2frames.py``) where the frames themselves — GOAWAY and its
last-stream-id, END_STREAM, RST_STREAM — are the point.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

pytest.importorskip("hypercorn")  # and with it h2, hpack, hyperframe

from .hypercorn_apps.h2frames import RawH2
from .hypercorn_apps.rollout import backend_command, rolling_restart
from .servers import (
    ACCEPTING,
    DRAINING,
    POLICIES,
    STOPPED,
    RawHTTP,
    ServerProcess,
    connection_refused,
)

LAUNCH = str(Path(__file__).with_name("hypercorn_apps") / "launch.py")
WORKERS = ["asyncio", "uvloop", "trio"]
RUNNING = r"Running on http://127\.0\.0\.1:(\d+)"


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    RawHTTP.close_all()
    RawH2.close_all()
    for server in started:
        server.stop()


def start(
    servers: list[ServerProcess],
    *options: str,
    worker: str = "asyncio",
    env: dict[str, str] | None = None,
) -> ServerProcess:
    server = ServerProcess(
        [sys.executable, LAUNCH, "--worker", worker, "--access-log", *options], env=env
    )
    servers.append(server)
    server.port = int(server.wait_for_line(RUNNING).group(1))
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
def test_in_flight_requests_finish_over_http1_and_http2(
    servers: list[ServerProcess], policy: str, worker: str
) -> None:
    server = start(servers, *POLICIES[policy], worker=worker)
    h1 = RawHTTP(server.port)
    h1.send("/slow?s=2")
    h2 = RawH2(server.port)
    assert h2.response(h2.request("/")) == (200, b"hello\n")
    slow = h2.request("/slow?s=2")  # stream 3
    client = in_thread(httpx_h2_get, server.port, "/slow?s=2")
    server.wait_for_line(r"slow request started", count=3)
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING)
    assert connection_refused(server.port)  # the listener closed once draining began

    status, headers, body = h1.response()
    assert (status, body) == (200, b"slept 2\n")
    assert headers["connection"] == "close"  # draining: always nudged
    assert h1.closed_by_peer()

    assert h2.response(slow) == (200, b"slept 2\n")
    h2.wait("eof")
    # In-flight streams finish and are not reset; GOAWAY names the highest stream
    # accepted and comes once the connection has no response in flight, then the close.
    assert h2.events[:3] == ["end 1", "end 3", "goaway 3"], h2
    assert h2.events[-1] == "eof"
    assert_goaways(h2, last_stream_id=3)

    client["join"](15)
    assert "error" not in client, (client.get("error"), server.output())
    assert (client["result"].status_code, client["result"].text) == (200, "slept 2\n")

    assert server.wait_exit() == 0
    assert server.has_line(ACCEPTING)
    assert server.has_line(STOPPED)
    assert server.has_line("lifespan shutdown")
    assert not server.has_line(r"Traceback|ERROR")


# -------------------------------------------------------------------- accepting


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize(
    ("policy", "nudges"), [("accept-until-idle", True), ("serve-until-killed", False)]
)
def test_accepting_serves_new_connections_and_moves_http2_clients(
    servers: list[ServerProcess], policy: str, nudges: bool, worker: str
) -> None:
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

        # A new HTTP/1.1 connection is served while accepting.
        assert RawHTTP(server.port).get("/")[:1] == (200,)
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
    lines = server.output().splitlines()
    served = [i for i, line in enumerate(lines) if '"GET / 1.1" 200' in line]
    drained = next(i for i, line in enumerate(lines) if "accepting -> draining" in line)
    assert served
    assert served[-1] < drained


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


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_idle_keep_alive_may_send_one_more_request_at_draining(
    servers: list[ServerProcess], worker: str
) -> None:
    server = start(servers, "--policy", "refuse-immediately", worker=worker)
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


# ------------------------------------------------------------------- websockets


@pytest.mark.parametrize("worker", WORKERS)
def test_websocket_gets_going_away(servers: list[ServerProcess], worker: str) -> None:
    server = start(
        servers, "--policy", "refuse-immediately", "--websocket-close-grace", "0.2", worker=worker
    )
    with ws_connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=10) as ws:
        ws.send("ping")
        assert ws.recv(timeout=10) == "ping"
        server.signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1001
    # hypercorn reports a close the server started as 1000 to the app (uvicorn: the
    # code the client echoed); the app is told either way.
    server.wait_for_line(r"websocket disconnected with code")
    assert server.wait_exit() == 0


def ws_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame (payloads under 126 bytes)."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_websocket_over_http2_gets_going_away(servers: list[ServerProcess], worker: str) -> None:
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


def silent_websocket(port: int) -> socket.socket:
    """A websocket client that completes the handshake and then never reads, writes or
    answers a close frame: the session and its connection never end by themselves."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            "GET /ws HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


@pytest.mark.parametrize("worker", WORKERS)
def test_never_ending_websocket_does_not_hold_the_process(
    servers: list[ServerProcess], worker: str
) -> None:
    """pgjones/hypercorn#308: on Python >= 3.12.1 stock hypercorn waits in
    ``Server.wait_closed()`` for every connection, so this one would hold it until
    SIGKILL.  Here the drain deadline cuts it and lifespan shutdown still runs."""
    server = start(
        servers,
        "--policy", "refuse-immediately", "--drain-timeout", "1.5", "--grace-period", "8",
        "--websocket-close-grace", "0.2",
        worker=worker,
    )  # fmt: skip
    sock = silent_websocket(server.port)
    try:
        server.wait_for_line(r"websocket accepted")
        began = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.wait_exit(timeout_s=15) == 0
        exit_s = time.monotonic() - began
    finally:
        sock.close()
    print(f"\nexit {exit_s:.2f} s after SIGTERM ({worker}, Python {sys.version.split()[0]})")
    assert exit_s < 1.5 + 3  # the drain deadline, the cut, slack for a loaded machine
    assert server.has_line(
        r"drain deadline reached with \d+ connections?, \d+ requests?, 1 session"
    )
    assert server.has_line("lifespan shutdown")
    assert server.has_line(STOPPED)


# ---------------------------------------------------------------------- signals


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM, signal.SIGINT), (signal.SIGQUIT,)], ids=["twice", "sigquit"]
)
def test_second_signal_escalates_and_sigquit_stops_at_once(
    servers: list[ServerProcess], signals: tuple[signal.Signals, ...], worker: str
) -> None:
    server = start(servers, *POLICIES["serve-until-killed"], "--drain-timeout", "60", worker=worker)
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(r"slow request started")
    began = time.monotonic()
    for sig in signals:
        server.signal(sig)
        if sig is signal.SIGTERM:
            server.wait_for_line(ACCEPTING)
    status, headers, _ = client.response()
    assert status == 503  # cut before its response started: a clean answer
    assert headers["connection"] == "close"
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - began < 5
    last = signals[-1].name
    assert server.has_line(rf"-> stopping: {last}( \(escalated\))?")
    assert server.has_line("lifespan shutdown")


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
    pytest.importorskip("gunicorn")
    server = gunicorn(worker_class, {"GRACEFUL_POLICY": "accept-until-idle", "GRACEFUL_IDLE": "1"})
    servers.append(server)
    server.port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(RUNNING, count=2)
    clients = []
    for _ in range(4):  # spread over both workers
        client = RawHTTP(server.port)
        client.send("/slow?s=1.5")
        clients.append(client)
    server.wait_for_line(r"slow request started", count=4)
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting: SIGTERM .*SIGKILL expected in 10\.0 s", count=2)
    assert RawHTTP(server.port).get("/")[0] == 200  # still accepting
    assert [client.response()[0] for client in clients] == [200] * 4
    assert server.wait_exit(timeout_s=15) == 0
    output = server.output()
    assert output.count("stopping -> stopped") == 2, output
    assert "WORKER TIMEOUT" not in output  # heartbeats continued while draining


def test_gunicorn_bad_graceful_option_stops_the_master_with_one_line(
    servers: list[ServerProcess],
) -> None:
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
    pytest.importorskip("gunicorn")
    server = gunicorn("HypercornWorker", {"GRACEFUL_POLICY": "serve-until-killed"})
    servers.append(server)
    server.port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(RUNNING, count=2)
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGQUIT)  # the master sends SIGQUIT to the workers
    assert client.response()[0] == 503
    assert server.wait_exit(timeout_s=10) == 0
    assert server.output().count("-> stopping: SIGQUIT") == 2
