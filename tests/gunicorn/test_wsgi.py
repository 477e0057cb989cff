"""gunicorn -k graceful.gunicorn.SyncWorker with real Flask and Django apps: a real
master, real workers, real signals, raw sockets."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.servers import RawHTTP, ServerProcess, sigstop, wait_for

gunicorn = pytest.importorskip("gunicorn")
pytest.importorskip("flask")

GUNICORN = tuple(int(part) for part in gunicorn.__version__.split(".")[:2])

FLASK = "tests.support.wsgi_apps.flask_app:app"
DJANGO = "tests.support.wsgi_apps.django_app:application"
LISTENING = r"Listening at: http://127\.0\.0\.1:(\d+)"
BOOTED = r"policy .*; kill deadline"


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    yield servers
    RawHTTP.close_all()
    for server in servers:
        server.stop()


#: The graceful WSGI workers, each with the options it runs with here.
WORKERS = {
    "sync": ["-k", "graceful.gunicorn.SyncWorker"],
    "gthread": ["-k", "graceful.gunicorn.ThreadWorker", "--threads", "4"],
}


@pytest.fixture(params=list(WORKERS))
def worker(request: pytest.FixtureRequest) -> list[str]:
    return WORKERS[request.param]


def start(
    started: list[ServerProcess],
    *options: str,
    worker: list[str],
    app: str = FLASK,
    workers: int = 1,
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> ServerProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    server = ServerProcess(
        [sys.executable, "-m", "gunicorn", app, *worker, "-w", str(workers),
         "-b", "127.0.0.1:0", "--graceful-timeout", "10", *options],
        env={**environment, **(env or {})},
    )  # fmt: skip
    started.append(server)
    if wait:
        server.port = int(server.wait_for_line(LISTENING).group(1))
        if any("graceful" in word for word in worker):
            server.wait_for_line(BOOTED, count=workers)
    return server


def answer(client: RawHTTP) -> tuple[int, dict[str, str], bytes]:
    """The response, then the client closes as curl or requests do on ``Connection:
    close`` (gunicorn's sync worker lingers up to 2 s for a client that does not)."""
    try:
        return client.response()
    finally:
        client.sock.close()


def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    client = RawHTTP(port)
    client.send(path)
    return answer(client)


def worker_pid(server: ServerProcess) -> int:
    return int(server.wait_for_line(r"Booting worker with pid: (\d+)").group(1))


@pytest.mark.parametrize("app", [FLASK, DJANGO], ids=["flask", "django"])
def test_in_flight_request_completes_and_new_connections_are_served_while_accepting(
    started: list[ServerProcess], worker: list[str], app: str
) -> None:
    server = start(started, worker=worker, app=app, env={"GRACEFUL_IDLE": "1"})
    slow = RawHTTP(server.port)
    slow.send("/slow?s=1.5&id=long")
    server.wait_for_line("slow request started long")
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting: SIGTERM")
    # The load balancer still sends a new connection: it is served, not refused.
    late = RawHTTP(server.port)
    late.send("/?id=late")
    assert answer(slow)[0] == 200
    status, _, body = answer(late)
    assert status == 200
    assert b"hello from late\n" in body  # Django's is chunked
    assert server.wait_exit() == 0
    assert server.has_line(r"accepting -> draining: no new connection for"), server.output()
    assert server.has_line(r"stopping -> stopped"), server.output()


def test_probes_do_not_count_as_traffic_and_readiness_fails_at_sigterm(
    started: list[ServerProcess], worker: list[str]
) -> None:
    server = start(started, worker=worker, env={"GRACEFUL_IDLE": "1"})
    assert get(server.port, "/readyz")[0] == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting")
    began = time.monotonic()
    # Probes every 0.2 s: they answer 503 and do not hold the worker in accepting.
    while server.proc.poll() is None and time.monotonic() - began < 8:
        try:
            status, headers, _ = get(server.port, "/readyz")
        except OSError:
            break  # the worker stopped accepting
        assert status == 503
        assert headers.get("connection") == "close"
        time.sleep(0.2)  # paces the probes as a kubelet's period does
    assert server.wait_exit() == 0
    assert server.has_line(r"accepting -> draining: no new connection for"), server.output()


def test_drain_signal_is_in_the_environ(started: list[ServerProcess], worker: list[str]) -> None:
    server = start(started, worker=worker)
    assert get(server.port, "/draining")[2] == b"draining=False\n"


def status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as lines:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}


