"""``graceful demo``: a Kubernetes rolling restart on loopback, stock vs graceful.

For each server in ``--servers`` (the stock server and each graceful policy, in the same
run) one scenario:

1. three backends of the demo app start: A and B behind the balancer, C ready aside;
2. clients load the balancer: keep-alive clients, fresh-connection clients, and a few
   long requests;
3. the rolling restart: C joins the balancer and A gets SIGTERM, but the balancer keeps
   routing new connections to A for ``--propagation-delay`` seconds (kube-proxy / ingress
   lag), then forgets it; A gets SIGKILL at ``--grace-period`` if still alive;
4. once A is gone the load stops and the outcome is recorded.

The balancer is L4 and does not retry: a connection A refuses or resets is the client's
failure, as with kube-proxy.  Clients reconnect transparently when a server closed their
idle keep-alive connection (every HTTP client does); a request that was sent and got no
complete response is a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import re
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ("main",)

APP = "graceful._demo.app:app"
PHASE_LINE = re.compile(r"(\w+) -> (\w+): (.*?) \(")
FAILURE_KINDS = ("refused", "reset", "5xx", "timeout")


@dataclass(frozen=True)
class ServerKind:
    """How to start one kind of backend."""

    name: str
    policy: str | None  # None: the stock server

    def command(self, port: int, grace_period_s: float, idle_s: float) -> list[str]:
        common = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        if self.policy is None:
            return [sys.executable, "-m", "uvicorn", APP, *common]
        extra = ["--idle", f"{idle_s:g}"] if self.policy == "accept-until-idle" else []
        return [
            sys.executable, "-m", "graceful", "run", APP, *common,
            "--policy", self.policy, *extra, "--grace-period", f"{grace_period_s:g}",
        ]  # fmt: skip


SERVERS: dict[str, ServerKind] = {
    kind.name: kind
    for kind in (
        ServerKind("uvicorn", None),
        ServerKind("graceful:accept-until-idle", "accept-until-idle"),
        ServerKind("graceful:serve-until-killed", "serve-until-killed"),
        ServerKind("graceful:refuse-immediately", "refuse-immediately"),
    )
}


@dataclass
class Backend:
    name: str
    port: int
    proc: asyncio.subprocess.Process
    phases: list[tuple[float, str, str]] = field(default_factory=list)
    ended: str = "running"
    ended_at: float | None = None
    reader: asyncio.Future[None] | None = None


@dataclass
class Outcome:
    """One scenario's results; times in seconds from the scenario's start."""

    kind: ServerKind
    sigterm_at: float = 0.0
    results: Counter[str] = field(default_factory=Counter)
    served: list[tuple[float, str]] = field(default_factory=list)  # (t, backend)
    failures: list[tuple[float, str]] = field(default_factory=list)  # (t, kind)
    terminating: Backend | None = None

    @property
    def requests(self) -> int:
        return sum(self.results.values())

    @property
    def failed(self) -> int:
        return sum(self.results[k] for k in FAILURE_KINDS)

    def ended(self) -> str:
        b = self.terminating
        if b is None or b.ended_at is None:
            return "?"
        at = b.ended_at - self.sigterm_at
        return f"killed at {at:.1f} s" if b.ended == "killed" else f"{b.ended} at {at:.1f} s"

    def wasted_idle_s(self) -> float | None:
        b = self.terminating
        if b is None or b.ended_at is None:
            return None
        last = max((t for t, name in self.served if name == b.name), default=self.sigterm_at)
        return max(0.0, b.ended_at - max(last, self.sigterm_at))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Balancer:
    """Round-robins new connections over its backends; never retries."""

    def __init__(self, clock: float) -> None:
        self.backends: list[Backend] = []
        self._rr = itertools.count()
        self._t0 = clock
        self.refused: list[tuple[float, str]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # the pipes see the reset and end
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            backend = self.backends[next(self._rr) % len(self.backends)]
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend.port)
            except OSError:
                self.refused.append((time.monotonic() - self._t0, backend.name))
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
            self._tasks.discard(task)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except OSError:
        dst.transport.abort()


class Client:
    """An HTTP/1.1 client over asyncio streams that classifies every outcome."""

    def __init__(self, port: int, outcome: Outcome, t0: float, *, keep_alive: bool) -> None:
        self.port = port
        self.outcome = outcome
        self.t0 = t0
        self.keep_alive = keep_alive
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None

    async def get(self, path: str, timeout_s: float) -> None:
        kind, backend = await self._get(path, timeout_s)
        now = time.monotonic() - self.t0
        self.outcome.results[kind] += 1
        if kind == "ok":
            self.outcome.served.append((now, backend))
        else:
            self.outcome.failures.append((now, kind))

    async def _get(self, path: str, timeout_s: float) -> tuple[str, str]:
        if self._conn is not None and self._conn[0].at_eof():
            await self.close()  # the server closed our idle connection: reconnect
        try:
            if self._conn is None:
                self._conn = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.port), timeout_s
                )
            reader, writer = self._conn
            connection = b"keep-alive" if self.keep_alive else b"close"
            writer.write(b"GET %s HTTP/1.1\r\nhost: demo\r\nconnection: %s\r\n\r\n"
                         % (path.encode(), connection))  # fmt: skip
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:])
            }
            await asyncio.wait_for(
                reader.readexactly(int(headers.get("content-length", "0"))), timeout_s
            )
        except asyncio.TimeoutError:
            await self.close()
            return "timeout", ""
        except (OSError, asyncio.IncompleteReadError):
            await self.close()
            return "reset", ""
        if not self.keep_alive or headers.get("connection", "").lower() == "close":
            await self.close()
        status = int(lines[0].split()[1])
        return ("5xx" if status >= 500 else "ok"), headers.get("x-backend", "")


async def _client_loop(client: Client, path: str, stop: asyncio.Event, pause_s: float) -> None:
    for _ in range(1_000_000):  # bounded; the scenario stops it
        if stop.is_set():
            break
        await client.get(path, timeout_s=30)
        if pause_s:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), pause_s)
    await client.close()


async def _websocket_loop(port: int, outcome: Outcome, t0: float, stop: asyncio.Event) -> None:
    """A websocket client echoing a message every 20 ms; reconnects after a clean close.

    A round trip is a request.  A close frame (1000, 1001 going away, 1012 service
    restart) is an orderly end: the client reconnects through the balancer.  A connection
    lost without a close frame, or a failed connect, is a failure.
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    def record(kind: str, backend: str = "") -> None:
        now = time.monotonic() - t0
        outcome.results[kind] += 1
        if kind == "ok":
            outcome.served.append((now, backend))
        else:
            outcome.failures.append((now, kind))

    for _ in range(100_000):  # bounded; the scenario stops it
        if stop.is_set():
            return
        try:
            ws = await asyncio.wait_for(connect(f"ws://127.0.0.1:{port}/ws"), 10)
        except (OSError, InvalidHandshake, asyncio.TimeoutError, ConnectionClosed):
            record("reset")
            await asyncio.sleep(0.02)
            continue
        backend = ws.response.headers.get("x-backend", "") if ws.response else ""
        try:
            while not stop.is_set():
                await ws.send("ping")
                await asyncio.wait_for(ws.recv(), 10)
                record("ok", backend)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.02)
        except ConnectionClosed as closed:
            if closed.rcvd is None:  # no close frame: the connection was cut
                record("reset")
        except asyncio.TimeoutError:
            record("timeout")
        finally:
            await ws.close()


