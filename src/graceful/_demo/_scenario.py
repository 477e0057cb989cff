"""One rolling restart, from the first backend started to the last result counted.

Why it is staged like this
--------------------------
When Kubernetes replaces a pod it sends SIGTERM and removes the pod from its endpoints
*at the same time*; the two travel separately, and the balancers learn of the removal
last.  Everything the demo shows follows from that race, so the scenario plays exactly
it and nothing else: three backends of the demo app — A (the pod being replaced), B
(stays), C (the new pod, ready before A is told to go, as with ``maxSurge``); load
through the balancer while A and B serve; then, in one instant, C joins the balancer and
A gets SIGTERM; the balancer forgets A only ``--propagation-delay`` later; A gets SIGKILL
at ``--grace-period`` if it is still alive; a short tail of load shows the others were
not disturbed.  Stock uvicorn and each graceful policy get the same timeline, one after
the other, so their tables and plots compare like with like; so do stock hypercorn,
aiohttp and granian and their graceful adapters, serving the same endpoints, when asked
for (``ALL_SERVERS``).

How the scenario learns what A did
----------------------------------
Graceful backends report each phase change as a JSON event on a pipe
(``graceful._core.events``, via ``graceful._demo._backend``), stamped with the wall
clock where the change happened; one wall-clock reading taken with the scenario's start
puts the events on the scenario's own timeline.  Stock servers report nothing: the
scenario marks the SIGTERM it sent and learns the end from the exit status, as it does
for every backend.  Backends' stderr is kept only as a tail, for the error message when
one fails to start — never parsed.

The scenario draws nothing itself: it waits through its timeline with an
``Observer``, which the demo's progress display is and the rollout benchmark's
quiet runs need not be.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import NamedTuple, Protocol

from .._core.events import parse_event
from ._balancer import Balancer
from ._clients import HttpClient, Tally, http_client_loop, websocket_client_loop
from .app import IMPORT_STRING

__all__ = (
    "ALL_SERVERS",
    "POLICIES",
    "SERVERS",
    "Backend",
    "Observer",
    "Outcome",
    "PhaseMark",
    "ServerKind",
    "run_scenario",
)


POLICIES = ("accept-until-idle", "serve-until-killed", "refuse-immediately")

#: The WSGI rows: gunicorn's stock worker, graceful's, and the options both run with
#: (four sync processes, as one cannot serve the clients beside a long request; one
#: gthread process with eight threads).
WSGI_WORKERS = {
    "gunicorn-sync": ("sync", "graceful.gunicorn.SyncWorker", ["-w", "4"]),
    "gunicorn-gthread": (
        "gthread",
        "graceful.gunicorn.ThreadWorker",
        ["-w", "1", "--threads", "8"],
    ),
}
WSGI_IMPORT_STRING = "graceful._demo.wsgi_app:app"


@dataclass(frozen=True)
class ServerKind:
    """How to start one kind of backend: a server, stock or with a graceful policy."""

    name: str
    policy: str | None  # None: the stock server
    server: str = "uvicorn"  # or "hypercorn", "aiohttp", "granian", a WSGI worker

    @property
    def wsgi(self) -> bool:
        """A gunicorn WSGI worker (``sync``, ``gthread``) serving the Flask demo app."""
        return self.server in WSGI_WORKERS

    @property
    def reports_phases(self) -> bool:
        """Whether its backends write phase events (graceful ASGI ones do; stock ones
        cannot, and the WSGI workers have no event pipe: the demo marks their SIGTERM)."""
        return self.policy is not None and not self.wsgi

    @property
    def needs(self) -> tuple[str, ...]:
        """The modules its backends import."""
        return ("gunicorn", "flask") if self.wsgi else (self.server,)

    def command(
        self, port: int, *, grace_period_s: float, idle_s: float, events_fd: int | None
    ) -> list[str]:
        """The command line of one backend on ``port``, events to ``events_fd``."""
        if self.wsgi:
            stock, graceful, options = WSGI_WORKERS[self.server]
            policy = []
            if self.policy is not None:
                policy = ["-e", f"GRACEFUL_POLICY={self.policy}", "-e", f"GRACEFUL_IDLE={idle_s:g}"]
            return [
                sys.executable, "-m", "gunicorn", WSGI_IMPORT_STRING,
                "-k", stock if self.policy is None else graceful, *options,
                "-b", f"127.0.0.1:{port}", "--graceful-timeout", f"{grace_period_s:g}",
                "--log-level", "warning", *policy, *_no_control_socket(),
            ]  # fmt: skip
        if self.policy is None and self.server == "uvicorn":
            return [
                sys.executable, "-m", "uvicorn", IMPORT_STRING,
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            ]  # fmt: skip
        if self.policy is None and self.server == "granian":
            return [
                sys.executable, "-m", "granian", "--interface", "asgi",
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                IMPORT_STRING,
            ]  # fmt: skip
        launcher = [
            sys.executable, "-m", "graceful._demo._backend",
            "--server", self.server, "--port", str(port),
        ]  # fmt: skip
        if self.policy is None:
            return [*launcher, "--stock"]
        extra = ["--idle", f"{idle_s:g}"] if self.policy == "accept-until-idle" else []
        if events_fd is not None:
            extra += ["--events-fd", str(events_fd)]
        return [*launcher, "--policy", self.policy, "--grace-period", f"{grace_period_s:g}",
                *extra]  # fmt: skip


def _kinds(server: str, prefix: str) -> list[ServerKind]:
    """The stock ``server`` and a graceful one per policy, named ``PREFIX:POLICY``."""
    stock = ServerKind(server, None, server)
    return [stock, *(ServerKind(f"{prefix}:{p}", p, server) for p in POLICIES)]


#: Every server the demo can run, by name.  uvicorn's graceful rows keep their short
#: ``graceful:POLICY`` names; the others say which server they are.
ALL_SERVERS: dict[str, ServerKind] = {
    kind.name: kind
    for kind in (
        *_kinds("uvicorn", "graceful"),
        *_kinds("hypercorn", "graceful-hypercorn"),
        *_kinds("aiohttp", "graceful-aiohttp"),
        *_kinds("granian", "graceful-granian"),
        *_kinds("gunicorn-sync", "graceful-sync"),
        *_kinds("gunicorn-gthread", "graceful-gthread"),
    )
}

#: The servers of the default run (the README's ``python -m graceful demo``, and
#: ``benchmarks/rollout.py``'s matrix): stock uvicorn and each policy on uvicorn.
SERVERS: dict[str, ServerKind] = {
    name: kind for name, kind in ALL_SERVERS.items() if kind.server == "uvicorn"
}


class PhaseMark(NamedTuple):
    """A backend's phase change on the scenario's timeline."""

    t: float  # seconds from the scenario's start
    phase: str
    reason: str


@dataclass
class Backend:
    """One backend process and what is known of it; times from the scenario's start."""

    name: str
    port: int
    proc: asyncio.subprocess.Process
    phases: list[PhaseMark] = field(default_factory=list)
    ended: str = "running"  # then "exited 0", "died of SIGTERM", "killed"
    ended_at: float | None = None
    log_tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    readers: list[asyncio.Future[None]] = field(default_factory=list)


