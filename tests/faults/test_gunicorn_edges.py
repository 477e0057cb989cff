"""The gunicorn workers at production's edges: never worse than the stock worker.

Each case is one place where graceful's worker once did worse than gunicorn's own
(issue 28): a real gunicorn master, raw-socket clients, real signals.
``benchmarks/gunicorn_edges.py`` runs the same scenarios under the stock worker beside
graceful's and prints the table in ``docs/reliability.md``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.test_wsgi_workers import answered_and_closed
from tests.support.harness import (
    ACCEPTING,
    DRAINING,
    GUNICORN_LISTENING,
    WSGI_APP,
    Client,
    Harness,
    Outcome,
    collect,
    outcomes,
    state,
    summarize,
    wait_for,
    worker_pids,
)
from tests.support.servers import ServerProcess

pytest.importorskip("gunicorn")

AIOHTTP_APP = "tests.support.aiohttp_apps.app:app"
ASGI_APP = "tests.support.fault_apps.basic:app"
FLASK = "tests.support.wsgi_apps.flask_app:app"
DJANGO = "tests.support.wsgi_apps.django_app:application"
THREADS = ["--threads", "4"]
SLOW_STARTED = r"started|slow request started"


def in_flight(server: ServerProcess, path: str, rid: str) -> Client:
    """A request ``rid`` to ``path``, once the app logged that it started."""
    client = Client.connect(server.port)
    client.request(path, rid)
    server.wait_for_line(rf"started {rid}\b")
    return client


def send(port: int, path: str, prefix: str, n: int) -> list[Client]:
    """``n`` fresh connections, each sending one request to ``path`` unless refused."""
    clients = [Client.connect(port) for _ in range(n)]
    for i, client in enumerate(clients):
        if client.end is None:
            client.request(path, f"{prefix}{i}")
    return clients


# ------------------------------------------------------------------ heartbeats


@pytest.mark.parametrize("app", [FLASK, DJANGO], ids=["flask", "django"])
def test_sync_worker_gives_a_request_after_an_idle_wait_the_whole_timeout(
    harness: Harness, record: Callable[[str], None], app: str
) -> None:
    """``--timeout 4``: the sync worker waits up to 2 s for a connection between two
    heartbeats.  A 3.5 s request that arrives 1.8 s into that wait must get the whole
    of ``--timeout`` (gunicorn's own sync worker heartbeats right before it accepts), not
    be killed with WORKER TIMEOUT at 2.2 s."""
    server = harness.gunicorn(
        "--timeout", "4", app=app, worker_class="SyncWorker"
    )  # fmt: skip
    first = Client.connect(server.port)
    first.request("/", "first")
    collect([first], 10, until=answered_and_closed)
    time.sleep(1.8)  # the scenario: an idle wait, shorter than the worker's 2 s select
    slow = Client.connect(server.port)
    slow.request("/slow?s=3.5", "slow")
    collect([slow], 15, until=answered_and_closed)
    results = outcomes([first, slow])
    record(f"{summarize(results)}; WORKER TIMEOUT: {server.has_line('WORKER TIMEOUT')}")
    assert [(r.kind, r.status) for r in results] == [("ok", 200), ("ok", 200)]
    assert not server.has_line("WORKER TIMEOUT"), server.output()


# ------------------------------------------------------------------ late relays


@pytest.mark.parametrize(
    "worker", ["UvicornWorker", "UvicornH11Worker", "HypercornWorker", "AiohttpWorker"]
)
def test_a_late_relay_of_sigterm_is_not_an_escalation(
    harness: Harness, record: Callable[[str], None], worker: str
) -> None:
    """The worker gets SIGTERM from a process group's signal, and the master relays it
    half a second later (a loaded machine): the request in flight is answered 200, as
    under gunicorn's own workers, and nothing escalates."""
    pytest.importorskip(
        {"HypercornWorker": "hypercorn", "AiohttpWorker": "aiohttp"}.get(worker, "uvicorn")
    )
    app = AIOHTTP_APP if worker == "AiohttpWorker" else "tests.support.fault_apps.basic:app"
    server = harness.gunicorn(
        "--graceful-timeout", "10", app=app, worker_class=worker, env={"GRACEFUL_IDLE": "0.5"},
        wait=False,
    )  # fmt: skip
    server.port = int(server.wait_for_line(GUNICORN_LISTENING, timeout_s=20)[1])
    server.wait_for_line(r"policy .*; kill deadline", timeout_s=20)
    (pid,) = worker_pids(server)
    slow = Client.connect(server.port)
    slow.request("/slow?s=2", "inflight")
    server.wait_for_line(SLOW_STARTED)
    os.kill(pid, signal.SIGTERM)  # the process group's copy
    server.wait_for_line(ACCEPTING)
    time.sleep(0.5)  # the scenario: the master's relay comes late
    server.proc.send_signal(signal.SIGTERM)  # the master relays it to the worker
    collect([slow], 15, until=answered_and_closed)
    results = outcomes([slow])
    code = server.wait_exit(20)
    record(f"{summarize(results)}; escalated: {server.has_line('escalated')}; exit {code}")
    assert [(r.kind, r.status) for r in results] == [("ok", 200)], server.output()
    assert not server.has_line("escalated"), server.output()
    assert server.has_line(r"SIGTERM again \d+ ms after the first: relayed"), server.output()
    assert code == 0


# ------------------------------------------------------------------ busy is not idle


def test_a_busy_sync_worker_is_not_idle(harness: Harness, record: Callable[[str], None]) -> None:
    """The only worker is inside a 3 s request at SIGTERM while a balancer keeps sending
    new connections for 4 s (one every 50 ms): they wait in the listener's accept
    queue, which the kernel reports — the idle window (1 s) must not run out while the
    worker cannot accept (it did, and connections after the backlog was served were
    refused when the traffic came in bursts)."""
    server = harness.gunicorn(
        "--graceful-timeout", "20", app=FLASK, worker_class="SyncWorker",
        env={"GRACEFUL_IDLE": "1"},
    )  # fmt: skip
    slow = in_flight(server, "/slow?s=3", "busy")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    clients = [slow]
    began = time.monotonic()
    for i in range(80):  # bounded: 80 connections over about 4 s
        client = Client.connect(server.port)
        if client.end is None and client.sock is not None:
            client.request("/", f"c{i}")
            client.sock.shutdown(socket.SHUT_WR)  # a one-request client, done sending
        clients.append(client)
        due = began + (i + 1) * 0.05
        if due > time.monotonic():
            time.sleep(due - time.monotonic())  # the balancer's pace
    # Traffic arrived the whole time (queued while the worker was busy): accepting
    # has not ended.
    still_accepting = not server.has_line(DRAINING)
    collect(clients, 20, until=answered_and_closed)
    results = outcomes(clients)
    code = server.wait_exit(30)
    record(f"{summarize(results)}; accepting through the window: {still_accepting}; exit {code}")
    assert still_accepting, server.output()
    assert [r for r in results if r.kind != "ok" or r.status != 200] == [], summarize(results)
    assert code == 0


# ------------------------------------------------------------------ after the sweep


@pytest.mark.parametrize(
    "env",
    [
        {"GRACEFUL_POLICY": "serve-until-killed", "GRACEFUL_MAX_WAIT": "0.3"},
        {"GRACEFUL_IDLE": "0.3", "GRACEFUL_NUDGE_CLIENTS": "false"},
    ],
    ids=["serve-until-killed", "no-nudge"],
)
def test_thread_worker_leaves_nothing_queued_after_its_backlog_sweep(
    harness: Harness, record: Callable[[str], None], env: dict[str, str]
) -> None:
    """A 2 s request keeps the ThreadWorker in gunicorn's stop while new connections
    keep coming (one every 20 ms for 2.5 s): once the worker swept its backlog, no
    connection may wait on a listener it no longer serves — each is served or refused
    (safe to retry), none reset after its request was sent."""
    server = harness.gunicorn(
        "--graceful-timeout", "10", *THREADS, app=DJANGO, worker_class="ThreadWorker",
        env=env,
    )  # fmt: skip
    slow = in_flight(server, "/slow?s=2", "inflight")
    server.signal(signal.SIGTERM)
    clients = [slow]
    began = time.monotonic()
    for i in range(125):  # bounded: 125 connections over about 2.5 s
        client = Client.connect(server.port)
        if client.end is None and client.sock is not None:
            client.request("/", f"c{i}")
            client.sock.shutdown(socket.SHUT_WR)
        clients.append(client)
        due = began + (i + 1) * 0.02
        if due > time.monotonic():
            time.sleep(due - time.monotonic())  # the balancer's pace
    collect(clients, 20, until=answered_and_closed)
    results = outcomes(clients)
    code = server.wait_exit(30)
    record(f"{summarize(results)}; exit {code}")
    assert [r for r in results if r.kind == "lost"] == [], summarize(results)
    assert [r.status for r in results if r.kind == "ok"] == [200] * sum(
        r.kind == "ok" for r in results
    )
    assert code == 0


# ------------------------------------------------------------------ short timeouts


@pytest.mark.parametrize(("timeout", "seconds"), [("1", "0.8"), ("2", "1.6")])
@pytest.mark.parametrize("worker", ["SyncWorker", "ThreadWorker"])
def test_a_short_graceful_timeout_serves_what_stock_completes(
    harness: Harness, record: Callable[[str], None], worker: str, timeout: str, seconds: str
) -> None:
    """A request that ends well within ``--graceful-timeout`` of SIGTERM (0.8 s of 1 s,
    1.6 s of 2 s) is answered, as stock gunicorn answers it: the margins scale with the
    timeout."""
    server = harness.gunicorn(
        "--graceful-timeout", timeout, *(THREADS if worker == "ThreadWorker" else []),
        app=FLASK if worker == "SyncWorker" else DJANGO, worker_class=worker,
    )  # fmt: skip
    slow = in_flight(server, f"/slow?s={seconds}", "inflight")
    server.signal(signal.SIGTERM)
    collect([slow], 10, until=answered_and_closed)
    results = outcomes([slow])
    code = server.wait_exit(20)
    record(f"{summarize(results)}; exit {code}")
    assert [(r.kind, r.status) for r in results] == [("ok", 200)], server.output()


@pytest.mark.parametrize("worker", ["SyncWorker", "ThreadWorker"])
def test_a_request_the_exit_cuts_is_answered_503(
    harness: Harness, record: Callable[[str], None], worker: str
) -> None:
    """A request that cannot finish before the master's SIGKILL (5 s under
    ``--graceful-timeout 2``) is answered 503 with ``Connection: close`` at the exit —
    never a bare EOF — and the master kills no worker."""
    server = harness.gunicorn(
        "--graceful-timeout", "2", *(THREADS if worker == "ThreadWorker" else []),
        app=WSGI_APP, worker_class=worker,
    )  # fmt: skip
    slow = in_flight(server, "/slow?s=5", "inflight")
    server.signal(signal.SIGTERM)
    collect([slow], 10, until=answered_and_closed)
    results = outcomes([slow])
    code = server.wait_exit(20)
    killed = server.has_line(r"was sent SIGKILL|signal 9")
    record(f"{summarize(results)}; SIGKILL: {killed}; exit {code}")
    assert [(r.kind, r.status) for r in results] == [("ok", 503)], server.output()
    response = slow.responses[0]
    assert response.body == b"server shutting down\n"  # as every server's cut says it
    assert (response.headers["connection"], response.headers["retry-after"]) == ("close", "0")
    assert not killed, server.output()


@pytest.mark.parametrize("worker", ["SyncWorker", "ThreadWorker"])
def test_the_exit_never_answers_503_inside_a_response_being_written(
    harness: Harness, record: Callable[[str], None], worker: str
) -> None:
    """gunicorn sets ``headers_sent`` only once the head was written: a response whose
    head is still being written (4 MiB of headers to a client that reads 4 KiB every
    2 ms, past the exit of ``--graceful-timeout 1``) is gunicorn's, and the exit's cut
    must not put a 503 inside it (it once did, under load, between a 200's head and its
    body).  What the client gets is the start of the 200, then the close — what stock
    gunicorn's SIGKILL gives it."""
    server = harness.gunicorn(
        "--graceful-timeout", "1", *(THREADS if worker == "ThreadWorker" else []),
        app=WSGI_APP, worker_class=worker,
    )  # fmt: skip
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", server.port))
    received = bytearray()
    try:
        sock.sendall(b"GET /header?kb=4096&id=head HTTP/1.1\r\nHost: t\r\n\r\n")
        server.wait_for_line(r"started head\b")
        server.signal(signal.SIGTERM)
        began = time.monotonic()
        while time.monotonic() - began < 10:  # bounded: the exit is due within 1 s
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
            time.sleep(0.002)  # the scenario: a slow reader
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    code = server.wait_exit(20)
    cut_line = server.has_line(r"still alive at the last moment before SIGKILL")
    record(f"{len(received)} bytes of the 200, then the close; exit {code}")
    assert received.startswith(b"HTTP/1.1 200 OK\r\n"), bytes(received[:200])
    assert len(received) < 4096 * 1024, "the exit came after the whole head"
    assert b"503" not in received, server.output()
    assert b"shutting down" not in received, server.output()
    assert cut_line, server.output()  # the exit did come while the head was written


# ------------------------------------------------------------------ reloads


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTTOU], ids=["HUP", "TTOU"])
@pytest.mark.parametrize("worker", ["UvicornWorker", "SyncWorker", "ThreadWorker"])
def test_a_reload_is_not_a_shutdown_for_readiness(
    harness: Harness, record: Callable[[str], None], worker: str, sig: signal.Signals
) -> None:
    """``HUP`` (a reload) or ``TTOU`` (one worker fewer) replaces workers while the master
    keeps its listeners and the pod keeps serving: readiness, probed every 50 ms, never
    answers 503 (a probe with ``failureThreshold: 1`` would take the pod out of rotation
    on every routine reload).  Once the master itself stops, readiness fails."""
    env = {"GRACEFUL_IDLE": "0.5"}
    server = harness.gunicorn(
        "--graceful-timeout", "10", *(THREADS if worker == "ThreadWorker" else []),
        app={"SyncWorker": FLASK, "ThreadWorker": DJANGO}.get(worker, ASGI_APP),
        worker_class=worker, workers=2, env=env,
    )  # fmt: skip
    old = set(worker_pids(server))
    server.signal(sig)
    statuses: list[int | str] = []
    began = time.monotonic()
    while time.monotonic() - began < 3.0:  # bounded: 3 s of probes, one every 50 ms
        probe = Client.connect(server.port, timeout_s=2)
        if probe.end is None and probe.sock is not None:
            probe.request("/readyz", f"p{len(statuses)}")
            probe.sock.shutdown(socket.SHUT_WR)
            collect([probe], 3)
            statuses.append(probe.responses[0].status if probe.responses else str(probe.end))
            probe.close()
        else:
            statuses.append(str(probe.end))
        time.sleep(0.05)  # the prober's period
    replaced = server.has_line(r"shutting down|-> accepting")
    failed = [s for s in statuses if s != 200]
    server.signal(signal.SIGTERM)
    record(
        f"{len(statuses)} probes during the {sig.name}: {len(failed)} not 200; "
        f"old workers {sorted(old)} shut down: {replaced}"
    )
    assert replaced, server.output()
    assert failed == [], (failed, server.output())