async def _start_backend(
    kind: ServerKind, name: str, args: argparse.Namespace, t0: float
) -> Backend:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *kind.command(port, args.grace_period, args.idle),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "GRACEFUL_DEMO_NAME": name},
    )
    backend = Backend(name, port, proc)
    backend.reader = asyncio.ensure_future(_read_phases(backend, t0))
    deadline = time.monotonic() + 20
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return backend
        except OSError:
            if time.monotonic() > deadline or proc.returncode is not None:
                raise RuntimeError(f"backend {name} ({kind.name}) did not start") from None
            await asyncio.sleep(0.05)


async def _read_phases(backend: Backend, t0: float) -> None:
    assert backend.proc.stderr is not None
    async for raw in backend.proc.stderr:
        match = PHASE_LINE.search(raw.decode(errors="replace"))
        if match:
            backend.phases.append((time.monotonic() - t0, match.group(2), match.group(3)))


async def _stop(backend: Backend) -> None:
    if backend.proc.returncode is None:
        backend.proc.kill()
    await backend.proc.wait()
    if backend.reader is not None:
        await asyncio.wait_for(backend.reader, 5)


async def run_scenario(
    kind: ServerKind, args: argparse.Namespace, progress: Progress | None = None
) -> Outcome:
    """Run one rolling restart against ``kind``; ``progress`` shows it live (optional)."""
    wait = progress.wait if progress is not None else _wait_quietly
    t0 = time.monotonic()
    outcome = Outcome(kind)
    a, b, c = [await _start_backend(kind, n, args, t0) for n in ("A", "B", "C")]
    outcome.terminating = a
    balancer = Balancer(t0)
    balancer.backends = [a, b]
    await balancer.start()
    stop = asyncio.Event()
    clients = [
        _client_loop(Client(balancer.port, outcome, t0, keep_alive=True), "/", stop, 0.01)
        for _ in range(args.keepalive_clients)
    ] + [
        _client_loop(Client(balancer.port, outcome, t0, keep_alive=False), "/", stop, 0.01)
        for _ in range(args.fresh_clients)
    ] + [
        _client_loop(
            Client(balancer.port, outcome, t0, keep_alive=False),
            f"/slow?s={args.long_request_s:g}", stop, 0.0,
        )
        for _ in range(args.long_requests)
    ]  # fmt: skip
    clients += [_websocket_loop(balancer.port, outcome, t0, stop) for _ in range(args.websockets)]
    load = asyncio.gather(*clients)
    try:
        await wait(kind, outcome, args.warmup, t0)
        # The rolling restart: the new pod is ready, the old one gets SIGTERM ...
        balancer.backends.append(c)
        outcome.sigterm_at = time.monotonic() - t0
        a.proc.send_signal(signal.SIGTERM)
        killer = asyncio.ensure_future(_kill_at(a, args.grace_period, t0))
        # ... while the endpoint update takes a while to reach the balancer.
        await wait(kind, outcome, args.propagation_delay, t0)
        balancer.backends.remove(a)
        await killer
        await wait(kind, outcome, args.tail, t0)
    finally:
        stop.set()
        await load
        await balancer.stop()
        for backend in (a, b, c):
            await _stop(backend)
    # A connection the backend refused reaches the client as a reset (the balancer cannot
    # refuse an accepted connection): the balancer knows, so reclassify those.
    refused = min(len(balancer.refused), outcome.results["reset"])
    outcome.results["refused"] += refused
    outcome.results["reset"] -= refused
    return outcome


