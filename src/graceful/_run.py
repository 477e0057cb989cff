"""``graceful run MODULE:APP``: serve an ASGI app with graceful shutdown, no code changes.

Options come from the command line, then ``GRACEFUL_*`` variables, then defaults, all
declared once in :mod:`graceful._config`; a bad value is one line naming the option and
exit status 2, before anything starts.

Why ``--workers`` has a parent process, and what it promises
------------------------------------------------------------
With ``--workers N`` the parent binds the socket and starts N ``graceful run`` worker
processes that share it.  In a container only PID 1 — the parent — gets the kubelet's
SIGTERM, so the parent exists to relay signals and to keep the workers honest:

* **Workers never outlive the parent.**  Each worker asks the kernel (Linux
  ``PR_SET_PDEATHSIG``) to be told when its parent dies, right at start, then checks
  that the parent is still the one that started it (closing the race with a parent that
  died before the request).  The worker then gets one SIGTERM — not SIGKILL: an
  orphaned worker drains like any other, and it still exits by its deadline because a
  worker owns its process (``hard_exit``).  On other systems a SIGKILLed parent leaves
  its workers running until they are stopped themselves.
* **No signal is lost at start-up.**  The parent blocks the shutdown signals while it
  spawns a worker; the worker inherits the mask, records them
  (:func:`graceful._signals.defer_signals`) and only then unblocks them, so a SIGTERM
  that arrives while the worker's interpreter starts or the app is imported begins the
  drain once the server is up, instead of killing the worker or being dropped.
* **SIGTERM, SIGINT and SIGQUIT are forwarded** to every worker (a repeat too, which
  escalates there); the parent then waits for the workers until the kill deadline
  (``--grace-period``, else Kubernetes' 30 s) and SIGKILLs what is left.
* **SIGHUP reloads**, as with gunicorn and ``uvicorn --workers``: N new workers start;
  once every one of them serves, the old ones get SIGTERM and drain by the policy while
  the new ones accept on the same socket.  A new worker that fails to start aborts the
  reload and the old workers keep serving.
* **A worker that dies while serving is replaced.**  One that fails to start — exit
  status 3, e.g. an import error — stops everything with status 3 if no worker ever
  started, or after three such failures in a row: a broken app must not be restarted
  forever.

A worker tells the parent it serves through a pipe (one byte at uvicorn's first tick),
and the parent learns of exits from one thread per worker that waits for it; both arrive
as callables on one queue, as do the signals (``catch_signals(…, schedule=queue.put)``),
so the parent's main loop is a blocking ``get`` with the kill deadline as its timeout.

Exit status: 0 after a graceful shutdown, 1 if a worker had to be killed or failed, 2 for
bad usage, 3 if the app could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

from . import _config
from ._config import OPTIONS, ConfigError, Values
from ._deadlines import DEFAULT_GRACE_PERIOD_S
from ._signals import defer_signals, signal_name

__all__ = ("build_parser", "main")

logger = logging.getLogger("graceful")

#: Exit statuses of ``graceful run``.
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NOT_STARTED: Final = 3

#: Boot failures in a row (after a worker once served) that stop the parent.
MAX_BOOT_FAILURES: Final = 3

#: Signals the parent relays to its workers; SIGHUP it handles itself.
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
PARENT_SIGNALS: Final = (*FORWARDED_SIGNALS, signal.SIGHUP)
#: What the kernel sends a worker when its parent dies (Linux; see _die_with_parent).
PARENT_DEATH_SIGNAL: Final = getattr(signal, "SIGRTMIN", signal.SIGTERM)
_PR_SET_PDEATHSIG: Final = 1

POLICY_HELP: Final = {
    "accept-until-idle": "keep accepting until no new connection arrived for --idle "
    "seconds (at least --min-wait, at most --max-wait), then drain",
    "serve-until-killed": "keep serving normally until killed (or --max-wait), then drain",
    "refuse-immediately": "stop accepting at once and drain in-flight requests",
}

_POLICIES_HELP: Final = "\n".join(
    textwrap.fill(f"{name}: {text}", 86, initial_indent="  ", subsequent_indent="    ")
    for name, text in POLICY_HELP.items()
)
EPILOG: Final = f"""\
policies:
{_POLICIES_HELP}

environment:
  Every option can also be set as GRACEFUL_<OPTION> (GRACEFUL_DRAIN_TIMEOUT=20);
  the command line wins.  Booleans: true/false, 1/0, yes/no, on/off.

signals:
  SIGTERM, SIGINT  start the shutdown policy; a second one stops at once
                   (in-flight requests are cut), a third exits at once
  SIGQUIT          stop at once
  SIGHUP           with --workers: reload (start new workers, then drain the old)

