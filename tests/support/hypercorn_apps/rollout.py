"""A rolling restart of a hypercorn backend behind an L4 balancer, over HTTP/1.1 and HTTP/2.

Backend A (the server under test) gets SIGTERM while the balancer keeps routing new
connections to it for ``propagation_delay_s`` (kube-proxy learning of the endpoint
change late); backend B (graceful hypercorn, never signalled) serves throughout.  httpx
clients run for the whole timeline — keep-alive and fresh-connection clients and long
requests, each over HTTP/1.1 and over HTTP/2 (h2c, prior knowledge) — and every request
that does not end in a 200 is a failure: the balancer never retries, nor do the clients.

``python -m tests.support.hypercorn_apps.rollout`` runs the whole matrix (stock
hypercorn and each policy, on each worker class) and prints the failures per protocol.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.servers import POLICIES, ServerProcess

LAUNCH = str(Path(__file__).with_name("launch.py"))


def backend_command(server: str, worker: str, *, grace_period_s: float) -> list[str]:
    """``server``: ``"stock"`` or a policy name."""
    command = [sys.executable, LAUNCH, "--worker", worker]
    if server == "stock":
        return [*command, "--stock"]
    return [*command, *POLICIES[server], "--grace-period", f"{grace_period_s:g}"]


def start_backend(command: list[str]) -> ServerProcess:
    process = ServerProcess(command)
    process.port = int(process.wait_for_line(r"Running on http://127\.0\.0\.1:(\d+)").group(1))
    return process


class Balancer:
    """Round-robins new connections over :attr:`ports`; pipes bytes; never retries."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.refused = 0
        self.port = 0
        self._rr = itertools.count()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and cut every connection still piped (the load has stopped)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._handle(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            port = self.ports[next(self._rr) % len(self.ports)]
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                self.refused += 1
                writer.transport.abort()
                return
            self._writers.add(up_writer)
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                self._writers.discard(up_writer)
                up_writer.close()
        finally:
            self._writers.discard(writer)
            writer.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except OSError:
        dst.transport.abort()


@dataclass
class Outcome:
    """Requests and failures per protocol; how backend A ended."""

    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    exit_code: int | None = None
    exit_after_s: float | None = None
    refused: int = 0


async def _client_loop(
    url: str, protocol: str, *, fresh: bool, stop: asyncio.Event, outcome: Outcome
) -> None:
    limits = httpx.Limits(max_keepalive_connections=0 if fresh else 1)
    h2 = protocol == "HTTP/2"
    async with httpx.AsyncClient(http1=not h2, http2=h2, limits=limits, timeout=15) as client:
        while not stop.is_set():
            outcome.requests[protocol] += 1
            try:
                response = await client.get(url)
                ok = response.status_code == 200
                if not ok:
                    text = response.text[:60]
                    outcome.errors[f"{protocol} status {response.status_code} {text!r}"] += 1
            except httpx.HTTPError as exc:
                ok = False
                outcome.errors[f"{protocol} {type(exc).__name__}: {exc}"[:120]] += 1
            if not ok:
                outcome.failed[protocol] += 1
            await asyncio.sleep(0.01)


async def rolling_restart(
    command_a: list[str],
    *,
    propagation_delay_s: float = 1.0,
    grace_period_s: float = 6.0,
    warmup_s: float = 1.0,
    tail_s: float = 0.5,
    clients_per_kind: int = 2,
) -> Outcome:
    """Run one rolling restart of the backend started by ``command_a``."""
    backend_b = start_backend(
        backend_command("accept-until-idle", "asyncio", grace_period_s=grace_period_s)
    )
    backend_a = start_backend(command_a)
    balancer = Balancer()
    outcome = Outcome()
    stop = asyncio.Event()
    try:
        await balancer.start()
        balancer.ports = [backend_a.port, backend_b.port]
        base = f"http://127.0.0.1:{balancer.port}"
        tasks = [
            asyncio.create_task(
                _client_loop(base + path, protocol, fresh=fresh, stop=stop, outcome=outcome)
            )
            for protocol in ("HTTP/1.1", "HTTP/2")
            for path, fresh in (("/", False), ("/", True), ("/slow?s=1", False))
            for _ in range(clients_per_kind)
        ]
        await asyncio.sleep(warmup_s)
        signalled = time.monotonic()
        backend_a.signal(signal.SIGTERM)
        await asyncio.sleep(propagation_delay_s)
        balancer.ports = [backend_b.port]
        loop = asyncio.get_running_loop()
        left = grace_period_s - (time.monotonic() - signalled)
        try:
            outcome.exit_code = await loop.run_in_executor(None, backend_a.proc.wait, left)
        except Exception:  # subprocess.TimeoutExpired: SIGKILL, as the kubelet would
            backend_a.proc.kill()
            outcome.exit_code = await loop.run_in_executor(None, backend_a.proc.wait)
        outcome.exit_after_s = time.monotonic() - signalled
        await asyncio.sleep(tail_s)
        stop.set()
        await asyncio.wait(tasks, timeout=20)
        outcome.refused = balancer.refused
    finally:
        stop.set()
        await balancer.stop()
        for backend in (backend_a, backend_b):
            with contextlib.suppress(Exception):
                backend.stop()
    return outcome


def main() -> None:
    print(f"{'server':<22} {'worker':<8} {'HTTP/1.1 failed':>16} {'HTTP/2 failed':>14} exit")
    for server, worker in [
        ("stock", "asyncio"),
        ("stock", "uvloop"),
        *((p, w) for p in POLICIES for w in ("asyncio", "uvloop", "trio")),
    ]:
        command = backend_command(server, worker, grace_period_s=6.0)
        outcome = asyncio.run(rolling_restart(command))
        cells = [
            f"{outcome.failed[p]}/{outcome.requests[p]}".rjust(width)
            for p, width in (("HTTP/1.1", 16), ("HTTP/2", 14))
        ]
        print(
            f"{server:<22} {worker:<8} {cells[0]} {cells[1]} "
            f"{outcome.exit_code} after {outcome.exit_after_s:.2f} s",
            flush=True,
        )
        for error, count in outcome.errors.most_common(3):
            print(f"    {count} x {error}")


if __name__ == "__main__":
    main()
