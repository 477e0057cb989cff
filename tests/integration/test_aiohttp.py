"""graceful.aiohttp against real clients and real signals, served three ways.

* ``run_app``: :func:`graceful.aiohttp.run_app`;
* ``runner``: the pieces — a user's own :class:`graceful.aiohttp.AppRunner`,
  ``web.TCPSite`` and ``coordinator.run()``;
* ``gunicorn``: ``gunicorn -k graceful.gunicorn.AiohttpWorker`` (one worker; the
  master gets the signals, as in a container).

Every server is a subprocess of ``tests/integration/aiohttp_apps/app.py`` on a free
loopback port; tests wait on its log lines (the coordinator logs each phase change) or
on socket states, with bounded timeouts — never on the clock.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from graceful._coordinator import DUPLICATE_WINDOW_S

from .servers import (
    ACCEPTING,
    DRAINING,
    STOPPED,
    RawHTTP,
    ServerProcess,
    connection_refused,
    sigstop,
)

pytest.importorskip("aiohttp")

APP = "tests.integration.aiohttp_apps.app"
MODES = ["run_app", "runner", "gunicorn"]
#: Options per policy, short enough for tests.
POLICIES: dict[str, dict[str, str]] = {
    "accept-until-idle": {"policy": "accept-until-idle", "idle": "1"},
    "serve-until-killed": {"policy": "serve-until-killed", "max_wait": "1.5"},
    "refuse-immediately": {"policy": "refuse-immediately"},
}
#: Options graceful reads from GRACEFUL_* under gunicorn.
ENV_OPTIONS = ("policy", "idle", "max_wait", "drain_timeout", "websocket_close_grace",
               "prestop_path")  # fmt: skip


class AiohttpServer(ServerProcess):
    """A test server; ``worker_pid`` is the process that serves (gunicorn: the worker)."""

    worker_pid = 0

    def signal_worker(self, sig: int) -> None:
        """``sig`` to the worker.  A repeat of what the master relayed is sent a whole
        duplicate window after now (the worker got the relay at some moment before the
        caller saw its effect), so that it is a deliberate second signal (see
        :meth:`ServerProcess.signal`)."""
        if sig in self._sent:
            due = time.monotonic() + DUPLICATE_WINDOW_S + 0.05
            while time.monotonic() < due:
                time.sleep(due - time.monotonic())
        if sig == signal.SIGSTOP:
            sigstop(self.worker_pid)
        else:
            os.kill(self.worker_pid, sig)


def app_command(mode: str, options: dict[str, str]) -> list[str]:
    """The test app's command line; an option whose value is ``""`` is a flag."""
    args = [sys.executable, "-m", APP, mode, "--port", "0"]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", value] if value else [f"--{key}"]
    return args


def start_server(mode: str, options: dict[str, str]) -> AiohttpServer:
    options = dict(options)
    if mode == "gunicorn":
        grace = options.pop("grace_period", "10")
        backlog = options.pop("backlog", "2048")
        env = {f"GRACEFUL_{k.upper()}": options.pop(k) for k in ENV_OPTIONS if k in options}
        assert not options, options
        server = AiohttpServer(
            [
                sys.executable, "-m", "gunicorn", f"{APP}:app",
                "-k", "graceful.gunicorn.AiohttpWorker", "-w", "1",
                "-b", "127.0.0.1:0", "--graceful-timeout", grace, "--timeout", "3",
                "--backlog", backlog,
            ],
            env=env,
        )  # fmt: skip
        server.port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)")[1])
        server.worker_pid = int(server.wait_for_line(r"Booting worker with pid: (\d+)")[1])
        server.wait_for_line(r"aiohttp worker serving on")
        return server
    server = AiohttpServer(app_command(mode, options))
    server.port = int(server.wait_for_line(r"Running on http://127\.0\.0\.1:(\d+)")[1])
    server.worker_pid = server.proc.pid
    return server


#: Output that means something went wrong even if the test's assertions held.
TROUBLE = re.compile(r"Traceback|Task was destroyed|never awaited|Unhandled exception|ERROR")


@pytest.fixture
def servers() -> Iterator[list[AiohttpServer]]:
    started: list[AiohttpServer] = []
    yield started
    RawHTTP.close_all()
    for server in started:
        server.stop()
    for server in started:
        assert not TROUBLE.search(server.output()), server.output()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    if request.param == "gunicorn":
        pytest.importorskip("gunicorn")
    return str(request.param)