@dataclass
class Outcome:
    """One scenario's results; times in seconds from the scenario's start."""

    kind: ServerKind
    tally: Tally
    load_started_at: float = 0.0
    sigterm_at: float = 0.0
    forgotten_at: float | None = None  # when the balancer stopped routing to A
    load_stopped_at: float | None = None  # requests in flight still finish after it
    terminating: Backend | None = None

    def ended(self) -> str:
        """How A ended, timed from its SIGTERM: ``"exited 0 at 2.5 s"``."""
        b = self.terminating
        if b is None or b.ended_at is None:
            return "?"
        return f"{b.ended} at {b.ended_at - self.sigterm_at:.1f} s"

    def wasted_idle_s(self) -> float | None:
        """How long A stayed alive after its last served response (or its SIGTERM)."""
        b = self.terminating
        if b is None or b.ended_at is None:
            return None
        served = (t for t, name in self.tally.served if name == b.name)
        last = max(served, default=self.sigterm_at)
        return max(0.0, b.ended_at - max(last, self.sigterm_at))


class Observer(Protocol):
    """Waits through a stretch of the scenario's timeline, perhaps showing it."""

    async def wait(self, outcome: Outcome, seconds: float) -> None: ...


class _Quietly:
    async def wait(self, outcome: Outcome, seconds: float) -> None:
        await asyncio.sleep(seconds)  # the load runs meanwhile