def zombie(pid: int) -> bool:
    """``pid`` exited: a zombie, or reaped already (its ``/proc`` entry gone, or going
    while read: ESRCH, seen in CI)."""
    try:
        return status(pid)["State"].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True


def sigterm_pending(pid: int) -> bool:
    fields = status(pid)
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def burst(server: ServerProcess, n: int = 100) -> list[int | None]:
    """SIGSTOP the worker, queue ``n`` connections with a request each, SIGTERM to the
    master, SIGCONT: each connection's status (``None``: refused or reset)."""
    pid = worker_pid(server)
    assert get(server.port, "/?id=first")[0] == 200  # the worker's loop runs
    sigstop(pid)  # stopped before the SIGTERM comes, which the kernel may deliver first
    try:
        clients = [RawHTTP(server.port) for _ in range(n)]
        for i, client in enumerate(clients):
            client.send(f"/?id={i}")
        server.signal(signal.SIGTERM)
        # The master's SIGTERM waits in the stopped worker: it acts on it before anything.
        wait_for(lambda: sigterm_pending(pid), 10, "SIGTERM pending in the worker")
    finally:
        os.kill(pid, signal.SIGCONT)
    statuses: list[int | None] = []
    for i, client in enumerate(clients):
        try:
            status, _, body = answer(client)
        except OSError:
            statuses.append(None)
        else:
            assert status != 200 or body == f"hello from {i}\n".encode()
            statuses.append(status)
    return statuses


def test_accept_backlog_queued_while_stopped_is_served(
    started: list[ServerProcess], worker: list[str]
) -> None:
    """The burst: 100 of 100 served."""
    if "graceful.gunicorn.ThreadWorker" in worker and GUNICORN < (24,):
        pytest.skip("gunicorn < 24's gthread loop has no seam to accept the backlog at the stop")
    server = start(started, worker=worker, env={"GRACEFUL_POLICY": "refuse-immediately"})
    assert burst(server) == [200] * 100
    assert server.wait_exit() == 0


@pytest.mark.parametrize(
    "stock", [["-k", "sync"], ["-k", "gthread", "--threads", "4"]], ids=["sync", "gthread"]
)
def test_stock_worker_resets_the_accept_backlog(
    started: list[ServerProcess], stock: list[str]
) -> None:
    """What the graceful workers fix: stock ``sync`` and ``gthread`` stop accepting at
    SIGTERM and leave the queued connections to be reset."""
    server = start(started, worker=stock)
    statuses = burst(server)
    assert statuses.count(200) < 100, statuses
    server.wait_exit()


def test_worker_exits_before_the_kill_deadline_whatever_the_app_does(
    started: list[ServerProcess], worker: list[str]
) -> None:
    """A request longer than --graceful-timeout: the worker ends itself before the
    master's SIGKILL (kill margin 1 s), and says so."""
    server = start(started, "--graceful-timeout", "3", worker=worker, env={"GRACEFUL_IDLE": "0.2"})
    client = RawHTTP(server.port)
    client.send("/slow?s=30&id=stuck")
    server.wait_for_line("slow request started stuck")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
    assert server.has_line(r"still alive at the last moment before SIGKILL")
    assert not server.has_line(r"was sent SIGKILL")


def test_sigquit_stops_at_once(started: list[ServerProcess], worker: list[str]) -> None:
    server = start(started, worker=worker)
    client = RawHTTP(server.port)
    client.send("/slow?s=30&id=q")
    server.wait_for_line("slow request started q")
    server.signal(signal.SIGQUIT)
    assert server.wait_exit(10) == 0
    assert not server.has_line(r"serving -> accepting")