def start(servers: list[AiohttpServer], mode: str, **options: str) -> AiohttpServer:
    server = start_server(mode, options)
    servers.append(server)
    return server


def escalate(server: AiohttpServer, mode: str, sig: int = signal.SIGTERM) -> None:
    """A second signal: gunicorn's master forwards only the first, so to the worker."""
    if mode == "gunicorn":
        server.signal_worker(sig)
    else:
        server.signal(sig)


def raw_websocket(port: int, path: str) -> socket.socket:
    """A websocket client that completes the handshake and then never reads again (so it
    never answers a close frame)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nhost: test\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
        f"sec-websocket-key: {key}\r\nsec-websocket-version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


# ------------------------------------------------------------- the behavioural matrix


def test_request_in_flight_at_sigterm_completes(servers: list[AiohttpServer], mode: str) -> None:
    server = start(servers, mode, **POLICIES["accept-until-idle"])
    client = RawHTTP(server.port)
    client.send("/slow?s=1")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    status, headers, body = client.response()
    assert (status, body) == (200, b"slept 1\n")
    assert headers["connection"] == "close"  # accept-until-idle nudges
    assert server.wait_exit() == 0
    lines = server.output().splitlines()
    order = [
        next(i for i, line in enumerate(lines) if pattern in line)
        for pattern in ("serving -> accepting", "accepting -> draining", "on_shutdown ran",
                        "on_cleanup ran", "stopping -> stopped")
    ]  # fmt: skip
    assert order == sorted(order), server.output()


def test_new_connections_served_while_accepting_then_refused(
    servers: list[AiohttpServer], mode: str
) -> None:
    server = start(servers, mode, **POLICIES["serve-until-killed"])
    holder = RawHTTP(server.port)
    holder.send("/slow?s=3")  # keeps the process alive while draining
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, _, body = RawHTTP(server.port).get("/")
    assert (status, body) == (200, b"hello\n")
    assert not server.has_line(DRAINING)
    server.wait_for_line(DRAINING)
    assert connection_refused(server.port)
    assert holder.response()[0] == 200
    assert server.wait_exit() == 0


def test_keep_alive_and_streamed_responses_are_nudged(
    servers: list[AiohttpServer], mode: str
) -> None:
    server = start(servers, mode, **POLICIES["accept-until-idle"])
    client = RawHTTP(server.port)
    status, headers, _ = client.get("/")
    assert status == 200
    assert headers.get("connection") != "close"
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, headers, _ = client.get("/")  # a plain response on the same connection
    assert status == 200
    assert headers["connection"] == "close"
    assert client.closed_by_peer()
    streamed = RawHTTP(server.port)
    status, headers, body = streamed.get("/stream?n=3")  # prepared by the handler
    assert status == 200
    assert b"chunk 2" in body
    assert headers["transfer-encoding"] == "chunked"
    assert headers["connection"] == "close"
    assert streamed.closed_by_peer()
    assert server.wait_exit() == 0


def test_idle_keep_alive_is_closed_at_draining_not_before(
    servers: list[AiohttpServer], mode: str
) -> None:
    server = start(servers, mode, **POLICIES["serve-until-killed"])
    client = RawHTTP(server.port)
    assert client.get("/")[0] == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, headers, _ = client.get("/")  # still open and usable while accepting
    assert status == 200
    assert headers.get("connection") != "close"  # serve-until-killed does not nudge
    server.wait_for_line(DRAINING)
    assert client.closed_by_peer(timeout_s=5)
    assert server.wait_exit() == 0


def test_websocket_gets_going_away(servers: list[AiohttpServer], mode: str) -> None:
    server = start(servers, mode, **POLICIES["refuse-immediately"], websocket_close_grace="0.2")
    with ws_connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=10) as ws:
        ws.send("ping")
        assert ws.recv(timeout=10) == "ping"
        server.signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1001
    assert server.wait_exit() == 0
    assert server.has_line("on_shutdown ran")
    assert not server.has_line(r"cutting|Traceback")  # it closed, nothing was cut


@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGQUIT,)], ids=["twice", "sigquit"]
)
def test_websocket_gets_going_away_on_escalation(
    servers: list[AiohttpServer], signals: tuple[signal.Signals, ...]
) -> None:
    # The session's drain is requested from a loop callback (the signal), not a task.
    server = start(servers, "run_app", **POLICIES["serve-until-killed"])
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


def test_deadline_cuts_with_503_and_still_runs_on_cleanup(
    servers: list[AiohttpServer], mode: str
) -> None:
    server = start(
        servers, mode, **POLICIES["refuse-immediately"], drain_timeout="1", grace_period="6"
    )
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(r"slow request started")
    began = time.monotonic()
    server.signal(signal.SIGTERM)
    status, headers, body = client.response()  # a clean answer, not a hang
    assert (status, body) == (503, b"server shutting down\n")
    assert headers["connection"] == "close"
    assert client.closed_by_peer()
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - began < 6  # before the kill deadline
    assert server.has_line(r"drain deadline reached with \d+ connections?, 1 request\b")
    assert server.has_line("on_cleanup ran")


def test_second_signal_escalates(servers: list[AiohttpServer], mode: str) -> None:
    server = start(servers, mode, **POLICIES["accept-until-idle"], drain_timeout="60")
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    began = time.monotonic()
    escalate(server, mode)
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - began < 5
    assert server.has_line(r"accepting -> stopping: SIGTERM \(escalated\)")
    assert client.response()[0] == 503
    assert server.has_line("on_shutdown ran")  # draining was skipped: run when stopping
    assert server.has_line("on_cleanup ran")


def test_backlog_burst_while_stopped_is_served(servers: list[AiohttpServer], mode: str) -> None:
    """SIGSTOP the serving process, let 100 clients complete their handshake and send a
    request into the kernel's accept queue, SIGTERM, SIGCONT: the listener closes at
    once (refuse-immediately), and every one of them is answered."""
    server = start(servers, mode, **POLICIES["refuse-immediately"], backlog="256")
    server.signal_worker(signal.SIGSTOP)
    socks = []
    try:
        for _ in range(100):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            socks.append(sock)
        server.signal(signal.SIGTERM)
        server.signal_worker(signal.SIGCONT)
        answered = 0
        for sock in socks:
            data = b""
            while b"hello\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
            answered += data.startswith(b"HTTP/1.1 200 OK") and b"hello\n" in data
    finally:
        for sock in socks:
            sock.close()
        server.signal_worker(signal.SIGCONT)
    assert answered == 100
    assert server.wait_exit() == 0
    assert server.has_line(STOPPED)


def test_gunicorn_max_requests_recycling_drains_at_once(servers: list[AiohttpServer]) -> None:
    pytest.importorskip("gunicorn")
    server = AiohttpServer(
        [
            sys.executable, "-m", "gunicorn", f"{APP}:app",
            "-k", "graceful.gunicorn.AiohttpWorker", "-w", "1", "-b", "127.0.0.1:0",
            "--max-requests", "3", "--graceful-timeout", "10", "--timeout", "3",
        ],
        env={"GRACEFUL_POLICY": "accept-until-idle", "GRACEFUL_IDLE": "5"},
    )  # fmt: skip
    servers.append(server)
    port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)")[1])
    server.wait_for_line(r"aiohttp worker serving on")
    slow = RawHTTP(port)
    slow.send("/slow?s=2")  # in flight when the worker decides to recycle
    server.wait_for_line(r"slow request started")
    assert [RawHTTP(port).get("/")[0] for _ in range(3)] == [200, 200, 200]
    # The worker drained at once (not after the 5 s idle window) and a new one booted.
    server.wait_for_line(r"serving -> accepting: max requests")
    server.wait_for_line(r"accepting -> draining: max requests \(no accepting period\)")
    assert slow.response()[0] == 200
    server.wait_for_line(r"aiohttp worker serving on", count=2)
    assert RawHTTP(port).get("/")[0] == 200
    assert "WORKER TIMEOUT" not in server.output()


# -------------------------------------------------------------------- run_app only


def test_readiness_flips_to_503_at_sigterm_liveness_stays(servers: list[AiohttpServer]) -> None:
    server = start(servers, "run_app", **POLICIES["serve-until-killed"])
    assert RawHTTP(server.port).get("/readyz")[:1] == (200,)
    assert RawHTTP(server.port).get("/livez")[:1] == (200,)
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, _, body = RawHTTP(server.port).get("/readyz")
    assert status == 503
    assert body.startswith(b"shutting down")
    assert RawHTTP(server.port).get("/livez")[:1] == (200,)
    assert server.wait_exit() == 0


def test_prestop_endpoint_blocks_until_drained(servers: list[AiohttpServer]) -> None:
    server = start(servers, "run_app", **POLICIES["refuse-immediately"], prestop_path="/prestop")
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
    server.signal(signal.SIGTERM)  # the kubelet's SIGTERM after preStop returned
    assert server.wait_exit() == 0


def test_sigterm_during_the_teardown_after_prestop_is_not_fatal(
    servers: list[AiohttpServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet's SIGTERM right after a preStop drain lands after the coordinator ran,
    while run_app tears down (made certain here by a task that takes a second to end
    when cancelled): the process still exits 0, not 143 (seen in CI under load)."""
    monkeypatch.setenv("TEST_LINGER", "1")
    server = start(servers, "run_app", **POLICIES["refuse-immediately"], prestop_path="/prestop")
    prestop = RawHTTP(server.port)
    prestop.send("/prestop")
    assert prestop.response()[0] == 200
    server.wait_for_line(r"lingering task cancelled")
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    server.wait_for_line(r"SIGTERM during the teardown: already shut down")