workers:
  With --workers N the parent binds the socket and forwards signals to the workers;
  a worker that dies is replaced; workers never outlive the parent (Linux).

exit status:
  0 graceful shutdown, 1 a worker was killed or failed, 2 bad usage,
  3 the app failed to start
"""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``graceful run`` argument parser (values are parsed by :mod:`graceful._config`)."""
    parser = _Parser(
        prog="graceful run",
        description="Serve an ASGI app; lose no request when it is restarted.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation would change meaning as options are added
    )
    parser.add_argument("app", metavar="MODULE:APP", help="the ASGI app, e.g. myapp:app")
    for opt in OPTIONS:
        parser.add_argument(
            opt.flag,
            dest=opt.name,
            metavar=opt.metavar,
            default=None,
            help=f"{opt.help} [default: {_config.help_default(opt)}; env {opt.env}]",
        )
    # A worker of a --workers parent: the listening socket, the pipe that says it
    # serves, the parent it must not outlive.
    for hidden in ("--worker-fd", "--ready-fd", "--parent-pid"):
        parser.add_argument(hidden, type=int, default=None, help=argparse.SUPPRESS)
    return parser


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, Values]:
    """Parse the command line and the environment.

    Raises:
        ConfigError: one line naming the option.
    """
    args = build_parser().parse_args(argv)
    given = {opt.name: getattr(args, opt.name) for opt in OPTIONS}
    values = _config.resolve({k: v for k, v in given.items() if v is not None})
    if ":" not in args.app:
        raise ConfigError(f"MODULE:APP must look like 'package.module:app', got {args.app!r}")
    return args, values


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``graceful run``; returns the exit status."""
    argv = list(sys.argv[2:] if argv is None else argv)
    # First, before anything slow: a SIGTERM from now on starts the drain once the
    # server is up (a --workers parent picks it up in its own loop).
    defer_signals()
    if "--parent-pid" in argv:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENT_SIGNALS)  # see _spawn
        parent = argv[argv.index("--parent-pid") + 1]
        if not _die_with_parent(int(parent)):
            print(f"graceful: parent {parent} is gone; not starting", file=sys.stderr)
            return EXIT_FAILED
    try:
        args, values = parse(argv)
        logging.basicConfig(
            level=logging.DEBUG if values["log_level"] in ("debug", "trace") else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if args.worker_fd is not None:
            return _serve_one(args, values)
        _check_address(values)
        if values["workers"] > 1:
            return _serve_workers(values, argv)
        return _serve_one(args, values)
    except ConfigError as exc:
        print(f"graceful run: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE


# -------------------------------------------------------------------- one server


def _serve_one(args: argparse.Namespace, values: Values) -> int:
    import uvicorn

    ready_fd: int | None = args.ready_fd

    async def notify_ready() -> None:
        # uvicorn calls this at its first tick once it listens (and every
        # timeout_notify seconds after): tell the parent once.
        nonlocal ready_fd
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, b"R")
                os.close(ready_fd)
            ready_fd = None

    sys.path.insert(0, os.getcwd())
    extra: dict[str, Any] = {}
    if ready_fd is not None:
        extra = {"callback_notify": notify_ready, "timeout_notify": 3600}
    config = uvicorn.Config(args.app, **_config.uvicorn_kwargs(values), **extra)
    # The process is ours: a third signal exits at once, and a server that does not
    # stop by the kill deadline is ended just before it.
    server = _config.build_server(values, config, exit_on_third_request=True, hard_exit=True)
    sockets = None if args.worker_fd is None else [socket.socket(fileno=args.worker_fd)]
    try:
        server.run(sockets=sockets)
    except SystemExit:
        if server.started:
            raise
        # uvicorn exits 1 when it cannot import the app: that is our status 3.
    return EXIT_OK if server.started else EXIT_NOT_STARTED


def _die_with_parent(parent_pid: int) -> bool:
    """Have the kernel stop this worker with one SIGTERM when its parent dies (Linux).

    The kernel sends the "parent death" signal each time the worker is re-parented,
    and when the parent is killed it is re-parented once per thread the parent had:
    several SIGTERMs would escalate the drain into a cut.  So the kernel sends
    :data:`PARENT_DEATH_SIGNAL`, whose handler turns the first into one SIGTERM.

    Returns:
        ``False`` if the parent already died (before the request could cover it).
    """
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
        except (OSError, AttributeError):
            print("graceful: cannot ask to be stopped with the parent (prctl)", file=sys.stderr)
            return os.getppid() == parent_pid
        stopped = False

        def parent_died(signum: int, frame: object) -> None:
            nonlocal stopped
            prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
            if not stopped:
                stopped = True
                signal.raise_signal(signal.SIGTERM)

        signal.signal(PARENT_DEATH_SIGNAL, parent_died)
        if prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
            print("graceful: cannot ask to be stopped with the parent (prctl)", file=sys.stderr)
    return os.getppid() == parent_pid


# ------------------------------------------------------------------ the address


def _addresses(values: Values) -> list[tuple[Any, ...]]:
    host, port = values["host"], values["port"]
    try:
        return socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
        )
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"{values.label('host')}: cannot resolve {host!r}: {reason}") from None


def _bind(values: Values, family: int, address: Any) -> socket.socket:
    """A socket bound to ``address``, set up like asyncio's ``create_server``; bind
    errors as one line naming ``--host`` or ``--port``."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        host, port = values["host"], values["port"]
        where = f"{values.label('host')} {host} {values.label('port')} {port}"
        if exc.errno == errno.EADDRNOTAVAIL:
            where = f"{values.label('host')}: {host!r} is not an address of this machine"
        elif exc.errno == errno.EADDRINUSE:
            where = f"{values.label('port')}: port {port} on {host} is in use"
        elif exc.errno == errno.EACCES:
            where = f"{values.label('port')}: no permission to bind port {port}"
        raise ConfigError(f"{where} ({exc.strerror or exc})") from None
    return sock


