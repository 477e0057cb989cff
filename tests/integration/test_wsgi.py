"""gunicorn -k graceful.gunicorn.SyncWorker with real Flask and Django apps: a real
master, real workers, real signals, raw sockets."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from .servers import RawHTTP, ServerProcess

pytest.importorskip("gunicorn")
pytest.importorskip("flask")

FLASK = "tests.integration.wsgi_apps.flask_app:app"
DJANGO = "tests.integration.wsgi_apps.django_app:application"
LISTENING = r"Listening at: http://127\.0\.0\.1:(\d+)"
BOOTED = r"policy .*; kill deadline"


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    yield servers
    RawHTTP.close_all()
    for server in servers:
        server.stop()


def start(
    started: list[ServerProcess],
    *options: str,
    app: str = FLASK,
    workers: int = 1,
    worker: str = "graceful.gunicorn.SyncWorker",
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> ServerProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    server = ServerProcess(
        [sys.executable, "-m", "gunicorn", app, "-k", worker, "-w", str(workers),
         "-b", "127.0.0.1:0", "--graceful-timeout", "10", *options],
        env={**environment, **(env or {})},
    )  # fmt: skip
    started.append(server)
    if wait:
        server.port = int(server.wait_for_line(LISTENING).group(1))
        if "graceful" in worker:
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
    started: list[ServerProcess], app: str
) -> None:
    server = start(started, app=app, env={"GRACEFUL_IDLE": "1"})
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
    assert server.has_line(r"stopping -> stopped")


def test_probes_do_not_count_as_traffic_and_readiness_fails_at_sigterm(
    started: list[ServerProcess],
) -> None:
    server = start(started, env={"GRACEFUL_IDLE": "1"})
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


def test_drain_signal_is_in_the_environ(started: list[ServerProcess]) -> None:
    server = start(started)
    assert get(server.port, "/draining")[2] == b"draining=False\n"


def test_accept_backlog_queued_while_stopped_is_served(started: list[ServerProcess]) -> None:
    """SIGSTOP the worker, queue 100 connections, SIGTERM, SIGCONT: 100 answers."""
    server = start(started, env={"GRACEFUL_POLICY": "refuse-immediately"})
    pid = worker_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        clients = [RawHTTP(server.port) for _ in range(100)]
        for i, client in enumerate(clients):
            client.send(f"/?id={i}")
        server.signal(signal.SIGTERM)
        server.wait_for_line(r"Handling signal: term")
    finally:
        os.kill(pid, signal.SIGCONT)
    answers = [answer(client) for client in clients]
    assert [status for status, _, _ in answers] == [200] * 100
    assert [body for _, _, body in answers] == [f"hello from {i}\n".encode() for i in range(100)]
    assert server.wait_exit() == 0


def test_worker_exits_before_the_kill_deadline_whatever_the_app_does(
    started: list[ServerProcess],
) -> None:
    """A request longer than --graceful-timeout: the worker ends itself before the
    master's SIGKILL (kill margin 1 s), and says so."""
    server = start(started, "--graceful-timeout", "3", env={"GRACEFUL_IDLE": "0.2"})
    client = RawHTTP(server.port)
    client.send("/slow?s=30&id=stuck")
    server.wait_for_line("slow request started stuck")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
    assert server.has_line(r"a request still runs: exiting now")
    assert not server.has_line(r"was sent SIGKILL|Worker .* was sent code 9")


def test_sigquit_stops_at_once(started: list[ServerProcess]) -> None:
    server = start(started)
    client = RawHTTP(server.port)
    client.send("/slow?s=30&id=q")
    server.wait_for_line("slow request started q")
    server.signal(signal.SIGQUIT)
    assert server.wait_exit(10) == 0
    assert not server.has_line(r"serving -> accepting")


def test_bad_variable_stops_gunicorn_in_the_master(started: list[ServerProcess]) -> None:
    server = start(started, env={"GRACEFUL_IDLE": "soon"}, wait=False)
    assert server.wait_exit() != 0
    assert server.has_line(r"GRACEFUL_IDLE")
    assert not server.has_line(r"Booting worker")


def test_kubernetes_is_refused_with_the_reason(started: list[ServerProcess]) -> None:
    server = start(started, env={"GRACEFUL_KUBERNETES": "1"}, wait=False)
    assert server.wait_exit() != 0
    assert server.has_line(r"GRACEFUL_KUBERNETES: not supported by graceful.gunicorn.SyncWorker")


def test_stock_sync_worker_refuses_the_late_connection(started: list[ServerProcess]) -> None:
    """The loss the graceful worker prevents: stock ``-k sync`` stops accepting at
    SIGTERM, so the connection a load balancer still sends is refused or reset."""
    server = start(started, worker="sync")
    slow = RawHTTP(server.port)
    slow.send("/slow?s=1.5&id=long")
    server.wait_for_line("slow request started long")
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"Handling signal: term")
    try:
        late = RawHTTP(server.port)
        late.send("/?id=late")
        status = answer(late)[0]
    except OSError:
        status = None
    assert status is None
    assert answer(slow)[0] == 200
