"""The behaviour every server graceful drives must show, one matrix over servers and loops.

Each case runs on every row of :data:`ROWS`: ``graceful run`` (uvicorn) on asyncio and
uvloop with h11 and httptools, ``graceful.hypercorn`` on its asyncio, uvloop and trio
workers, ``graceful.aiohttp`` served each way the aiohttp tests serve it (``run_app``,
also on uvloop; a ``runner`` of the user's own; one gunicorn ``AiohttpWorker``), and
gunicorn 27's own HTTP/2 under ``graceful.gunicorn.ThreadWorker`` (a WSGI app).  A row
knows how to start its server with a policy and options, which lines its app prints and
where a signal meant for the serving process goes; the cases know nothing of servers.  A
new server is one more row, and it gets every case.  A row that cannot do a case says so
in :attr:`Row.known_failures` (a strict xfail with the reason), never by being left out.

What only one server does stays in its own module: HTTP/2 and GOAWAY, serving in a running
loop, gunicorn's hypercorn workers and a rolling restart in ``test_hypercorn.py``;
handler-prepared and streaming responses, ``run_app``'s teardown, ``--max-requests``, the
metrics route and a rolling restart in ``test_aiohttp.py``; the command line,
``--workers``, the third signal and a rolling restart in ``test_uvicorn.py``.

Every server is a subprocess on a free loopback port with real clients and real signals;
the tests wait on its log lines (the coordinator logs each phase change), on what the
client receives or on socket states, each with a bounded timeout — never on the clock.
"""

from __future__ import annotations

import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.support.servers import (
    ACCEPTING,
    DRAINING,
    GUNICORN_ENV_OPTIONS,
    HYPERCORN_LAUNCH,
    HYPERCORN_RUNNING,
    POLICY_OPTIONS,
    STOPPED,
    RawHTTP,
    ServerProcess,
    aiohttp_command,
    aiohttp_ready,
    command_line,
    connection_refused,
    decoded_body,
    silent_websocket,
    wait_for,
)

#: The ASGI rows' app: ``examples.asgi_app:app`` and a websocket handler that never ends.
ASGI_APP = "tests.support.hypercorn_apps.asgi_app:app"
#: The WSGI row's app: the same routes and lines, no lifespan, no websocket.
WSGI_APP = "tests.support.wsgi_apps.matrix_app:app"
#: The app's line once a slow request (``/slow?s=…``) started.
SLOW_STARTED = r"slow request started"
#: The policies' windows here: shorter than :data:`POLICY_OPTIONS`' (the matrix waits
#: them out 300 times).  What a case does inside a window (a request or two right after
#: the ``accepting`` line) took at most 0.09 s from the signal in a whole loaded run
#: (twelve workers on two cores).  The two escalation cases keep the longer windows
#: (idle 1 s, max-wait 1.5 s): their second signal comes 0.35 s after the test read the
#: ``accepting`` line (``ServerProcess.signal`` waits out graceful's 0.3 s duplicate
#: window) and must still find the server accepting, or they pass without escalating.
WINDOWS: dict[str, dict[str, str]] = {
    "accept-until-idle": {"idle": "0.6"},
    "serve-until-killed": {"max_wait": "1"},
}
#: Output that means something went wrong even if the test's assertions held.
TROUBLE = re.compile(r"Traceback|Task was destroyed|never awaited|Unhandled exception|ERROR")


# ------------------------------------------------------------------------------ rows