def _check_address(values: Values) -> None:
    """Refuse an address that cannot be bound, before the app is imported; uvicorn
    would only log the error after starting up."""
    for family, _, _, _, address in _addresses(values):
        _bind(values, family, address).close()
        if values["port"] == 0:
            break  # any free port: the first address is the one that matters


# ---------------------------------------------------------------------- workers


def _serve_workers(values: Values, argv: Sequence[str]) -> int:
    family, _, _, _, address = _addresses(values)[0]
    sock = _bind(values, family, address)
    sock.listen(2048)
    command = [sys.executable, "-m", "graceful", "run", *argv]
    return _Supervisor(sock, command, values["workers"], values["grace_period"]).run()


def _describe(status: int) -> str:
    return f"killed by {signal_name(-status)}" if status < 0 else f"exit status {status}"


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Block the parent's signals while a worker is spawned: the worker inherits the
    mask and unblocks it only once it records them (see :func:`main`)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    ready_fd: int
    ready: bool = False
    retiring: bool = False  # told to stop by a reload or an aborted one


@dataclass(eq=False)
class _Supervisor:
    """The ``--workers`` parent (see the module docs)."""

    sock: socket.socket
    command: list[str]
    count: int
    grace_period_s: float | None
    workers: list[_Worker] = field(default_factory=list)
    tasks: queue.SimpleQueue[Callable[[], object]] = field(default_factory=queue.SimpleQueue)
    stopping: bool = False
    deadline: float | None = None
    status: int = EXIT_OK
    ever_ready: bool = False
    boot_failures: int = 0
    reload: list[_Worker] | None = None  # the new workers of a reload in progress

    def run(self) -> int:
        from ._signals import catch_signals

        with catch_signals(PARENT_SIGNALS, self._on_signal, schedule=self.tasks.put):
            for _ in range(self.count):
                self._spawn()
            host, port = self.sock.getsockname()[:2]
            logger.info(
                "listening on %s:%d with %d workers (pids %s)",
                host,
                port,
                self.count,
                ", ".join(str(w.proc.pid) for w in self.workers),
            )
            print(f"graceful: listening on http://{host}:{port}", flush=True)
            while self.workers:
                timeout = None
                if self.deadline is not None:
                    timeout = max(0.0, self.deadline - time.monotonic())
                try:
                    task = self.tasks.get(timeout=timeout)
                except queue.Empty:
                    self._kill_all()
                    continue
                task()
        self.sock.close()
        return self.status

    # ------------------------------------------------------------ the workers

    def _spawn(self) -> _Worker:
        ready_r, ready_w = os.pipe()
        listening = self.sock.fileno()
        command = [
            *self.command,
            *("--worker-fd", str(listening), "--ready-fd", str(ready_w)),
            *("--parent-pid", str(os.getpid())),
        ]
        try:
            with _signals_blocked():
                proc = subprocess.Popen(
                    command, pass_fds=(listening, ready_w), start_new_session=True
                )
        finally:
            os.close(ready_w)
        worker = _Worker(proc, ready_r)
        self.workers.append(worker)
        # The watcher inherits the blocked mask: a process-directed signal must reach the
        # main thread, which waits on the queue, not a watcher (it would not wake main).
        with _signals_blocked():
            threading.Thread(
                target=self._watch, args=(worker,), name=f"graceful-worker-{proc.pid}", daemon=True
            ).start()
        return worker

    def _watch(self, worker: _Worker) -> None:
        """Report, through the queue, that the worker serves and when it exits."""
        try:
            if os.read(worker.ready_fd, 1):
                self.tasks.put(lambda: self._on_ready(worker))
        except OSError:
            pass
        finally:
            os.close(worker.ready_fd)
        worker.proc.wait()
        self.tasks.put(lambda: self._on_exit(worker))

    def _signal(self, worker: _Worker, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            worker.proc.send_signal(signum)

    def _kill_all(self) -> None:
        """The kill deadline passed."""
        self.deadline = None
        for worker in self.workers:
            logger.error("worker %d outlived the kill deadline; killing it", worker.proc.pid)
            self._signal(worker, signal.SIGKILL)
        self.status = EXIT_FAILED

    # ------------------------------------------------------------------ events

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            self._start_reload()
            return
        if not self.stopping:
            logger.info(
                "%s: stopping %d workers (pids %s)",
                signal_name(signum),
                len(self.workers),
                ", ".join(str(w.proc.pid) for w in self.workers),
            )
            self._stop()
        for worker in self.workers:
            self._signal(worker, signum)

    def _stop(self, status: int | None = None) -> None:
        """No more restarts; SIGKILL what is left at the kill deadline."""
        self.stopping = True
        self.reload = None
        # No worker will be started any more; our copy of the socket would keep it
        # open (and its backlog unserved) once the last worker closed its listener.
        self.sock.close()
        if status is not None:
            self.status = status
        grace = DEFAULT_GRACE_PERIOD_S if self.grace_period_s is None else self.grace_period_s
        self.deadline = time.monotonic() + grace

    def _start_reload(self) -> None:
        if self.stopping:
            logger.info("SIGHUP: ignored while stopping")
            return
        if self.reload is not None:
            logger.info("SIGHUP: ignored, a reload is in progress")
            return
        self.reload = [self._spawn() for _ in range(self.count)]
        logger.info(
            "SIGHUP: reloading: started workers %s; the old ones stop once they serve",
            ", ".join(str(w.proc.pid) for w in self.reload),
        )

    def _retire(self, workers: list[_Worker]) -> None:
        for worker in workers:
            worker.retiring = True
            self._signal(worker, signal.SIGTERM)

    def _on_ready(self, worker: _Worker) -> None:
        logger.info("worker %d serves", worker.proc.pid)
        worker.ready = True
        self.ever_ready = True
        self.boot_failures = 0
        if self.reload is not None and all(w.ready for w in self.reload):
            old = [w for w in self.workers if w not in self.reload and not w.retiring]
            logger.info(
                "reload: new workers serve; stopping the old ones (pids %s)",
                ", ".join(str(w.proc.pid) for w in old),
            )
            self.reload = None
            self._retire(old)

    def _on_exit(self, worker: _Worker) -> None:
        self.workers.remove(worker)
        pid, status = worker.proc.pid, worker.proc.returncode
        if self.stopping:
            log = logger.info if status == 0 else logger.error
            log("worker %d exited (%s)", pid, _describe(status))
            if status != 0 and self.status == EXIT_OK:
                self.status = EXIT_FAILED
            return
        if worker.retiring:
            logger.info("retired worker %d exited (%s)", pid, _describe(status))
            return
        if worker.ready:
            if status == 0:  # stopped by a signal of its own, say
                logger.warning("worker %d stopped; starting a new one", pid)
            else:
                logger.error("worker %d died (%s); starting a new one", pid, _describe(status))
            self._spawn()
            return
        # It never served: the app (or its configuration) is broken, perhaps for good.
        self.boot_failures += 1
        if self.reload is not None and worker in self.reload:
            logger.error(
                "reload failed: new worker %d did not start (%s); the old workers keep serving",
                pid,
                _describe(status),
            )
            self._retire([w for w in self.reload if w is not worker])
            self.reload = None
            return
        if not self.ever_ready or self.boot_failures >= MAX_BOOT_FAILURES:
            times = "" if self.boot_failures == 1 else f" ({self.boot_failures} times in a row)"
            logger.error(
                "worker %d failed to start (%s)%s; stopping", pid, _describe(status), times
            )
            self._stop(EXIT_NOT_STARTED)
            for other in self.workers:
                self._signal(other, signal.SIGTERM)
            return
        logger.error("worker %d failed to start (%s); trying again", pid, _describe(status))
        self._spawn()