# ------------------------------------------------------------------ threads


def test_wsgi_worker_with_threads_runs_graceful_thread_worker(
    harness: Harness, record: Callable[[str], None]
) -> None:
    """``-k graceful.gunicorn.WSGIWorker --threads 4``: gunicorn leaves the name alone
    (a ``…SyncWorker`` it replaces by its stock gthread, silently) and the worker is
    graceful's ThreadWorker — its policy line, SIGTERM starts accepting."""
    server = harness.gunicorn(
        "--graceful-timeout", "10", *THREADS, app=WSGI_APP, worker_class="WSGIWorker",
        env={"GRACEFUL_IDLE": "0.3"},
    )  # fmt: skip
    slow = in_flight(server, "/slow?s=1", "inflight")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    collect([slow], 10, until=answered_and_closed)
    results = outcomes([slow])
    code = server.wait_exit(20)
    record(f"{summarize(results)}; exit {code}")
    assert [(r.kind, r.status) for r in results] == [("ok", 200)]
    assert code == 0


@pytest.mark.parametrize("how", ["WSGIWorker", "class in a config file"])
def test_a_bad_setting_with_threads_is_refused(
    harness: Harness, record: Callable[[str], None], tmp_path: Path, how: str
) -> None:
    """``GRACEFUL_POLICY=bogus`` with ``--threads 4`` stops gunicorn in the master with one
    line, whatever the spelling that reaches graceful's code; ``SyncWorker`` given as a
    class with ``--threads 4`` is refused with the fix."""
    if how == "WSGIWorker":
        server = harness.gunicorn(
            *THREADS, app=WSGI_APP, worker_class="WSGIWorker",
            env={"GRACEFUL_POLICY": "bogus"}, wait=False,
        )  # fmt: skip
        wanted = "GRACEFUL_POLICY"
    else:
        config = tmp_path / "gunicorn_conf.py"
        config.write_text(
            "from graceful.gunicorn import SyncWorker\nworker_class = SyncWorker\nthreads = 4\n"
        )
        server = harness.start(
            [sys.executable, "-m", "gunicorn", WSGI_APP, "-c", str(config),
             "-b", "127.0.0.1:0"],
        )  # fmt: skip
        wanted = "use -k graceful.gunicorn.ThreadWorker"
    code = server.wait_exit(20)
    lines = [line for line in server.output().splitlines() if wanted in line]
    record(f"exit {code}: {lines[0].strip() if lines else '-'}")
    assert code != 0
    assert lines, server.output()
    assert not server.has_line(r"Booting worker")