@dataclass(frozen=True, kw_only=True)
class Row:
    """One server in one configuration: how to start it, what its app prints."""

    id: str
    #: Lines the app prints while it shuts down, in the order it prints them (none for
    #: an app with no shutdown of its own: WSGI).
    shutdown_lines: tuple[str, ...]
    #: The app's line once it accepted a websocket, and once the websocket ended.
    websocket_opened: str
    websocket_closed: str
    #: The coordinator's line when the drain ends with a websocket client that never
    #: answers the close frame (see that case).
    unanswered_websocket_ends: str
    #: Cases this row cannot pass, with the reason: a test function's name (every
    #: parametrization), or the name and its parameters' id (``case[accept-until-idle]``).
    known_failures: Mapping[str, str] = field(default_factory=dict)
    #: A gunicorn master in front: it relays the first signal to its worker, and a
    #: repeated SIGTERM is that relay, never an escalation.
    gunicorn: bool = False
    #: A program with its own runner restores its signal handlers when
    #: ``coordinator.run`` returns, so a SIGTERM after the stop (the kubelet's, after a
    #: preStop drain) takes the default action (docs/aiohttp.md, Limits); the servers
    #: graceful runs guard their teardown and exit 0.
    late_signal_kills: bool = False

    def command(self, options: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        """The command line and extra environment that serve with ``options`` (policy,
        ``drain_timeout``, ``grace_period``, ``websocket_close_grace``, ``prestop_path``,
        ``backlog``, by their command-line names with ``_``)."""
        raise NotImplementedError

    def ready(self, server: ServerProcess) -> None:
        """Wait until ``server`` serves; set its port (and worker)."""
        raise NotImplementedError

    def escalate(self, server: ServerProcess, sig: int) -> None:
        """Send a second shutdown signal where it takes effect."""
        server.signal(sig)

    def listeners_closed(self, server: ServerProcess) -> None:
        """Once draining was logged: wait until the listeners are closed (the servers
        graceful drives on an event loop close them before they log it)."""


@dataclass(frozen=True, kw_only=True)
class AsgiRow(Row):
    """A server of :data:`ASGI_APP`, whose lifespan shutdown prints one line."""

    shutdown_lines: tuple[str, ...] = ("lifespan shutdown",)
    websocket_opened: str = r"websocket accepted"


@dataclass(frozen=True, kw_only=True)
class GracefulRun(AsgiRow):
    """``graceful run`` (uvicorn) with ``--loop`` and ``--http``."""

    loop: str
    http: str
    #: More of ``graceful run``'s options (``--http2`` for zttp).
    extra: tuple[str, ...] = ()
    # uvicorn reports the code the client echoed.
    websocket_closed: str = r"websocket disconnected with code 1001"
    # The app is told at once (after the close grace) and its session ends; the TCP
    # connection, still in the close handshake, is what the deadline cuts — or, with
    # uvicorn 0.50 (the floor), uvicorn closes it itself and the drain ends at once.
    unanswered_websocket_ends: str = (
        r"draining -> stopping: (drained|drain deadline reached with 1 connection, "
        r"0 requests left)"
    )

    def command(self, options: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        if self.loop == "uvloop":
            pytest.importorskip("uvloop")
        if self.http == "zttp":
            pytest.importorskip("uvicorn.protocols.http.zttp_impl", reason="uvicorn before zttp")
        return [
            sys.executable, "-m", "graceful", "run", ASGI_APP, "--port", "0",
            "--loop", self.loop, "--http", self.http, *self.extra, *command_line(options),
        ], {}  # fmt: skip

    def ready(self, server: ServerProcess) -> None:
        server.port = int(server.wait_for_line(r"running on http://127\.0\.0\.1:(\d+)")[1])


@dataclass(frozen=True, kw_only=True)
class Hypercorn(AsgiRow):
    """``graceful.hypercorn.run`` with a worker class (``hypercorn_apps/launch.py``)."""

    worker: str
    # hypercorn reports a close the server started as 1000 to the app.
    websocket_closed: str = r"websocket disconnected with code"
    # The session itself is still open at the deadline, and cut.
    unanswered_websocket_ends: str = (
        r"draining -> stopping: drain deadline reached with \d+ connections?, \d+ requests?, "
        r"1 session"
    )

    def command(self, options: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        pytest.importorskip("hypercorn")
        if self.worker != "asyncio":
            pytest.importorskip(self.worker)
        return [
            sys.executable, HYPERCORN_LAUNCH, "--app", ASGI_APP, "--worker", self.worker,
            "--access-log", *command_line(options),
        ], {}  # fmt: skip

    def ready(self, server: ServerProcess) -> None:
        server.port = int(server.wait_for_line(HYPERCORN_RUNNING)[1])


@dataclass(frozen=True, kw_only=True)
class Aiohttp(Row):
    """The aiohttp test app (``aiohttp_apps/app.py``) served in ``mode``."""

    mode: str
    uvloop: bool = False
    shutdown_lines: tuple[str, ...] = ("on_shutdown ran", "on_cleanup ran")
    websocket_opened: str = r"websocket connected"
    websocket_closed: str = r"websocket closed with code"
    # The websocket is closed after the close grace and the handler ends without the
    # client's answer: the drain ends long before its deadline.
    unanswered_websocket_ends: str = r"draining -> stopping: drained \(0 connections"

    def command(self, options: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        pytest.importorskip("aiohttp")
        if self.mode == "gunicorn":
            pytest.importorskip("gunicorn")
        if self.uvloop:
            pytest.importorskip("uvloop")
            options = {**options, "uvloop": ""}
        return aiohttp_command(self.mode, options)

    def ready(self, server: ServerProcess) -> None:
        aiohttp_ready(server, self.mode)

    def escalate(self, server: ServerProcess, sig: int) -> None:
        if self.gunicorn:  # the master relays only the first signal
            server.signal_worker(sig)
        else:
            server.signal(sig)


#: What a WSGI server cannot do, for :attr:`Row.known_failures`.
WSGI_CANNOT = {
    case: "WSGI has no websockets"
    for case in (
        "test_websocket_gets_going_away",
        "test_websocket_gets_going_away_on_escalation",
        "test_websocket_client_that_never_answers_does_not_hold_the_process",
        "test_websocket_handler_that_never_ends_is_cut_before_the_kill_deadline",
    )
}


@dataclass(frozen=True, kw_only=True)
class GunicornHttp2(Row):
    """gunicorn 27 serving its own HTTP/2 beside HTTP/1.1 (``--http-protocols h2,h1
    --http2-cleartext both``) with ``-k graceful.gunicorn.ThreadWorker`` and one worker,
    whose master gets the signals, as in a container; :data:`WSGI_APP`.  Skipped before
    gunicorn 27 (``graceful.gunicorn._http2.SEAMS``)."""

    gunicorn: bool = True
    #: WSGI has no lifespan: no app line; the cases still check the stop's own line.
    shutdown_lines: tuple[str, ...] = ()
    # WSGI has no websockets: those cases are known failures (WSGI_CANNOT).
    websocket_opened: str = "websocket accepted"
    websocket_closed: str = "websocket disconnected"
    unanswered_websocket_ends: str = "draining -> stopping"
    known_failures: Mapping[str, str] = field(default_factory=lambda: dict(WSGI_CANNOT))

    def command(self, options: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        pytest.importorskip("gunicorn")
        from graceful.gunicorn._http2 import SEAMS

        if not SEAMS:
            pytest.skip("gunicorn before 27 (its HTTP/2 differs)")
        rest = dict(options)
        grace = rest.pop("grace_period", "10")
        backlog = rest.pop("backlog", "2048")
        env = {f"GRACEFUL_{k.upper()}": rest.pop(k) for k in GUNICORN_ENV_OPTIONS if k in rest}
        assert not rest, f"no gunicorn option for {rest}"
        return [
            sys.executable, "-m", "gunicorn", WSGI_APP,
            "-k", "graceful.gunicorn.ThreadWorker", "--threads", "4", "-w", "1",
            "--http-protocols", "h2,h1", "--http2-cleartext", "both",
            "-b", "127.0.0.1:0", "--graceful-timeout", grace, "--backlog", backlog,
        ], env  # fmt: skip

    def ready(self, server: ServerProcess) -> None:
        server.port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)")[1])
        server.worker_pid = int(server.wait_for_line(r"Booting worker with pid: (\d+)")[1])
        server.wait_for_line(r"policy .*; kill deadline")  # the worker's coordinator runs

    def escalate(self, server: ServerProcess, sig: int) -> None:
        server.signal_worker(sig)  # the master relays only the first signal

    def listeners_closed(self, server: ServerProcess) -> None:
        # gunicorn's loop closes them in its own thread, just after the coordinator's
        # thread logged draining (the master closed its copy at SIGTERM).
        wait_for(lambda: not listening(server.port), 5, f"port {server.port} closed")


ROWS: list[Row] = [
    *(
        GracefulRun(id=f"uvicorn-{loop}-{http}", loop=loop, http=http)
        for loop in ("asyncio", "uvloop")  # uvloop hides accept races
        for http in ("h11", "httptools")
    ),
    # uvicorn's own HTTP/2 (zttp, the --http2 dispatcher): every case on its HTTP/1.1
    # side; its HTTP/2 side in tests/uvicorn/test_uvicorn_http2.py and test_http2_rollout.py.
    GracefulRun(id="uvicorn-zttp-http2", loop="asyncio", http="zttp", extra=("--http2",)),
    *(
        Hypercorn(id=f"hypercorn-{worker}", worker=worker)
        for worker in ("asyncio", "uvloop", "trio")
    ),
    Aiohttp(id="aiohttp-run_app", mode="run_app"),
    Aiohttp(id="aiohttp-run_app-uvloop", mode="run_app", uvloop=True),
    Aiohttp(id="aiohttp-runner", mode="runner", late_signal_kills=True),
    Aiohttp(id="aiohttp-gunicorn", mode="gunicorn", gunicorn=True),
    # gunicorn's own HTTP/2 (27+) under graceful's ThreadWorker: every case on its HTTP/1.1
    # side; its HTTP/2 side in tests/gunicorn/test_http2.py and test_http2_rollout.py.
    GunicornHttp2(id="gunicorn-thread-http2"),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every case that takes a ``row`` runs on every row; a row's known failure of the
    case is a strict xfail."""
    if "row" not in metafunc.fixturenames:
        return
    case = metafunc.function.__name__
    metafunc.parametrize(
        "row",
        [
            pytest.param(
                row,
                id=row.id,
                marks=[pytest.mark.xfail(strict=True, reason=row.known_failures[case])]
                if case in row.known_failures
                else [],
            )
            for row in ROWS
        ],
    )


Launch = Callable[..., ServerProcess]


def listening(port: int) -> bool:
    """Whether a socket listens on loopback ``port`` (``/proc/net/tcp``, state 0A)."""
    with open("/proc/net/tcp") as table:
        return any(
            fields[1].endswith(f":{port:04X}") and fields[3] == "0A"
            for fields in (line.split() for line in list(table)[1:])
        )


@pytest.fixture
def launch(row: Row, request: pytest.FixtureRequest) -> Iterator[Launch]:
    """``launch(policy, **options)`` starts the row's server; every server started is
    stopped afterwards, and none may have logged trouble (:data:`TROUBLE`) unless the
    case is a known failure of the row (whose output shows why).  A known failure of
    one parametrization (``case[params]``) is a strict xfail from here."""
    node = request.node
    params = node.callspec.id.removeprefix(row.id).removeprefix("-")
    known = row.known_failures.get(f"{node.originalname}[{params}]")
    if known is not None:  # a whole case's is marked by pytest_generate_tests
        node.add_marker(pytest.mark.xfail(strict=True, reason=known))
    known = known or row.known_failures.get(node.originalname)
    started: list[ServerProcess] = []

    def start(policy: str, **options: str) -> ServerProcess:
        args, env = row.command({**POLICY_OPTIONS[policy], **WINDOWS.get(policy, {}), **options})
        server = ServerProcess(args, env=env)
        started.append(server)
        row.ready(server)
        return server

    yield start
    RawHTTP.close_all()
    for server in started:
        server.stop()
    for server in started:
        assert known or not TROUBLE.search(server.output()), server.output()


def line_index(server: ServerProcess, pattern: str) -> int:
    """The index of the first output line matching ``pattern``."""
    lines = server.output().splitlines()
    found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert found, f"no line matching {pattern!r}:\n{server.output()}"
    return found[0]


def assert_app_shut_down(server: ServerProcess, row: Row) -> None:
    """The app's shutdown lines were printed, in their order, before the coordinator
    logged the stop."""
    order = [line_index(server, line) for line in (*row.shutdown_lines, STOPPED)]
    assert order == sorted(order), server.output()


# ---------------------------------------------------------------- requests in flight


@pytest.mark.parametrize(
    ("policy", "nudged"),
    [("accept-until-idle", True), ("serve-until-killed", False), ("refuse-immediately", True)],
    ids=["accept-until-idle", "serve-until-killed", "refuse-immediately"],
)
def test_request_in_flight_at_sigterm_completes(
    launch: Launch, row: Row, policy: str, nudged: bool
) -> None:
    """A request in flight at SIGTERM gets its whole response; it carries
    ``Connection: close`` unless the policy keeps serving keep-alive while accepting
    (serve-until-killed), whose connection is closed once draining begins instead.  The
    phases come in order, the app's shutdown runs after draining began.  The request
    waits for its body's last byte, which the test sends once the server has acted on
    the signal (accepting began, or draining for refuse-immediately)."""
    server = launch(policy)
    client = RawHTTP(server.port)
    client.send("/held", headers="content-length: 1\r\n")
    server.wait_for_line(SLOW_STARTED)
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING if policy == "refuse-immediately" else ACCEPTING)
    client.sock.sendall(b"x")
    status, headers, body = client.response()
    assert (status, body) == (200, b"released\n")
    assert (headers.get("connection") == "close") is nudged, headers
    assert client.closed_by_peer()
    assert server.wait_exit() == 0
    assert line_index(server, ACCEPTING) < line_index(server, DRAINING)
    assert line_index(server, DRAINING) < line_index(server, (*row.shutdown_lines, STOPPED)[0])
    assert_app_shut_down(server, row)


# ------------------------------------------------------------ accepting, draining


@pytest.mark.parametrize(
    ("policy", "accepts"),
    [("accept-until-idle", True), ("serve-until-killed", True), ("refuse-immediately", False)],
    ids=["accept-until-idle", "serve-until-killed", "refuse-immediately"],
)
def test_new_connections_served_while_accepting_then_refused_once_draining(
    launch: Launch, row: Row, policy: str, accepts: bool
) -> None:
    """After SIGTERM a new connection is served while the policy accepts (the balancer
    may still send one); once draining begins the listener is closed: a new connection
    is refused, not reset, while a request in flight still finishes."""
    server = launch(policy)
    holder = RawHTTP(server.port)
    holder.send("/held", headers="content-length: 1\r\n")  # in flight until its body comes
    server.wait_for_line(SLOW_STARTED)
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    if accepts:
        status, _, body = RawHTTP.get_once(server.port, "/")
        assert (status, body) == (200, b"hello\n")
        assert not server.has_line(DRAINING)
    server.wait_for_line(DRAINING)
    row.listeners_closed(server)
    assert connection_refused(server.port)
    holder.sock.sendall(b"x")
    assert holder.response()[:3:2] == (200, b"released\n")
    assert server.wait_exit() == 0


def test_accept_until_idle_exits_soon_after_the_last_new_connection(
    launch: Launch, row: Row
) -> None:
    """accept-until-idle keeps accepting while new connections come, and drains once
    none came for its idle window: the exit follows the last one by about that window."""
    server = launch("accept-until-idle")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    for _ in range(3):  # new connections keep the listener open
        assert RawHTTP(server.port).get("/")[0] == 200
    last_connection = time.monotonic()
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - last_connection < 0.6 + 3  # idle + slack (noisy machine)
    assert server.has_line(r"accepting -> draining: no new connection for")


def test_backlog_queued_while_stopped_is_served(launch: Launch, row: Row) -> None:
    """SIGSTOP the serving process, let 100 clients connect and send a request into the
    kernel's accept queue, SIGTERM, SIGCONT: the listener closes at once
    (refuse-immediately) without resetting the queue, and every client is answered."""
    server = launch("refuse-immediately", backlog="256")
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
        for n, sock in enumerate(socks):
            data = b""
            while b"hello\n" not in data:
                try:
                    chunk = sock.recv(4096)
                except TimeoutError:  # say what the server did (a hypercorn-trio run, once)
                    raise AssertionError(
                        f"client {n} of 100: no answer within 10 s ({answered} answered "
                        f"before it, {data!r} so far); server:\n{server.output()[-3000:]}"
                    ) from None
                if not chunk:
                    break
                data += chunk
            answered += data.startswith(b"HTTP/1.1 200 ") and b"hello\n" in data
    finally:
        for sock in socks:
            sock.close()
        server.signal_worker(signal.SIGCONT)
    assert answered == 100
    assert server.wait_exit() == 0
    assert server.has_line(STOPPED)


# ----------------------------------------------------------------------- keep-alive


@pytest.mark.parametrize(
    ("policy", "nudges"),
    [("accept-until-idle", True), ("serve-until-killed", False)],
    ids=["accept-until-idle", "serve-until-killed"],
)
def test_keep_alive_after_sigterm_is_nudged_per_policy(
    launch: Launch, row: Row, policy: str, nudges: bool
) -> None:
    """A keep-alive connection's next request after SIGTERM is answered; the answer
    carries ``Connection: close`` (and the connection is closed) if the policy nudges
    clients to move while accepting, and leaves the connection open if it does not."""
    server = launch(policy)
    client = RawHTTP(server.port)
    status, headers, _ = client.get("/")
    assert status == 200
    assert headers.get("connection") != "close"
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, headers, _ = client.get("/")  # the same keep-alive connection
    assert status == 200
    assert (headers.get("connection") == "close") is nudges, headers
    if nudges:
        assert client.closed_by_peer()
    else:
        assert not client.has_data(timeout_s=0.1)  # not closed by the server
        client.close()  # the client leaves (else the drain gives it idle_grace_s)
    assert server.wait_exit() == 0


def test_idle_keep_alive_is_closed_at_draining_not_before(launch: Launch, row: Row) -> None:
    """An idle keep-alive connection stays open and usable while accepting (no nudge:
    serve-until-killed) and is closed by the server once draining begins."""
    server = launch("serve-until-killed")
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


def test_idle_keep_alive_may_send_one_more_request_at_draining(launch: Launch, row: Row) -> None:
    """A request sent on an idle keep-alive connection right after draining began (the
    client could not know yet) is answered, with ``Connection: close``, not dropped."""
    server = launch("refuse-immediately")
    holder = RawHTTP(server.port)
    holder.send("/held", headers="content-length: 1\r\n")  # keeps the drain going
    server.wait_for_line(SLOW_STARTED)
    idle = RawHTTP(server.port)
    assert idle.get("/")[0] == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING)
    status, headers, _ = idle.get("/")  # sent right after draining began: answered
    assert status == 200
    assert headers["connection"] == "close"
    assert idle.closed_by_peer()
    holder.sock.sendall(b"x")  # the held request's last byte: the drain can end
    assert holder.response()[:3:2] == (200, b"released\n")
    assert server.wait_exit() == 0


# ------------------------------------------------------------------------ websockets


def test_websocket_gets_going_away(launch: Launch, row: Row) -> None:
    """An open websocket gets a close frame with code 1001 (going away) once draining
    begins; the app sees it end, nothing is cut and the process exits 0."""
    server = launch("refuse-immediately", websocket_close_grace="0.2")
    with ws_connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=10) as ws:
        ws.send("ping")
        assert ws.recv(timeout=10) == "ping"
        server.signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1001
    server.wait_for_line(row.websocket_closed)
    assert server.wait_exit() == 0
    assert not server.has_line(r"cutting|drain deadline reached")
    assert_app_shut_down(server, row)


@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGQUIT,)], ids=["twice", "sigquit"]
)
def test_websocket_gets_going_away_on_escalation(
    launch: Launch, row: Row, signals: tuple[signal.Signals, ...]
) -> None:
    """When shutdown escalates straight to stopping (a second SIGTERM while accepting,
    or SIGQUIT), an open websocket still gets 1001 rather than a dropped connection —
    its close is requested from the signal's loop callback, not from a task."""
    server = launch("serve-until-killed", max_wait="1.5")  # see WINDOWS
    with ws_connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=10) as ws:
        ws.send("ping")
        assert ws.recv(timeout=10) == "ping"
        server.signal(signals[0])
        for sig in signals[1:]:
            server.wait_for_line(ACCEPTING)
            row.escalate(server, sig)
        server.wait_for_line(r"-> stopping")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1001
    assert server.wait_exit() == 0


def exit_after_sigterm_with_silent_websocket(
    server: ServerProcess, row: Row, path: str, *, kill_after_s: float | None = None
) -> float:
    """Open a websocket on ``path`` whose client never reads nor answers, SIGTERM, wait
    for the exit (status 0): the seconds from the signal to the exit.

    With ``kill_after_s`` the test is the kubelet: it SIGKILLs the process that long
    after its SIGTERM, and a status of 0 says the server exited on its own before.
    """
    sock = silent_websocket(server.port, path)
    killer = None
    try:
        server.wait_for_line(row.websocket_opened)
        began = time.monotonic()
        server.signal(signal.SIGTERM)
        if kill_after_s is not None:
            killer = threading.Timer(kill_after_s, server.proc.send_signal, (signal.SIGKILL,))
            killer.start()
        status = server.wait_exit(timeout_s=15)
        exit_s = time.monotonic() - began
        assert status == 0, f"exit status {status} ({exit_s:.2f} s after SIGTERM)"
    finally:
        if killer is not None:
            killer.cancel()
        sock.close()
    print(f"\nexit {exit_s:.2f} s after SIGTERM ({row.id} {path}, Python {sys.version.split()[0]})")
    return exit_s


def test_websocket_client_that_never_answers_does_not_hold_the_process(
    launch: Launch, row: Row
) -> None:
    """A websocket client that never reads and never answers the close frame does not
    hold the process: the drain ends by its deadline at the latest (each row says how:
    :attr:`Row.unanswered_websocket_ends`), the app's shutdown still runs and the process
    exits well before the kill deadline (stock hypercorn on Python >= 3.12.1 would wait
    for it until SIGKILL: pgjones/hypercorn#308)."""
    server = launch(
        "refuse-immediately", drain_timeout="1.5", grace_period="8", websocket_close_grace="0.2"
    )
    exit_s = exit_after_sigterm_with_silent_websocket(server, row, "/ws")
    assert exit_s < 1.5 + 3  # the drain deadline, the cut, slack for a loaded machine
    assert server.has_line(row.unanswered_websocket_ends), server.output()
    assert_app_shut_down(server, row)


def test_websocket_handler_that_never_ends_is_cut_before_the_kill_deadline(
    launch: Launch, row: Row
) -> None:
    """The worst case: a handler that never ends (it never reads its websocket) and a
    client that never answers the close frame.  The drain timeout (30 s) lies beyond the
    kill deadline, so the drain ends at stop_by (grace - kill margin), the session is
    cut, the app's shutdown still runs and the process exits before SIGKILL."""
    server = launch("refuse-immediately", grace_period="4", websocket_close_grace="0.2")
    if row.gunicorn:
        # gunicorn's master is the killer (--graceful-timeout 4): it did not need to
        # SIGKILL the worker; the master's own exit follows its worker's.
        assert exit_after_sigterm_with_silent_websocket(server, row, "/ws?stubborn=1") < 4 + 2
        assert not server.has_line(r"was sent SIGKILL"), server.output()
    else:  # the test is the kubelet: SIGKILL at the grace period
        exit_after_sigterm_with_silent_websocket(server, row, "/ws?stubborn=1", kill_after_s=4)
    assert server.has_line(r"drain deadline reached with \d+ connections?, 0 requests, 1 session")
    assert_app_shut_down(server, row)


# ---------------------------------------------------------------- health and preStop


def test_readiness_flips_to_503_at_sigterm_liveness_stays(launch: Launch, row: Row) -> None:
    """``/readyz`` answers 200 while serving and 503 from SIGTERM on (so the endpoint is
    taken out of rotation); ``/livez`` stays 200 (so nothing restarts the pod)."""
    server = launch("serve-until-killed")
    assert RawHTTP.get_once(server.port, "/readyz")[:1] == (200,)
    assert RawHTTP.get_once(server.port, "/livez")[:1] == (200,)
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    status, _, body = RawHTTP.get_once(server.port, "/readyz")
    assert status == 503
    assert body.startswith(b"shutting down")
    assert RawHTTP.get_once(server.port, "/livez")[:1] == (200,)
    assert server.wait_exit() == 0


def test_prestop_endpoint_blocks_until_drained(launch: Launch, row: Row) -> None:
    """A request to the preStop path starts the shutdown and is answered only once the
    drain is done (the request in flight finished first); the kubelet's SIGTERM that
    follows ends the process cleanly."""
    server = launch("refuse-immediately", prestop_path="/prestop")
    held = RawHTTP(server.port)
    held.send("/held", headers="content-length: 1\r\n")  # in flight until its body comes
    server.wait_for_line(SLOW_STARTED)
    prestop = RawHTTP(server.port)
    prestop.send("/prestop")
    server.wait_for_line(r"serving -> accepting: preStop")
    server.wait_for_line(DRAINING)
    assert not prestop.has_data(timeout_s=0.1)  # the preStop hook waits for the drain
    held.sock.sendall(b"x")
    assert held.response()[:3:2] == (200, b"released\n")
    status, _, body = prestop.response()
    assert status == 200
    assert b"0 requests, 0 sessions left" in body
    server.signal(signal.SIGTERM)  # the kubelet's SIGTERM after preStop returned
    code = server.wait_exit()
    assert code == 0 or (row.late_signal_kills and code == -signal.SIGTERM), code


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_second_signal_escalates(launch: Launch, row: Row, sig: signal.Signals) -> None:
    """A second SIGTERM or SIGINT while accepting skips the drain: the request in
    flight is cut with a clean 503, the app's shutdown still runs, the process exits
    0 at once."""
    if sig == signal.SIGTERM and row.gunicorn:
        pytest.skip(
            "under gunicorn a repeated SIGTERM is the master's relay, never an escalation "
            "(tests/faults/test_gunicorn_edges.py); SIGINT and SIGQUIT stop at once"
        )
    server = launch("accept-until-idle", drain_timeout="60", idle="1")  # see WINDOWS
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(SLOW_STARTED)
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    began = time.monotonic()
    row.escalate(server, sig)
    status, headers, _ = client.response()
    assert status == 503  # cut before its response started: a clean answer
    assert headers["connection"] == "close"
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - began < 5
    assert server.has_line(rf"accepting -> stopping: {sig.name} \(escalated\)")
    assert_app_shut_down(server, row)


def test_sigquit_stops_at_once(launch: Launch, row: Row) -> None:
    """SIGQUIT means stop now: no accepting, no drain; the request in flight is cut
    with a clean 503 and the app's shutdown still runs."""
    server = launch("serve-until-killed", drain_timeout="60")
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(SLOW_STARTED)
    began = time.monotonic()
    server.signal(signal.SIGQUIT)
    status, headers, _ = client.response()
    assert status == 503
    assert headers["connection"] == "close"
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - began < 5
    assert server.has_line(r"serving -> stopping: SIGQUIT")
    assert not server.has_line(ACCEPTING)
    assert_app_shut_down(server, row)


def test_request_longer_than_the_drain_deadline_is_cut_cleanly_with_503(
    launch: Launch, row: Row
) -> None:
    """A request that would outlast the drain deadline is cut there with a clean 503
    (``Connection: close``, then closed) rather than left to the SIGKILL; the app's
    shutdown still runs and the process exits before the kill deadline."""
    server = launch("refuse-immediately", drain_timeout="1", grace_period="6")
    client = RawHTTP(server.port)
    client.send("/slow?s=30")
    server.wait_for_line(SLOW_STARTED)
    began = time.monotonic()
    server.signal(signal.SIGTERM)
    status, headers, body = client.response()  # a clean answer, not a hang
    assert (status, decoded_body(headers, body)) == (503, b"server shutting down\n")
    assert headers["connection"] == "close"
    assert client.closed_by_peer()
    assert server.wait_exit(timeout_s=10) == 0
    assert time.monotonic() - began < 6  # before the kill deadline
    assert server.has_line(r"drain deadline reached with \d+ connections?, 1 request\b")
    assert_app_shut_down(server, row)