async def run_scenario(
    kind: ServerKind, args: argparse.Namespace, progress: Observer | None = None
) -> Outcome:
    """Run one rolling restart against ``kind``; ``progress`` shows it live (optional).

    ``args`` holds the ``graceful demo`` options (see ``graceful._demo.build_parser``).
    """
    observer = progress if progress is not None else _Quietly()
    t0, wall0 = time.monotonic(), time.time()
    outcome = Outcome(kind, Tally(t0))
    backends: list[Backend] = []
    try:
        for name in ("A", "B", "C"):
            backends.append(await _start_backend(kind, name, args, wall0))
    except BaseException:
        for backend in backends:  # none is left running when one fails to start
            await _stop(backend)
        raise
    a, b, c = backends
    outcome.terminating = a
    balancer = Balancer(t0)
    balancer.backends = [a, b]
    await balancer.start()
    stop = asyncio.Event()
    loops = [
        http_client_loop(HttpClient(balancer.port, outcome.tally, keep_alive=keep_alive),
                         path, stop, pause_s)
        for count, keep_alive, path, pause_s in (
            (args.keepalive_clients, True, "/", 0.01),
            (args.fresh_clients, False, "/", 0.01),
            (args.long_requests, False, f"/slow?s={args.long_request_s:g}", 0.0),
        )
        for _ in range(count)
    ]  # fmt: skip
    loops += [
        websocket_client_loop(balancer.port, outcome.tally, stop)
        for _ in range(0 if kind.wsgi else args.websockets)
    ]  # WSGI: no websockets
    load = asyncio.gather(*loops)
    outcome.load_started_at = outcome.tally.elapsed()
    try:
        await observer.wait(outcome, args.warmup)
        # The rolling restart: the new pod is ready, the old one gets SIGTERM ...
        balancer.backends.append(c)
        outcome.sigterm_at = outcome.tally.elapsed()
        if a.proc.returncode is not None:  # nothing to restart: say why, not ProcessLookupError
            log = "".join(a.log_tail)
            raise RuntimeError(
                f"backend {a.name} ({kind.name}) exited ({a.proc.returncode}) before its "
                f"SIGTERM\n{log}"
            )
        a.proc.send_signal(signal.SIGTERM)
        killer = asyncio.ensure_future(_kill_at(a, args.grace_period, t0))
        # ... while the endpoint update takes a while to reach the balancer.
        await observer.wait(outcome, args.propagation_delay)
        balancer.backends.remove(a)
        outcome.forgotten_at = outcome.tally.elapsed()
        await killer
        await observer.wait(outcome, args.tail)
    finally:
        outcome.load_stopped_at = outcome.tally.elapsed()
        stop.set()
        await load
        await balancer.stop()
        for backend in (a, b, c):
            await _stop(backend)
    # A connection the backend refused reaches the client as a reset (the balancer cannot
    # refuse an accepted connection): the balancer knows, so reclassify those.
    outcome.tally.relabel("reset", "refused", at_most=len(balancer.refused))
    return outcome


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _start_backend(
    kind: ServerKind, name: str, args: argparse.Namespace, wall0: float
) -> Backend:
    port = _free_port()
    read_fd, write_fd = os.pipe() if kind.reports_phases else (None, None)
    try:
        proc = await asyncio.create_subprocess_exec(
            *kind.command(
                port, grace_period_s=args.grace_period, idle_s=args.idle, events_fd=write_fd
            ),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "GRACEFUL_DEMO_NAME": name},
            pass_fds=() if write_fd is None else (write_fd,),
            start_new_session=True,  # a process group of its own: see _kill_group
        )
    except BaseException:
        if read_fd is not None:
            os.close(read_fd)
        raise
    finally:
        if write_fd is not None:
            os.close(write_fd)  # the backend's copy is the only one: EOF when it is gone
    backend = Backend(name, port, proc)
    backend.readers.append(asyncio.ensure_future(_keep_tail(backend)))
    if read_fd is not None:
        backend.readers.append(asyncio.ensure_future(_read_events(backend, read_fd, wall0)))
    deadline = time.monotonic() + 20
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return backend
        except OSError:
            if time.monotonic() > deadline or proc.returncode is not None:
                await _stop(backend)
                log = "".join(backend.log_tail)
                raise RuntimeError(f"backend {name} ({kind.name}) did not start\n{log}") from None
            await asyncio.sleep(0.05)


async def _read_events(backend: Backend, read_fd: int, wall0: float) -> None:
    """Put the backend's phase events on the timeline until it is gone."""
    reader = asyncio.StreamReader()
    pipe = os.fdopen(read_fd, "rb")
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe
    )
    try:
        async for line in reader:
            event = parse_event(line)
            if event is not None:
                mark = PhaseMark(event.t - wall0, str(event.phase), event.reason or "")
                backend.phases.append(mark)
    finally:
        transport.close()


async def _keep_tail(backend: Backend) -> None:
    assert backend.proc.stderr is not None
    async for raw in backend.proc.stderr:
        backend.log_tail.append(raw.decode(errors="replace"))


def _kill_group(backend: Backend) -> None:
    """SIGKILL the backend's process group, as the kubelet kills a container's cgroup:
    gunicorn's workers too, not only its master."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(backend.proc.pid, signal.SIGKILL)


async def _stop(backend: Backend) -> None:
    _kill_group(backend)
    await backend.proc.wait()
    if backend.readers:
        await asyncio.wait_for(asyncio.gather(*backend.readers), 5)


async def _kill_at(backend: Backend, grace_period_s: float, t0: float) -> None:
    """SIGKILL ``backend`` at the grace period unless it ended before; record how it ended."""
    try:
        code = await asyncio.wait_for(backend.proc.wait(), grace_period_s)
        backend.ended = f"died of {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
    except asyncio.TimeoutError:
        _kill_group(backend)
        await backend.proc.wait()
        backend.ended = "killed"
    backend.ended_at = time.monotonic() - t0


def _no_control_socket() -> list[str]:
    """gunicorn 27 gives each master a control socket at one path per user: the old and
    the new backend of a rolling restart would take it from each other (and log
    "Control server error")."""
    try:
        major = int(metadata.version("gunicorn").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-control-socket"] if major >= 27 else []