# ------------------------------------------------------------------ the kill margin


@pytest.mark.parametrize("worker", ["UvicornWorker", "UvicornH11Worker", "HypercornWorker"])
def test_a_worker_is_out_by_the_kill_margin_whatever_the_app_does(
    harness: Harness, record: Callable[[str], None], worker: str
) -> None:
    """A handler that swallows every cancellation, ``--graceful-timeout 4`` (kill margin
    0.4 s): the worker is gone by 3.6 s after the master's SIGTERM, so the master never
    SIGKILLs it (it did, 0.03 s after the worker's late exit)."""
    pytest.importorskip("hypercorn" if worker == "HypercornWorker" else "uvicorn")
    server = harness.gunicorn(
        "--graceful-timeout", "4", app="tests.support.fault_apps.basic:app", worker_class=worker,
        env={"GRACEFUL_POLICY": "refuse-immediately"}, wait=False,
    )  # fmt: skip
    server.port = int(server.wait_for_line(GUNICORN_LISTENING, timeout_s=20)[1])
    server.wait_for_line(r"policy .*; kill deadline", timeout_s=20)
    (pid,) = worker_pids(server)
    stubborn = in_flight(server, "/stubborn", "stubborn")
    began = time.monotonic()
    server.signal(signal.SIGTERM)
    wait_for(lambda: state(pid) in (None, "Z"), 10, f"worker {pid} exited")  # or reaped
    took = time.monotonic() - began
    collect([stubborn], 5)
    code = server.wait_exit(20)
    killed = server.has_line(r"was sent SIGKILL")
    answer = stubborn.responses[0].status if stubborn.responses else stubborn.end
    record(
        f"worker out {took:.2f} s after SIGTERM (grace 4 s, margin 0.4 s); the stubborn "
        f"request: {answer}; SIGKILL: {killed}"
    )
    # The promise is the master's SIGKILL never comes (asserted below); ``took`` is seen
    # by polling the worker's state, late by a tick on a loaded machine (CI saw 3.63 s
    # for an exit at 3.6 s), so it is only checked against the deadline itself.
    assert took < 4.0, server.output()
    if worker != "UvicornH11Worker":
        # Cut before its response started: the hot path answers it.  Under the
        # middleware (h11) a handler that swallows its cancellation keeps the 503 from
        # being sent (an EOF at the exit, as stock's SIGKILL gives).
        assert answer == 503, server.output()
    assert not killed, server.output()
    assert code == 0