def test_gthread_kept_alive_connection_gets_connection_close_then_is_closed(
    started: list[ServerProcess],
) -> None:
    """A kept-alive connection used after SIGTERM: 200 with ``Connection: close``
    (the client reconnects, to a pod still in the load balancer); one left idle is
    closed once draining begins."""
    server = start(started, worker=WORKERS["gthread"], env={"GRACEFUL_IDLE": "1"})
    used, idle = RawHTTP(server.port), RawHTTP(server.port)
    for client in (used, idle):
        assert client.get("/?id=before")[0] == 200  # kept alive
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting: SIGTERM")
    status, headers, body = used.get("/?id=after")
    assert (status, headers.get("connection"), body) == (200, "close", b"hello from after\n")
    assert idle.closed_by_peer()
    assert server.wait_exit() == 0


def test_stream_ends_cleanly_when_draining_begins(started: list[ServerProcess]) -> None:
    """examples/wsgi_flask.py under ThreadWorker: the open event stream gets its last
    event and a complete (chunked) end once draining begins; the worker exits 0."""
    server = start(
        started,
        worker=WORKERS["gthread"],
        app="examples.wsgi_flask:app",
        env={"GRACEFUL_IDLE": "0.5"},
    )
    client = RawHTTP(server.port)
    client.send("/events?interval=0.2")
    client.sock.settimeout(10)
    received = b""
    while b"data: 1\n" not in received:
        received += client.sock.recv(65536)
    server.signal(signal.SIGTERM)
    while not received.endswith(b"0\r\n\r\n"):  # the last chunk
        chunk = client.sock.recv(65536)
        assert chunk, received
        received += chunk
    assert b"event: bye" in received
    client.sock.close()
    assert server.wait_exit() == 0
    assert server.has_line(r"accepting -> draining")


def test_prestop_starts_the_policy(started: list[ServerProcess], worker: list[str]) -> None:
    """GRACEFUL_PRESTOP_PATH: the kubelet's preStop request starts the shutdown (the
    gthread worker answers once the drain is done, as the ASGI workers; the sync worker
    at once), and the worker exits 0 without any signal."""
    server = start(
        started, worker=worker, env={"GRACEFUL_PRESTOP_PATH": "/prestop", "GRACEFUL_IDLE": "0.3"}
    )
    status, _, body = get(server.port, "/prestop")
    assert status == 200
    waits = "graceful.gunicorn.ThreadWorker" in worker  # the sync worker's one thread cannot
    assert body == (
        b"draining: 0 requests, 0 sessions left\n" if waits else b"shutdown requested\n"
    )
    server.wait_for_line(r"serving -> accepting: preStop")
    server.wait_for_line(r"stopping -> stopped")
    server.signal(signal.SIGTERM)  # the kubelet's SIGTERM after the hook
    assert server.wait_exit() == 0


def test_metrics_endpoint(started: list[ServerProcess], worker: list[str]) -> None:
    """GRACEFUL_METRICS_PATH: Prometheus metrics of the worker's coordinator; the scrape
    itself is not counted as a request."""
    pytest.importorskip("prometheus_client")
    server = start(started, worker=worker, env={"GRACEFUL_METRICS_PATH": "/metrics"})
    get(server.port, "/?id=counted")
    status, headers, body = get(server.port, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    text = body.decode()
    assert 'graceful_phase{phase="serving"} 1.0' in text
    assert "graceful_requests_total 1.0" in text  # the request, not the scrape


def test_second_sigterm_is_the_relay_and_sigquit_stops_at_once(
    started: list[ServerProcess], worker: list[str]
) -> None:
    """A second SIGTERM, however late (the master's relay of a group signal comes late
    on a loaded machine), is not an escalation; SIGQUIT, gunicorn's quick shutdown,
    stops the worker at once (the 30 s request is cut)."""
    server = start(started, worker=worker, env={"GRACEFUL_POLICY": "serve-until-killed"})
    pid = worker_pid(server)
    client = RawHTTP(server.port)
    client.send("/slow?s=30&id=cut")
    server.wait_for_line("slow request started cut")
    os.kill(pid, signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting: SIGTERM")
    os.kill(pid, signal.SIGTERM)
    server.wait_for_line(r"SIGTERM again \d+ ms after the first: the master's relay")
    assert not server.has_line("escalated")
    os.kill(pid, signal.SIGQUIT)
    wait_for(lambda: zombie(pid), 10, f"worker {pid} gone")