def test_idle_keep_alive_may_send_one_more_request_at_draining(
    servers: list[AiohttpServer],
) -> None:
    server = start(servers, "run_app", **POLICIES["refuse-immediately"])
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


def test_streaming_handler_ends_cleanly_through_the_drain_signal(
    servers: list[AiohttpServer],
) -> None:
    server = start(servers, "run_app", **POLICIES["refuse-immediately"])
    client = RawHTTP(server.port)
    client.send("/events")
    server.wait_for_line("events started")
    server.signal(signal.SIGTERM)
    status, headers, body = client.response()  # the whole chunked stream
    assert status == 200
    assert body.rstrip().endswith(b"data: server draining")
    # Its headers went out before SIGTERM, without a nudge: the connection is closed once
    # it is idle again.
    assert "connection" not in headers
    assert client.closed_by_peer()
    assert server.wait_exit() == 0


def test_sigquit_stops_at_once(servers: list[AiohttpServer]) -> None:
    server = start(servers, "run_app", **POLICIES["serve-until-killed"])
    server.signal(signal.SIGQUIT)
    assert server.wait_exit(timeout_s=10) == 0
    assert server.has_line(r"serving -> stopping: SIGQUIT")
    assert server.has_line("on_cleanup ran")


def test_backlog_burst_while_stopped_is_served_on_uvloop(servers: list[AiohttpServer]) -> None:
    pytest.importorskip("uvloop")
    server = start(servers, "run_app", **POLICIES["refuse-immediately"], uvloop="")
    server.signal(signal.SIGSTOP)
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(50)]
    try:
        for sock in socks:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        server.signal(signal.SIGTERM)
        server.signal(signal.SIGCONT)
        replies = [sock.recv(4096) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
        server.signal(signal.SIGCONT)
    assert all(reply.startswith(b"HTTP/1.1 200 OK") for reply in replies)
    assert server.wait_exit() == 0


def test_never_closing_websocket_exits_before_the_kill_deadline(
    servers: list[AiohttpServer],
) -> None:
    """The worst case: a handler that never ends and a client that never answers the
    close frame.  The drain ends at stop_by (grace - kill margin), the session is cut
    and the process exits before SIGKILL."""
    server = start(
        servers, "run_app", **POLICIES["refuse-immediately"], grace_period="4",
        websocket_close_grace="0.2",
    )  # fmt: skip
    ws = raw_websocket(server.port, "/ws?stubborn=1")
    try:
        server.wait_for_line("websocket connected")
        began = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.wait_exit(timeout_s=10) == 0
        took = time.monotonic() - began
    finally:
        ws.close()
    print(f"\nexit {took:.2f} s after SIGTERM with a never-closing websocket (grace 4 s)")
    assert took < 4
    assert server.has_line(r"drain deadline reached with \d+ connections?, 0 requests, 1 session")
    assert server.has_line("on_cleanup ran")


# ------------------------------------------------------------------- rolling restart


@dataclass(frozen=True)
class _Backend:
    name: str
    port: int
    proc: asyncio.subprocess.Process
    output: asyncio.Task[None]


async def _start_backend(name: str, mode: str, options: dict[str, str]) -> _Backend:
    proc = await asyncio.create_subprocess_exec(
        *app_command(mode, options),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "GRACEFUL_DEMO_NAME": name, "PYTHONUNBUFFERED": "1"},
    )
    port = await asyncio.wait_for(_read_port(proc), 20)
    return _Backend(name, port, proc, asyncio.ensure_future(_drain_output(proc)))


