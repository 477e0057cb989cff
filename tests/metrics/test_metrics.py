"""graceful.metrics scraped from real servers while they drain.

* one process (``graceful.uvicorn.Server``): the collector reads the coordinator at
  scrape time — the phase, the held request, the connections accepted after SIGTERM;
* gunicorn with two workers and ``PROMETHEUS_MULTIPROC_DIR``: each worker writes its
  metrics, any worker's endpoint shows the sum, dead workers' live gauges are dropped.

Tests wait on log lines and poll scrapes with deadlines, never on the clock.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.servers import ACCEPTING, DRAINING, STOPPED, RawHTTP, ServerProcess

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

APP = "tests.support.metrics_apps.app"

Metrics = dict[str, float]


def parse(body: bytes) -> Metrics:
    """``{"graceful_open_connections": 1.0, "graceful_phase[draining]": 1.0, …}``"""
    found: Metrics = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            phase = sample.labels.get("phase")
            found[sample.name + (f"[{phase}]" if phase else "")] = sample.value
    return found


def scrape(client: RawHTTP) -> Metrics:
    status, _, body = client.get("/metrics")
    assert status == 200, body
    return parse(body)


def scrape_new(port: int) -> tuple[Metrics, str]:
    """A scrape over a new connection (and which worker answered)."""
    client = RawHTTP(port)
    status, headers, body = client.get("/metrics")
    client.close()
    assert status == 200, body
    return parse(body), headers["x-worker-pid"]


def poll(port: int, condition: Callable[[Metrics], bool], timeout_s: float = 10.0) -> Metrics:
    deadline = time.monotonic() + timeout_s
    in_flight: collections.Counter[tuple[str, float]] = collections.Counter()
    while True:
        metrics, pid = scrape_new(port)
        if condition(metrics):
            return metrics
        in_flight[pid, metrics.get("graceful_requests_in_flight", -1.0)] += 1
        assert time.monotonic() < deadline, f"(worker, in flight): scrapes {in_flight}; {metrics}"


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    RawHTTP.close_all()


# ------------------------------------------------------------------ one process


def test_scrapes_follow_the_drain_in_one_process() -> None:
    server = ServerProcess([sys.executable, "-m", APP, "--port", "0", "--idle", "1"])
    try:
        port = int(server.wait_for_line(r"running on http://127\.0\.0\.1:(\d+)").group(1))
        scraper = RawHTTP(port)  # keep-alive: scraping adds no connection
        m = scrape(scraper)
        assert m["graceful_phase[serving]"] == 1
        assert m["graceful_requests_in_flight"] == 1  # the scrape itself
        assert m["graceful_kill_deadline_seconds"] == float("inf")

        slow = RawHTTP(port)
        slow.send("/slow?s=60")  # held across the drain, cut at the end
        server.wait_for_line(r"slow request started")
        server.signal(signal.SIGTERM)
        server.wait_for_line(ACCEPTING)
        m = scrape(scraper)
        assert m["graceful_phase[accepting]"] == 1
        assert m["graceful_phase[serving]"] == 0
        assert m["graceful_requests_in_flight"] == 2
        assert m["graceful_open_connections"] == 2
        assert 0 < m["graceful_kill_deadline_seconds"] <= 20
        assert m["graceful_connections_after_shutdown_total"] == 0
        assert m["graceful_requests_after_shutdown_total"] == 1

        late = [RawHTTP(port) for _ in range(3)]  # accepted after SIGTERM
        assert [client.get("/")[0] for client in late] == [200] * 3
        spare = [RawHTTP(port) for _ in range(3)]  # to scrape while draining
        deadline = time.monotonic() + 10
        while (m := scrape(scraper))["graceful_connections_after_shutdown_total"] < 6:
            assert time.monotonic() < deadline, m  # the spares are accepted soon
        assert m["graceful_connections_after_shutdown_total"] == 6
        assert m["graceful_requests_after_shutdown_total"] >= 5  # 3 + the scrapes
        assert m["graceful_open_connections"] == 8
        assert m["graceful_since_last_connection_seconds"] < 5

        server.wait_for_line(DRAINING)  # a second without new connections
        m = scrape(scraper)  # answered with Connection: close, the scraper's last
        assert m["graceful_phase[draining]"] == 1
        assert m["graceful_phase[accepting]"] == 0
        assert m["graceful_requests_in_flight"] == 2
        assert 0 < m["graceful_phase_time_left_seconds"] < 20
        for client in late:
            client.close()
        deadline = time.monotonic() + 10
        while True:  # the server sees the three closes (and the scraper's) soon
            m = scrape(spare.pop())
            if m["graceful_connections_closed_draining_total"] >= 4:
                break
            assert spare, m
            assert time.monotonic() < deadline, m
        assert m["graceful_open_connections"] <= 4  # slow and spares

        server.signal(signal.SIGTERM)  # escalate: the slow request is cut
        assert slow.response()[0] == 503
        server.wait_for_line(STOPPED)
        assert server.wait_exit() == 0
    finally:
        server.stop()


# ----------------------------------------------------------------- multiprocess

GUNICORN_CONFIG = """\
import graceful.metrics

