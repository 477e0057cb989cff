"""A rolling restart behind a balancer that only health-checks (HAProxy's defaults).

No Kubernetes API, no endpoint update: the balancer learns that a backend is going only
from its health checks — ``GET /readyz`` every 2 s on a new connection, a backend marked
down after 3 failures in a row and up after 2 successes (HAProxy's ``inter 2s fall 3
rise 2``), no retries.  Traffic is sparse: one request every 1.5 s, round-robin over two
backends (one per backend every 3 s), so the old backend sees gaps longer than
accept-until-idle's idle window while the balancer still routes to it.

Stock uvicorn closes its listener at SIGTERM: the requests routed to it until the third
failed check are refused.  graceful, with default settings, keeps accepting until the
checker that probed it before SIGTERM has been answered three 503s, then waits the idle
window: nothing is lost.  The load is bounded in count and time; every wait is on an
event (a backend marked up or down, a log line, an exit)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from graceful._demo._balancer import Balancer
from tests.support.servers import ServerProcess, wait_for

httpx = pytest.importorskip("httpx")

INTER_S = 2.0  # HAProxy's inter: one check per backend every 2 s
FALL = 3  # consecutive failed checks that mark a backend down
RISE = 2  # consecutive good checks that mark it up
CHECK_TIMEOUT_S = 1.0  # HAProxy's timeout check
TRAFFIC_EVERY_S = 1.5  # one request every 1.5 s over two backends: one each per 3 s
MAX_REQUESTS = 60  # the traffic's bound in count (and ~90 s in time)

GRACEFUL = [sys.executable, "-m", "graceful", "run", "--port", "0", "--grace-period", "30"]
STOCK_APP = "tests.support.stock_apps.readyz_app:app"
RUNNING = r"running on http://[^:]+:(\d+)"
SETUPS = {
    "graceful uvicorn": ([*GRACEFUL, "examples.asgi_app:app"], RUNNING),
    "graceful aiohttp": (
        [*GRACEFUL, "tests.support.aiohttp_apps.app:app", "--server", "aiohttp"],
        RUNNING,
    ),
    "graceful uvicorn, --readiness-failures 0": (
        [*GRACEFUL, "examples.asgi_app:app", "--readiness-failures", "0"],
        RUNNING,
    ),
    "stock uvicorn": (
        [sys.executable, "-m", "uvicorn", STOCK_APP, "--port", "0"],
        r"running on http://127\.0\.0\.1:(\d+)",
    ),
}
#: ``graceful run --workers 2`` with the probes on the parent's management port: the
#: parent counts the checks, the workers wait for its word (``graceful._cli.relay``).
WORKERS = "graceful --workers 2, probes on --management-port"
SETUPS[WORKERS] = (
    [*GRACEFUL, "examples.asgi_app:app", "--workers", "2", "--management-port", "0"],
    r"listening on http://127\.0\.0\.1:(\d+) with 2 workers",
)
MANAGEMENT = {WORKERS: r"management listener on 127\.0\.0\.1 port (\d+)"}


@dataclass
class Backend:
    name: str
    server: ServerProcess
    up: bool = False
    good: int = 0
    bad: int = 0
    marked: list[tuple[float, str]] = field(default_factory=list)
    check_port: int = 0  # where its health checks go, if not its port
    signalled_at: float = 0.0  # time.monotonic() of its SIGTERM
    exited_at: float = 0.0  # when its exit was seen

    @property
    def port(self) -> int:
        return self.server.port


class CheckedBalancer:
    """The demo's L4 balancer (no retries), fed by an HAProxy-style health checker; both
    on an event loop of their own, in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.balancer = Balancer(time.monotonic())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.balancer.start(), self.loop).result(10)
        self._checks: list[asyncio.Task[None]] = []
        self._closing = False

    def check(self, backend: Backend) -> None:
        """Start checking ``backend``; it joins the rotation after ``RISE`` good checks."""

        async def start() -> None:
            self._checks.append(asyncio.create_task(self._check(backend)))

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def routes_to(self, name: str) -> bool:
        return any(b.name == name for b in self.balancer.backends)

    async def _check(self, backend: Backend) -> None:
        while not self._closing:
            started = self.loop.time()
            ok = await _probe(backend.check_port or backend.port)
            backend.good, backend.bad = (backend.good + 1, 0) if ok else (0, backend.bad + 1)
            if not backend.up and backend.good >= RISE:
                backend.up = True
                self.balancer.backends = [*self.balancer.backends, backend]
                backend.marked.append((time.monotonic(), "up"))
            elif backend.up and backend.bad >= FALL:
                backend.up = False
                self.balancer.backends = [b for b in self.balancer.backends if b is not backend]
                backend.marked.append((time.monotonic(), "down"))
            await asyncio.sleep(max(0.0, started + INTER_S - self.loop.time()))

    def close(self) -> None:
        async def stop() -> None:
            # A cancel can be lost (Python 3.11's wait_for swallows one that lands as
            # the awaited connection completes): the checks also end at their next turn.
            self._closing = True
            while pending := [check for check in self._checks if not check.done()]:
                for check in pending:
                    check.cancel()
                await asyncio.wait(pending, timeout=1)
            await self.balancer.stop()  # it lets the aborted transports close (<= 6 s)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def _probe(port: int) -> bool:
    """One check: a new connection, ``GET /readyz``, good if the status is 200."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), CHECK_TIMEOUT_S
        )
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: backend\r\nConnection: close\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), CHECK_TIMEOUT_S)
        return status_line.split(b" ")[1:2] == [b"200"]
    except (OSError, asyncio.TimeoutError, IndexError):
        return False
    finally:
        if writer is not None:
            writer.close()
            # Not CancelledError: swallowed, the cancel of close() was lost and its
            # check went on for ever (close() timed out under load).
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class Traffic:
    """One request every ``TRAFFIC_EVERY_S`` through the balancer, each on a new
    connection, never retried; bounded by ``MAX_REQUESTS``."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/"
        self.served = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            for _ in range(MAX_REQUESTS):
                try:
                    response = client.get(self.url)
                    if response.status_code == 200:
                        self.served += 1
                    else:
                        self.failures.append(f"status {response.status_code}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                if self._stop.wait(TRAFFIC_EVERY_S):
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


def _start(setup: str, name: str) -> Backend:
    command, listening = SETUPS[setup]
    server = ServerProcess(command)
    server.port = int(server.wait_for_line(listening, timeout_s=20).group(1))
    backend = Backend(name, server)
    if setup in MANAGEMENT:
        backend.check_port = int(server.wait_for_line(MANAGEMENT[setup]).group(1))
    return backend


def _rolling_restart(setup: str) -> tuple[Traffic, Backend]:
    """Old and new behind the checked balancer; SIGTERM to the old once the new is up;
    traffic until the checker took the old one out.  Returns the traffic and the old."""
    lb = CheckedBalancer()
    started: list[Backend] = []
    traffic = None
    try:
        old = _start(setup, "old")
        started.append(old)
        lb.check(old)
        wait_for(lambda: lb.routes_to("old"), 20, "the old backend in rotation")
        traffic = Traffic(lb.balancer.port)
        new = _start(setup, "new")
        started.append(new)
        lb.check(new)
        wait_for(lambda: lb.routes_to("new"), 20, "the new backend in rotation")
        old.signalled_at = time.monotonic()
        old.server.signal(signal.SIGTERM)
        wait_for(lambda: not lb.routes_to("old"), 30, "the checker marking the old one down")
        status = old.server.wait_exit(timeout_s=30)
        old.exited_at = time.monotonic()
        # (stock uvicorn re-raises SIGTERM)
        assert status == 0 or setup.startswith("stock"), (status, old.server.output()[-3000:])
        traffic.stop()
        return traffic, old
    finally:
        if traffic is not None:
            traffic.stop()
        lb.close()
        for backend in started:
            backend.server.stop()


@pytest.mark.parametrize("setup", ["graceful uvicorn", "graceful aiohttp", WORKERS])
def test_a_health_checked_rolling_restart_loses_nothing_with_default_settings(setup: str) -> None:
    traffic, old = _rolling_restart(setup)
    print(f"{setup}: {len(traffic.failures)} failed, {traffic.served} served")
    assert traffic.failures == [], f"{len(traffic.failures)} of {traffic.served} failed"
    assert traffic.served >= 4
    output = old.server.output()
    assert "accepting until the health checkers probing readiness have seen" in output
    if setup == WORKERS:  # the parent counted them, and told the workers
        assert "workers accept until the health checkers have seen the pod fail" in output
        assert "the health checkers probing the management port let go of the pod" in output
    # Accepting ended after the checker's third 503, not at the idle window alone.
    assert "accepting -> draining: no new connection for" in output


def test_stock_uvicorn_loses_requests_behind_the_same_balancer() -> None:
    """The comparison, in the same run: stock uvicorn refuses what the balancer still
    routes to it until the third failed check (2 s apart, round-robin every 1.5 s: at
    least one request)."""
    traffic, _old = _rolling_restart("stock uvicorn")
    assert len(traffic.failures) >= 1, f"stock lost nothing ({traffic.served} served)"
    print(f"stock uvicorn: {len(traffic.failures)} failed, {traffic.served} served")