# ------------------------------------------------------------------ a busy sync worker's stop


def test_a_busy_sync_worker_serves_or_refuses_what_queued_behind_it(
    harness: Harness, record: Callable[[str], None]
) -> None:
    """The only sync worker is inside a 2 s request when draining begins
    (refuse-immediately), three 1 s requests queued behind it and five more arriving
    after SIGTERM: the stop takes the queue and closes the listener at once, even
    though the worker's one thread is busy — the late ones are refused (safe to retry)
    instead of queueing behind it; the taken ones are served while one as long as the
    longest seen still fits before the exit, and answered 503 after. Nothing accepted
    is cut or reset."""
    server = harness.gunicorn(
        "--graceful-timeout", "6", app=FLASK, worker_class="SyncWorker",
        env={"GRACEFUL_POLICY": "refuse-immediately"},
    )  # fmt: skip
    busy = in_flight(server, "/slow?s=2", "busy")
    queued = send(server.port, "/slow?s=1", "q", 3)
    server.signal(signal.SIGTERM)
    server.wait_for_line(DRAINING)
    late = send(server.port, "/slow?s=1", "late", 5)
    clients = [busy, *queued, *late]
    collect(clients, 20, until=answered_and_closed)
    results = outcomes(clients)
    code = server.wait_exit(20)
    record(f"{summarize(results)}; exit {code}")
    assert [r for r in results if r.kind == "lost"] == [], (summarize(results), server.output())
    assert outcomes([busy]) == [Outcome("busy", "ok", 200)]
    assert all(r.kind == "refused" for r in outcomes(late)), summarize(outcomes(late))
    assert {r.status for r in outcomes(queued)} <= {200, 503}, server.output()


