"""graceful.aiohttp against real clients and real signals: what only aiohttp has.

Streamed (handler-prepared) responses, a streaming handler ending through the drain
signal, ``run_app``'s teardown after preStop, gunicorn's ``--max-requests`` recycling,
the metrics route and a rolling restart.  The
behaviour every server shares (requests in flight, keep-alive, websockets, health,
preStop, escalation, the accept backlog, websockets that never end; ``on_shutdown`` and
``on_cleanup`` in their place) is in ``test_server_matrix.py``, with a row for each way
the app is served:

* ``run_app``: :func:`graceful.aiohttp.run_app`;
* ``runner``: the pieces — a user's own :class:`graceful.aiohttp.AppRunner`,
  ``web.TCPSite`` and ``coordinator.run()``;
* ``gunicorn``: ``gunicorn -k graceful.gunicorn.AiohttpWorker`` (one worker; the
  master gets the signals, as in a container).

Every server is a subprocess of ``tests/support/aiohttp_apps/app.py`` on a free
loopback port; tests wait on its log lines (the coordinator logs each phase change) or
on socket states, with bounded timeouts — never on the clock.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.servers import (
    ACCEPTING,
    AIOHTTP_APP,
    AIOHTTP_MODES,
    DRAINING,
    POLICY_OPTIONS,
    RawHTTP,
    ServerProcess,
    aiohttp_command,
    aiohttp_ready,
    metric,
)

pytest.importorskip("aiohttp")

#: Output that means something went wrong even if the test's assertions held.
TROUBLE = re.compile(r"Traceback|Task was destroyed|never awaited|Unhandled exception|ERROR")


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    RawHTTP.close_all()
    for server in started:
        server.stop()
    for server in started:
        assert not TROUBLE.search(server.output()), server.output()


@pytest.fixture(params=AIOHTTP_MODES)
def mode(request: pytest.FixtureRequest) -> str:
    if request.param == "gunicorn":
        pytest.importorskip("gunicorn")
    return str(request.param)


def start(servers: list[ServerProcess], mode: str, **options: str) -> ServerProcess:
    args, env = aiohttp_command(mode, options)
    server = ServerProcess(args, env=env)
    servers.append(server)
    return aiohttp_ready(server, mode)


# ------------------------------------------------------------------ responses


def test_streamed_response_after_sigterm_is_nudged(servers: list[ServerProcess], mode: str) -> None:
    """A response the handler prepares itself (``StreamResponse.prepare``) while the
    policy nudges still carries ``Connection: close``, and the connection is closed
    after it."""
    server = start(servers, mode, **POLICY_OPTIONS["accept-until-idle"])
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    streamed = RawHTTP(server.port)
    status, headers, body = streamed.get("/stream?n=3")  # prepared by the handler
    assert status == 200
    assert b"chunk 2" in body
    assert headers["transfer-encoding"] == "chunked"
    assert headers["connection"] == "close"
    assert streamed.closed_by_peer()
    assert server.wait_exit() == 0


@pytest.mark.parametrize("served", ["run_app", "runner", "chain"])
def test_streamed_response_of_a_request_in_flight_at_sigterm_is_nudged(
    servers: list[ServerProcess], served: str
) -> None:
    """A request that began before SIGTERM and prepares its response after it: an
    adopted hot-path request (``run_app``, ``runner``) or one the middleware saw begin
    before nudging did (``chain``: the middleware in the application's chain under
    aiohttp's own runner) still gets ``Connection: close``."""
    server = start(servers, served, **POLICY_OPTIONS["accept-until-idle"])
    streamed = RawHTTP(server.port)
    streamed.send("/stream?n=3&after=shutdown")
    server.wait_for_line(r"stream started")
    server.signal(signal.SIGTERM)
    status, headers, body = streamed.response()
    assert status == 200
    assert b"chunk 2" in body
    assert headers["connection"] == "close"
    assert streamed.closed_by_peer()
    assert server.wait_exit() == 0


# ------------------------------------------------------------------ lifecycle


def test_gunicorn_max_requests_recycling_drains_at_once(servers: list[ServerProcess]) -> None:
    """A worker that reached gunicorn's ``--max-requests`` drains at once (no accepting
    period, not the idle window), finishes its request in flight, and a new worker boots
    and serves; heartbeats go on meanwhile (no WORKER TIMEOUT)."""
    pytest.importorskip("gunicorn")
    server = ServerProcess(
        [
            sys.executable, "-m", "gunicorn", f"{AIOHTTP_APP}:app",
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


def test_sigterm_during_the_teardown_after_prestop_is_not_fatal(
    servers: list[ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet's SIGTERM right after a preStop drain lands after the coordinator ran,
    while run_app tears down (made certain here by a task that takes a second to end
    when cancelled): the process still exits 0, not 143 (seen in CI under load)."""
    monkeypatch.setenv("TEST_LINGER", "1")
    server = start(
        servers, "run_app", **POLICY_OPTIONS["refuse-immediately"], prestop_path="/prestop"
    )
    prestop = RawHTTP(server.port)
    prestop.send("/prestop")
    assert prestop.response()[0] == 200
    server.wait_for_line(r"lingering task cancelled")
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    server.wait_for_line(r"SIGTERM during the teardown: already shut down")


def test_streaming_handler_ends_cleanly_through_the_drain_signal(
    servers: list[ServerProcess],
) -> None:
    """A server-sent-events handler that watches the drain signal ends its stream with a
    last event once draining begins; the connection is closed once idle again."""
    server = start(servers, "run_app", **POLICY_OPTIONS["refuse-immediately"])
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


# ------------------------------------------------------------------- rolling restart


@dataclass(frozen=True)
class _Backend:
    name: str
    port: int
    proc: asyncio.subprocess.Process
    output: asyncio.Task[None]


async def _start_backend(name: str, mode: str, options: dict[str, str]) -> _Backend:
    proc = await asyncio.create_subprocess_exec(
        *aiohttp_command(mode, options)[0],
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
        ("run_app", {**POLICY_OPTIONS["accept-until-idle"], "grace_period": "10"}, False),
        ("stock", {}, True),
    ],
    ids=["graceful:accept-until-idle", "stock-run_app"],
)
def test_rolling_restart(mode: str, options: dict[str, str], fails: bool) -> None:
    """A rolling restart behind an L4 balancer (see :func:`rolling_restart`): no request
    fails with graceful's ``run_app``; with stock ``run_app`` some do."""
    requests, failed, results = asyncio.run(rolling_restart(mode, options))
    print(f"\n{mode}: {failed} of {requests} requests failed: {results}")
    assert requests > 60  # traffic across the restart: a floor, not a throughput claim
    if fails:
        assert failed > 0, results  # stock aiohttp refuses new connections at SIGTERM
    else:
        assert failed == 0, results


# ---------------------------------------------------------------------- metrics


def test_metrics_route_follows_the_drain(servers: list[ServerProcess]) -> None:
    """The metrics route (not counted itself) shows the phase, the requests in flight and
    what arrived after SIGTERM, through accepting and draining."""
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

    server = ServerProcess(
        [sys.executable, "-m", "tests.support.metrics_apps.aiohttp_app", "--port", "0"]
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


# --------------------------------------------------------------------- hot path


def test_hot_path_requests_are_counted_then_adopted(servers: list[ServerProcess]) -> None:
    """graceful's runner serves requests past its middleware while nothing shuts down
    (``graceful.aiohttp._hot``): each is still counted, the health and metrics routes
    are not, a request running at SIGTERM is adopted (in flight until it ends, and
    the drain waits for it), the app still finds its drain signal; after SIGTERM the
    middleware serves and counts."""
    pytest.importorskip("prometheus_client")
    server = ServerProcess(
        [sys.executable, "-m", "tests.support.metrics_apps.aiohttp_app", "--port", "0"]
    )
    servers.append(server)
    server.port = int(server.wait_for_line(r"Running on http://127\.0\.0\.1:(\d+)")[1])

    client = RawHTTP(server.port)
    for _ in range(3):
        assert client.get("/")[0] == 200
    assert client.get("/readyz")[0] == 200
    assert client.get("/livez")[0] == 200
    assert (
        metric(server.port, "graceful_requests_total") == 3
    )  # not the health routes, not /metrics
    assert metric(server.port, "graceful_requests_in_flight") == 0
    slow = RawHTTP(server.port)
    slow.send("/slow?s=4")  # still running once SIGTERM is handled, even under load
    server.wait_for_line(r"slow request started")
    assert metric(server.port, "graceful_requests_in_flight") == 1  # counted where it runs
    assert metric(server.port, "graceful_requests_total") == 4
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    assert metric(server.port, "graceful_requests_in_flight") == 1  # adopted
    assert client.get("/")[0] == 200  # through the middleware now
    assert metric(server.port, "graceful_requests_total") == 5
    assert metric(server.port, "graceful_requests_after_shutdown_total") == 1
    assert slow.response()[:1] == (200,)
    assert server.wait_exit() == 0
    assert "slow request started" in server.output()


def test_another_application_on_the_loop_is_not_counted(servers: list[ServerProcess]) -> None:
    """The hot path finds its requests among the loop's tasks: a request of another
    aiohttp application on the same loop (a stock ``AppRunner`` beside graceful's) is
    not counted, not waited for and not cut."""
    command, _ = aiohttp_command("runner", {"policy": "refuse-immediately"})
    server = ServerProcess([*command, "--stock-beside"])
    servers.append(server)
    aiohttp_ready(server, "runner")
    beside = int(server.wait_for_line(r"stock beside on http://127\.0\.0\.1:(\d+)")[1])
    other = RawHTTP(beside)
    other.send("/slow?s=30")
    server.wait_for_line(r"slow request started")
    mine = RawHTTP(server.port)
    mine.send("/slow?s=3")
    server.wait_for_line(r"slow request started \(3 s\)")
    server.signal(signal.SIGTERM)
    # Only graceful's request is in flight, and the drain ends with it.
    server.wait_for_line(r"serving -> accepting: SIGTERM \(1 connection, 1 request;")
    assert mine.response()[0] == 200
    server.wait_for_line(r"draining -> stopping: drained")
    assert server.wait_exit() == 0