async def _read_port(proc: asyncio.subprocess.Process) -> int:
    assert proc.stdout is not None
    async for raw in proc.stdout:
        line = raw.decode()
        if "Running on http://127.0.0.1:" in line:
            return int(line.split("127.0.0.1:")[1].split()[0])
    raise AssertionError("the backend exited before it listened")


async def _drain_output(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    async for _ in proc.stdout:
        pass


async def rolling_restart(mode: str, options: dict[str, str]) -> tuple[int, int, object]:
    """Backend A gets SIGTERM while the balancer keeps routing new connections to it for
    1 s (graceful._demo's balancer: L4, no retries); keep-alive, fresh-connection and
    long requests run throughout.  Returns (requests, failed, results by kind)."""
    from graceful._demo._balancer import Balancer
    from graceful._demo._clients import HttpClient, Tally, http_client_loop

    t0 = time.monotonic()
    tally = Tally(t0)
    a, b, c = await asyncio.gather(*(_start_backend(n, mode, options) for n in "ABC"))
    balancer = Balancer(t0)
    balancer.backends = [a, b]
    await balancer.start()
    stop = asyncio.Event()
    clients = [
        http_client_loop(HttpClient(balancer.port, tally, keep_alive=True), "/", stop, 0.01)
        for _ in range(3)
    ] + [
        http_client_loop(HttpClient(balancer.port, tally, keep_alive=False), "/", stop, 0.01)
        for _ in range(3)
    ] + [http_client_loop(HttpClient(balancer.port, tally, keep_alive=False), "/slow?s=1",
                          stop, 0.0)]  # fmt: skip
    load = asyncio.gather(*clients)
    try:
        await asyncio.sleep(1.0)  # the scenario's timeline: load before the restart
        balancer.backends.append(c)
        a.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)  # the propagation delay: A still gets new connections
        balancer.backends.remove(a)
        code = await asyncio.wait_for(a.proc.wait(), 20)
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await load
        await balancer.stop()
        for backend in (a, b, c):
            if backend.proc.returncode is None:
                backend.proc.kill()
            await backend.proc.wait()
            await backend.output
    assert code == 0, code
    tally.relabel("reset", "refused", len(balancer.refused))
    return tally.requests, tally.failed, dict(tally.results)