def child_exit(server, worker):
    graceful.metrics.mark_process_dead(worker.pid)
"""


def test_gunicorn_workers_share_one_view(tmp_path: Path) -> None:
    pytest.importorskip("gunicorn")
    directory = tmp_path / "prometheus"
    directory.mkdir()
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(GUNICORN_CONFIG)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    server = ServerProcess(
        [sys.executable, "-m", "gunicorn", f"{APP}:app", "-c", str(config),
         "-k", "graceful.gunicorn.UvicornWorker", "-w", "2", "-b", "127.0.0.1:0",
         "--graceful-timeout", "20"],
        env={**environment, "GRACEFUL_POLICY": "accept-until-idle", "GRACEFUL_IDLE": "1",
             "PROMETHEUS_MULTIPROC_DIR": str(directory)},
    )  # fmt: skip
    try:
        port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
        server.wait_for_line(r"Application startup complete", count=2)
        pids = {int(p) for p in _booted(server)}
        # The test app registers a worker's metrics at its first scrape: reach both.
        seen: set[str] = set()
        deadline = time.monotonic() + 15
        while len(seen) < 2:
            seen.add(scrape_new(port)[1])
            assert time.monotonic() < deadline, seen
        assert {int(p) for p in seen} == pids

        slow = []
        for _ in range(4):
            client = RawHTTP(port)
            client.send("/slow?s=6")
            slow.append(client)
        server.wait_for_line(r"slow request started", count=4)
        # The 4 slow requests are summed over both workers, plus the scrape in the worker
        # that answers.  The other worker's file is up to refresh_interval_s (1 s) old: it
        # may still count that worker's own last scrape, so the sum is 5 or, until its
        # next refresh, 6.
        m = poll(port, lambda m: m["graceful_requests_in_flight"] >= 5)
        assert m["graceful_requests_in_flight"] <= 6, m
        assert m["graceful_phase[serving]"] == 2  # two live workers serve

        server.signal(signal.SIGTERM)  # to the master, which tells both workers
        server.wait_for_line(ACCEPTING, count=2)
        m = poll(port, lambda m: m["graceful_phase[accepting]"] == 2)
        assert m["graceful_phase[serving]"] == 0
        before = m["graceful_connections_after_shutdown_total"]
        assert before >= 1  # at least this scrape's
        for _ in range(4):
            assert RawHTTP(port).get("/")[0] == 200
        m = poll(port, lambda m: m["graceful_connections_after_shutdown_total"] >= before + 5)
        assert m["graceful_kill_deadline_seconds"] <= 20

        server.wait_for_line(DRAINING, count=2)
        assert [client.response()[0] for client in slow] == [200] * 4
        assert server.wait_exit(timeout_s=20) == 0
    finally:
        server.stop()
    # What the workers left behind: counters and drain durations, no live gauges.
    assert not list(directory.glob("gauge_live*"))
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    assert registry.get_sample_value("graceful_drain_duration_seconds_count") == 2
    requests = registry.get_sample_value("graceful_requests_total")
    assert requests is not None
    assert requests >= 4 + 4 + 2
    assert registry.get_sample_value("graceful_phase", {"phase": "serving"}) is None


def _booted(server: ServerProcess) -> list[str]:
    server.wait_for_line(r"Booting worker with pid: (\d+)", count=2)
    return re.findall(r"Booting worker with pid: (\d+)", server.output())


# ------------------------------------------------------------------ graceful run


def _scrape_until(
    port: int, condition: Callable[[Metrics], bool], timeout_s: float = 10.0
) -> Metrics:
    deadline = time.monotonic() + timeout_s
    while True:
        client = RawHTTP(port)
        metrics = scrape(client)
        client.close()
        if condition(metrics):
            return metrics
        assert time.monotonic() < deadline, metrics


@pytest.mark.parametrize("server_name", ["uvicorn", "hypercorn"])
def test_graceful_run_metrics_path_follows_the_drain(server_name: str) -> None:
    """``graceful run --metrics-path`` on each ASGI server; the uvicorn case also checks
    that the server's own hot path hands the path to the middleware."""
    server = ServerProcess(
        [
            *(sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0"),
            *("--server", server_name, "--metrics-path", "/metrics"),
            *("--policy", "serve-until-killed", "--grace-period", "30"),
        ]
    )
    server.port = int(server.wait_for_line(r"(?i)running on http://127\.0\.0\.1:(\d+)")[1])
    try:
        slow = RawHTTP(server.port)
        slow.send("/slow?s=3")
        server.wait_for_line(r"slow request started")
        before = _scrape_until(server.port, lambda m: True)
        assert before["graceful_phase[serving]"] == 1.0
        assert before["graceful_requests_in_flight"] == 1.0  # the scrape is not counted
        server.signal(signal.SIGTERM)
        server.wait_for_line(ACCEPTING)
        other = RawHTTP(server.port)  # a connection and a request after SIGTERM
        assert other.get("/")[0] == 200
        during = _scrape_until(server.port, lambda m: m["graceful_phase[accepting]"] == 1.0)
        assert during["graceful_connections_after_shutdown_total"] >= 1.0
        assert during["graceful_requests_after_shutdown_total"] >= 1.0
        assert during["graceful_kill_deadline_seconds"] < 30.0
        status, _, body = slow.response()
        assert (status, body) == (200, b"slept 3\n")
        server.signal(signal.SIGTERM)  # serve-until-killed would accept for 14.5 s more
        assert server.wait_exit() == 0
    finally:
        server.stop()


def test_graceful_run_workers_share_one_view_and_a_killed_worker_is_marked_dead(
    tmp_path: Path,
) -> None:
    """``graceful run --workers 2`` with ``PROMETHEUS_MULTIPROC_DIR``: any worker's
    endpoint shows both; a worker killed with SIGKILL (no chance to clean up) is marked
    dead by the parent, so its live gauges leave the sums, and its replacement counts."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    server = ServerProcess(
        [
            *(sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0"),
            *("--workers", "2", "--metrics-path", "/metrics", "--grace-period", "20"),
            *("--policy", "refuse-immediately"),
        ],
        env={**environment, "PROMETHEUS_MULTIPROC_DIR": str(directory)},
    )
    try:
        match = server.wait_for_line(r"with 2 workers \(pids (\d+), (\d+)\)")
        pids = [int(match[1]), int(match[2])]
        port = int(server.wait_for_line(r"listening on http://127\.0\.0\.1:(\d+)")[1])
        # Both serve as the parent sees it too: a worker killed before its ready byte
        # reached the parent "failed to start" instead of dying while serving.
        server.wait_for_line(r"worker \d+ serves", count=2)
        _scrape_until(port, lambda m: m.get("graceful_phase[serving]") == 2.0)
        assert list(directory.glob(f"gauge_live*_{pids[0]}.db"))
        os.kill(pids[0], signal.SIGKILL)
        server.wait_for_line(rf"worker {pids[0]} died")
        server.wait_for_line(r"worker \d+ serves|started worker|booted", timeout_s=20)
        _scrape_until(port, lambda m: m.get("graceful_phase[serving]") == 2.0)
        assert not list(directory.glob(f"gauge_live*_{pids[0]}.db"))  # marked dead
        server.signal(signal.SIGTERM)
        assert server.wait_exit(timeout_s=30) == 0
    finally:
        server.stop()
    assert not list(directory.glob("gauge_live*"))  # every worker cleaned up or was marked