def test_connections_waiting_for_a_thread_at_the_exit_are_answered_503(
    harness: Harness, record: Callable[[str], None]
) -> None:
    """ThreadWorker with one thread, inside a request that outlives ``--graceful-timeout
    4``, three connections accepted behind it waiting for the thread: at the exit each
    gets a 503 (its request was not served, it may retry) — not a reset."""
    server = harness.gunicorn(
        "--graceful-timeout", "4", "--threads", "1", app=WSGI_APP,
        worker_class="ThreadWorker", env={"GRACEFUL_POLICY": "refuse-immediately"},
    )  # fmt: skip
    busy = in_flight(server, "/slow?s=10", "busy")
    waiting = send(server.port, "/", "w", 3)
    server.signal(signal.SIGTERM)
    clients = [busy, *waiting]
    collect(clients, 15, until=answered_and_closed)
    results = outcomes(clients)
    code = server.wait_exit(20)
    record(f"{summarize(results)}; exit {code}")
    assert [r for r in results if r.kind == "lost"] == [], (summarize(results), server.output())
    assert not server.has_line(r"was sent SIGKILL"), server.output()


# ------------------------------------------------------------------ the drain budget


def _fast_traffic(port: int, until: float, seen: list[str]) -> None:
    """Fresh-connection requests every 50 ms until ``until`` (bounded: 400 at most),
    each outcome appended to ``seen``: ``200``, ``refused`` or what was lost."""
    for i in range(400):
        if time.monotonic() >= until:
            return
        client = Client.connect(port, timeout_s=5)
        if client.end is None and client.sock is not None:
            client.request("/", f"f{i}")
            collect([client], 10)  # no half-close: uvicorn takes it for a disconnect
            seen.append(str(client.responses[0].status) if client.responses else str(client.end))
            client.close()
        else:
            seen.append(str(client.end))
        time.sleep(0.05)  # the traffic's pace