async def _wait_quietly(kind: ServerKind, outcome: Outcome, seconds: float, t0: float) -> None:
    await asyncio.sleep(seconds)  # the scenario's own timeline: load runs meanwhile


async def _kill_at(backend: Backend, grace_period_s: float, t0: float) -> None:
    try:
        code = await asyncio.wait_for(backend.proc.wait(), grace_period_s)
        backend.ended = f"died of {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
    except asyncio.TimeoutError:
        backend.proc.kill()
        await backend.proc.wait()
        backend.ended = "killed"
    backend.ended_at = time.monotonic() - t0


class Progress:
    """Live progress on a rich console (a plain line per scenario without a terminal)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self.console = Console(stderr=True)
        self._rich = RichProgress(
            TextColumn("{task.description:<30}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._total = total
        self._tasks: dict[str, object] = {}

    def __enter__(self) -> Progress:
        self._rich.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._rich.__exit__(None, None, None)

    async def wait(self, kind: ServerKind, outcome: Outcome, seconds: float, t0: float) -> None:
        from rich.progress import TaskID

        if kind.name not in self._tasks:
            self._tasks[kind.name] = self._rich.add_task(kind.name, total=None, status="")
        task = self._tasks[kind.name]
        assert isinstance(task, int)
        end = time.monotonic() + seconds
        while True:
            b = outcome.terminating
            phase = b.phases[-1][1] if b and b.phases else "serving"
            if b is not None and b.ended_at is not None:
                phase = b.ended
            self._rich.update(
                TaskID(task),
                status=f"{outcome.requests:6d} requests, {outcome.failed:4d} failed, "
                f"A: {phase:<10} t={time.monotonic() - t0:5.1f} s",
            )
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(0.2, left))

    def done(self, kind: ServerKind) -> None:
        from rich.progress import TaskID

        task = self._tasks.get(kind.name)
        if isinstance(task, int):
            self._rich.update(TaskID(task), total=1, completed=1)


def print_table(outcomes: list[Outcome], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Rolling restart: propagation delay {args.propagation_delay:g} s, grace "
        f"period {args.grace_period:g} s, {args.keepalive_clients} keep-alive + "
        f"{args.fresh_clients} fresh-connection clients + {args.long_requests} long requests",
        caption="failed = requests without a complete successful response. wasted idle = "
        "time the terminating backend A stayed alive after its last served response (or "
        "after SIGTERM, if later).",
    )
    for column in ("server", "requests", "failed", *FAILURE_KINDS, "A ended", "wasted idle"):
        table.add_column(column, justify="left" if column in ("server", "A ended") else "right")
    for o in outcomes:
        wasted = o.wasted_idle_s()
        table.add_row(
            o.kind.name,
            str(o.requests),
            str(o.failed),
            *(str(o.results[k]) for k in FAILURE_KINDS),
            o.ended(),
            "?" if wasted is None else f"{wasted:.1f} s",
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    console.print(table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graceful demo",
        description="A simulated Kubernetes rolling restart on loopback: the stock server "
        "and each graceful policy, side by side.",
    )
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, from: {', '.join(SERVERS)}")  # fmt: skip
    parser.add_argument(
        "--propagation-delay",
        type=float,
        default=1.5,
        help="seconds the balancer keeps routing to the terminating backend",
    )
    parser.add_argument(
        "--grace-period", type=float, default=6.0, help="seconds from SIGTERM to SIGKILL"
    )
    parser.add_argument(
        "--idle", type=float, default=1.0, help="accept-until-idle's idle window, seconds"
    )
    parser.add_argument("--warmup", type=float, default=1.5, help="load before SIGTERM, s")
    parser.add_argument("--tail", type=float, default=0.5, help="load after A ended, s")
    parser.add_argument("--keepalive-clients", type=int, default=4)
    parser.add_argument("--fresh-clients", type=int, default=4)
    parser.add_argument("--long-requests", type=int, default=2)
    parser.add_argument("--long-request-s", type=float, default=2.0)
    parser.add_argument("--websockets", type=int, default=0, help="websocket echo clients")
    parser.add_argument("--plot", default=None, help="write the timeline to FILE.svg or .png")
    return parser  # fmt: skip


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names:
        parser.error(f"--servers: unknown {unknown!r}; choose from {', '.join(SERVERS)}")
    args.kinds = [SERVERS[n] for n in names]
    for name in ("propagation_delay", "grace_period", "idle", "warmup", "tail", "long_request_s"):
        value = getattr(args, name)
        if not (0 <= value < 600):
            parser.error(f"--{name.replace('_', '-')}: must be 0 to 600 seconds, got {value}")
    for name in ("keepalive_clients", "fresh_clients", "long_requests", "websockets"):
        if not 0 <= getattr(args, name) <= 200:
            parser.error(f"--{name.replace('_', '-')}: must be 0 to 200")
    if args.plot and not args.plot.endswith((".svg", ".png")):
        parser.error(f"--plot: must end in .svg or .png, got {args.plot!r}")
    return args


async def _run(args: argparse.Namespace) -> list[Outcome]:
    outcomes = []
    with Progress(len(args.kinds)) as progress:
        for kind in args.kinds:
            outcomes.append(await run_scenario(kind, args, progress))
            progress.done(kind)
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``graceful demo``."""
    args = parse(list(sys.argv[2:] if argv is None else argv))
    try:
        import rich  # noqa: F401
    except ImportError:
        print("graceful demo needs rich: pip install 'graceful-drain[demo]'", file=sys.stderr)
        return 2
    outcomes = asyncio.run(_run(args))
    print_table(outcomes, args)
    if args.plot:
        from ._plot import write_plot

        write_plot(outcomes, args.plot)
        print(f"timeline written to {args.plot}")
    return 0