@pytest.mark.parametrize(
    ("mode", "options", "fails"),
    [
        ("run_app", {**POLICIES["accept-until-idle"], "grace_period": "10"}, False),
        ("stock", {}, True),
    ],
    ids=["graceful:accept-until-idle", "stock-run_app"],
)
def test_rolling_restart(mode: str, options: dict[str, str], fails: bool) -> None:
    requests, failed, results = asyncio.run(rolling_restart(mode, options))
    print(f"\n{mode}: {failed} of {requests} requests failed: {results}")
    assert requests > 200
    if fails:
        assert failed > 0, results  # stock aiohttp refuses new connections at SIGTERM
    else:
        assert failed == 0, results


# ---------------------------------------------------------------------- metrics


def test_metrics_route_follows_the_drain(servers: list[AiohttpServer]) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(client: RawHTTP) -> dict[str, float]:
        status, headers, body = client.get("/metrics")
        assert status == 200
        assert headers["content-type"].startswith("text/plain; version=0.0.4")
        return {
            s.name + (f"[{s.labels['phase']}]" if "phase" in s.labels else ""): s.value
            for f in text_string_to_metric_families(body.decode())
            for s in f.samples
        }

    server = AiohttpServer(
        [sys.executable, "-m", "tests.integration.metrics_apps.aiohttp_app", "--port", "0"]
    )
    servers.append(server)
    server.port = int(server.wait_for_line(r"Running on http://127\.0\.0\.1:(\d+)")[1])
    scraper = RawHTTP(server.port)
    m = scrape(scraper)
    assert m["graceful_phase[serving]"] == 1
    assert m["graceful_requests_in_flight"] == 0  # the metrics route is not counted
    slow = RawHTTP(server.port)
    slow.send("/slow?s=3")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    assert RawHTTP(server.port).get("/")[0] == 200
    m = scrape(scraper)
    assert m["graceful_phase[accepting]"] == 1
    assert m["graceful_requests_in_flight"] == 1
    assert m["graceful_connections_after_shutdown_total"] == 1
    assert m["graceful_requests_after_shutdown_total"] == 1
    server.wait_for_line(DRAINING)
    m = scrape(scraper)
    assert m["graceful_phase[draining]"] == 1
    assert slow.response()[0] == 200
    assert server.wait_exit() == 0