@pytest.mark.parametrize("worker", ["ThreadWorker", "UvicornWorker"])
def test_accepting_ends_while_what_is_accepted_can_still_finish(
    harness: Harness, record: Callable[[str], None], worker: str
) -> None:
    """Fast traffic through SIGTERM and a 3 s request at +1, +3, +5 and +7 s,
    ``--graceful-timeout 10``: a 3 s request is either answered or refused (safe to
    retry), never accepted too late and cut as the worker leaves — "accepting at most
    X s" holds, and a request in flight shortens it."""
    threads = THREADS if worker == "ThreadWorker" else []
    app = DJANGO if worker == "ThreadWorker" else ASGI_APP
    server = harness.gunicorn(
        "--graceful-timeout", "10", *threads, app=app, worker_class=worker,
        env={"GRACEFUL_POLICY": "serve-until-killed"}, wait=False,
    )  # fmt: skip
    server.port = int(server.wait_for_line(GUNICORN_LISTENING, timeout_s=20)[1])
    server.wait_for_line(r"policy .*; kill deadline", timeout_s=20)
    fast: list[str] = []
    began = time.monotonic()
    traffic = threading.Thread(
        target=_fast_traffic, args=(server.port, began + 9.0, fast), daemon=True
    )
    traffic.start()
    time.sleep(1.0)  # the scenario: traffic measured before the SIGTERM
    signalled = time.monotonic()
    server.signal(signal.SIGTERM)
    slow: list[Client] = []
    for at in (1, 3, 5, 7):
        time.sleep(max(0.0, signalled + at - time.monotonic()))  # the scenario's times
        client = Client.connect(server.port)
        if client.end is None:
            client.request("/slow?s=3", f"s{at}")
        slow.append(client)
    collect(slow, 15, until=answered_and_closed)
    traffic.join(15)
    results = outcomes(slow)
    code = server.wait_exit(20)
    record(f"3 s requests: {summarize(results)}; fast: {dict(Counter(fast))}; exit {code}")
    assert all(r.kind == "refused" or r.status == 200 for r in results), summarize(results)
    # One fast connection may be reset: a handshake the kernel completed between the
    # worker's last accept and its close of the listener.  gunicorn's listener is the
    # master's, inherited, so it is not sealed (docs/reliability.md, the seal's rules:
    # the window of two system calls); the traffic fell in it once in ~16 suite runs.
    assert set(fast) <= {"200", "refused", "reset"}, Counter(fast)
    assert Counter(fast)["reset"] <= 1, Counter(fast)
    assert code == 0
