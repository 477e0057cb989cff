"""Issue 28's gunicorn edges: graceful's gunicorn workers beside the stock ones.

Each scenario runs a real gunicorn master (``.venv/bin/python -m gunicorn``) with the
stock worker and another with graceful's, side by side (at the same time, so that both
see the same machine), sends real signals and counts what raw-socket clients lost::

    .venv/bin/python -m benchmarks.gunicorn_edges                 # every scenario
    .venv/bin/python -m benchmarks.gunicorn_edges --scenario budget --scenario timeout
    .venv/bin/python -m benchmarks.gunicorn_edges --quick --repeats 2

Stock workers: ``sync``, ``gthread``, ``uvicorn.workers.UvicornWorker`` (or
``uvicorn_worker.UvicornWorker`` if installed; also the baseline for hypercorn, which
has no stock gunicorn worker) and ``aiohttp.worker.GunicornWebWorker``.

A *failure* is a request a client lost: ``refused`` (connection refused or never
accepted: retry-safe) or *cut* once accepted (``reset``, ``eof`` without a response,
``partial``, ``timeout``, a ``503`` or another non-200).  A failures cell reads
``lost (refused n)``; the notes say what each side lost, and what gunicorn's log said
(``WORKER TIMEOUT``, ``SIGKILL``).  The apps are in ``benchmarks/gunicorn_edges_apps``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from benchmarks._common import ROOT

PYTHON = sys.executable
APPS = "benchmarks.gunicorn_edges_apps"
WSGI_APP = f"{APPS}.wsgi_app:app"
ASGI_APP = f"{APPS}.asgi_app:app"
AIOHTTP_APP = f"{APPS}.aiohttp_app:app"

REFUSED = frozenset({"refused", "connect-timeout", "connect-error"})


def now() -> float:
    return time.monotonic()


def sleep_until(at: float) -> None:
    delay = at - now()
    if delay > 0:
        time.sleep(delay)


def log(message: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


# ------------------------------------------------------------------------ the client


@dataclass
class Reply:
    """One request's outcome: ``200``, ``503``, another status, or how it was lost."""

    outcome: str
    t0: float
    t1: float

    @property
    def ok(self) -> bool:
        return self.outcome == "200"

    @property
    def refused(self) -> bool:
        return self.outcome in REFUSED


def http_get(port: int, path: str, timeout: float = 8.0) -> Reply:
    """``GET path`` on a fresh connection (``Connection: close``), read to EOF."""
    t0 = now()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=min(timeout, 3.0))
    except ConnectionRefusedError:
        return Reply("refused", t0, now())
    except TimeoutError:
        return Reply("connect-timeout", t0, now())
    except OSError:
        return Reply("connect-error", t0, now())
    data = b""
    outcome = ""
    with sock:
        sock.settimeout(max(0.1, timeout - (now() - t0)))
        try:
            request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            sock.sendall(request.encode())
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionResetError, BrokenPipeError):
            outcome = "reset"
        except TimeoutError:
            outcome = "timeout"
        except OSError:
            outcome = "error"
    if data:  # a complete response counts, whatever came after it
        status = _status(data)
        outcome = status if status.isdigit() else "partial"
    elif not outcome:
        outcome = "eof"
    return Reply(outcome, t0, now())


def _status(data: bytes) -> str:
    if not data:
        return "eof"
    head, sep, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if not sep or len(parts) < 2 or not parts[1].isdigit():
        return "partial"
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    if length and len(body) < int(length.group(1)):
        return "partial"
    return parts[1].decode()


def tally(replies: Iterable[Reply]) -> Counter[str]:
    return Counter(reply.outcome for reply in replies)


def kinds(counter: Counter[str], skip: Iterable[str] = ("200",)) -> str:
    """``reset 3, eof 1`` (``-`` if nothing but ``skip``)."""
    items = [f"{k} {v}" for k, v in sorted(counter.items()) if k not in skip]
    return ", ".join(items) or "-"


class Load:
    """``clients`` threads, each sending ``GET path`` on a fresh connection every
    ``interval`` s (back to back if 0) from ``start`` until ``until`` — bounded in
    count and time."""

    def __init__(
        self, port: int, *, clients: int, interval: float, path: str = "/", timeout: float = 8.0
    ) -> None:
        self.port, self.clients, self.interval = port, clients, interval
        self.path, self.timeout = path, timeout
        self.replies: list[Reply] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, until: float, start: float | None = None) -> Load:
        start = now() if start is None else start
        limit = int((until - start) / max(self.interval, 0.01)) + 2
        for i in range(self.clients):
            offset = self.interval * i / self.clients  # spread the clients out
            thread = threading.Thread(
                target=self._client, args=(start + offset, until, limit), daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def _client(self, start: float, until: float, limit: int) -> None:
        sleep_until(start)
        tick = start
        for _ in range(limit):
            if now() >= until:
                break
            reply = http_get(self.port, self.path, self.timeout)
            with self._lock:
                self.replies.append(reply)
            if self.interval:  # the next tick, with no burst to catch up after a long one
                tick = max(tick + self.interval, now())
                sleep_until(tick)
            elif not reply.ok:
                time.sleep(0.02)  # no busy loop on a refusing port

    def join(self) -> list[Reply]:
        for thread in self._threads:
            thread.join()
        return sorted(self.replies, key=lambda reply: reply.t0)


def prober(port: int, path: str = "/readyz", interval: float = 0.1) -> Load:
    """The readiness prober: one client, every ``interval`` s."""
    return Load(port, clients=1, interval=interval, path=path, timeout=2.0)


class Later:
    """One ``GET path`` sent at ``at`` in a thread of its own."""

    def __init__(self, port: int, path: str, at: float, timeout: float = 10.0) -> None:
        self.reply: Reply | None = None
        self._thread = threading.Thread(
            target=self._run, args=(port, path, at, timeout), daemon=True
        )
        self._thread.start()

    def _run(self, port: int, path: str, at: float, timeout: float) -> None:
        sleep_until(at)
        self.reply = http_get(port, path, timeout)

    def join(self) -> Reply:
        self._thread.join()
        assert self.reply is not None
        return self.reply


# ------------------------------------------------------------------------ gunicorn


@dataclass(frozen=True)
class Spec:
    """A worker: gunicorn's ``-k`` value, the app and options it needs."""

    worker: str
    app: str
    args: tuple[str, ...] = ()

    @property
    def asgi(self) -> bool:
        return self.app != WSGI_APP


def _stock_asgi_worker() -> str:
    if importlib.util.find_spec("uvicorn_worker") is not None:
        return "uvicorn_worker.UvicornWorker"
    return "uvicorn.workers.UvicornWorker"


THREADS = ("--threads", "4")
STOCK = {
    "sync": Spec("sync", WSGI_APP),
    "gthread": Spec("gthread", WSGI_APP, THREADS),
    "uvicorn": Spec(_stock_asgi_worker(), ASGI_APP),
    "hypercorn": Spec(_stock_asgi_worker(), ASGI_APP),  # hypercorn has no stock worker
    "aiohttp": Spec("aiohttp.worker.GunicornWebWorker", AIOHTTP_APP),
}
GRACEFUL = {
    "sync": Spec("graceful.gunicorn.SyncWorker", WSGI_APP),
    "gthread": Spec("graceful.gunicorn.ThreadWorker", WSGI_APP, THREADS),
    "uvicorn": Spec("graceful.gunicorn.UvicornWorker", ASGI_APP),
    "hypercorn": Spec("graceful.gunicorn.HypercornWorker", ASGI_APP),
    "aiohttp": Spec("graceful.gunicorn.AiohttpWorker", AIOHTTP_APP),
}

_RUNNING: set[Gunicorn] = set()
#: ``--logs DIR``: each server's log is written there, named after its case and side.
LOG_DIR: Path | None = None
_CASE = threading.local()


class Gunicorn:
    """A gunicorn master in a process group of its own, its log kept with times."""

    def __init__(
        self,
        spec: Spec,
        *args: str,
        workers: int = 2,
        env: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.workers = workers
        command = [
            PYTHON, "-m", "gunicorn", spec.app, "-k", spec.worker, "-w", str(workers),
            "-b", "127.0.0.1:0", "--no-control-socket", *spec.args, *args,
        ]  # fmt: skip
        environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
        path = [str(ROOT), *filter(None, [environment.get("PYTHONPATH")])]
        environment.update(
            PYTHONPATH=os.pathsep.join(path),  # the caller's too: an older graceful's src
            PYTHONUNBUFFERED="1",
            PYTHONWARNINGS="ignore::DeprecationWarning",
            **(env or {}),
        )
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: killed as one at the end
        )
        _RUNNING.add(self)
        self.exited_at: float | None = None
        self.saved = False
        self.port = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._wait, daemon=True).start()
        self.pid_exits: dict[int, tuple[float, int | None]] = {}

    def _wait(self) -> None:
        self.proc.wait()
        self.exited_at = now()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((now(), line.rstrip("\n")))

    # -- the log

    def matches(self, pattern: str) -> list[re.Match[str]]:
        found = (re.search(pattern, line) for _, line in list(self.lines))
        return [m for m in found if m]

    def count(self, pattern: str) -> int:
        return len(self.matches(pattern))

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 20.0) -> list[re.Match[str]]:
        deadline = now() + timeout
        while True:
            found = self.matches(pattern)
            if len(found) >= count:
                return found
            if now() > deadline or (self.proc.poll() is not None and not self._reader.is_alive()):
                tail = " / ".join(line for _, line in self.lines[-6:])
                rc = self.proc.poll()
                raise RuntimeError(f"{self.spec.worker} (rc {rc}): no {pattern!r} x{count}: {tail}")
            time.sleep(0.02)

    def worker_pids(self) -> list[int]:
        return [int(m.group(1)) for m in self.matches(r"Booting worker with pid: (\d+)")]

    # -- the process

    def ready(self, timeout: float = 30.0) -> Gunicorn:
        """Wait until it listens, its workers booted and ``/`` answers 200."""
        match = self.wait_for(r"Listening at: http://127\.0\.0\.1:(\d+)", timeout=timeout)[0]
        self.port = int(match.group(1))
        self.wait_for(r"Booting worker with pid", count=self.workers, timeout=timeout)
        deadline = now() + timeout
        while not http_get(self.port, "/", 3.0).ok:
            if now() > deadline:
                raise RuntimeError(f"{self.spec.worker}: / never answered 200")
            time.sleep(0.1)
        time.sleep(1.0 if self.spec.asgi else 0.3)  # the other workers' boot
        return self

    def signal(self, sig: int, pid: int | None = None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid or self.proc.pid, sig)

    def watch(self, pid: int, until: float) -> None:
        """Record when ``pid`` ends, and how if it can be known: as its subreaper
        (``become_subreaper``) once the master is gone, or from a zombie's /proc stat;
        polled until ``until``."""

        def poll() -> None:
            while now() < until:
                try:
                    wpid, status = os.waitpid(pid, os.WNOHANG)  # ours once orphaned
                except ChildProcessError:
                    wpid, status = 0, _zombie_status(pid)
                else:
                    if not wpid:
                        status = None
                if wpid or status is not None or not os.path.exists(f"/proc/{pid}"):
                    self.pid_exits[pid] = (now(), status)
                    return
                time.sleep(0.01)

        threading.Thread(target=poll, daemon=True).start()

    def killed(self, pid: int) -> bool:
        """Whether ``pid`` died of SIGKILL (its status, or the master's log)."""
        status = self.pid_exits.get(pid, (0.0, None))[1]
        if status is not None and os.WIFSIGNALED(status):
            return os.WTERMSIG(status) == signal.SIGKILL
        return bool(self.matches(rf"Worker \(pid:{pid}\) was sent SIGKILL"))

    def wait_exit(self, timeout: float) -> int | None:
        try:
            rc = self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None
        deadline = now() + 1.0
        while self.exited_at is None and now() < deadline:  # the watcher's time
            time.sleep(0.01)
        return rc

    def close(self) -> None:
        """SIGKILL the process group (master and workers) and reap the master."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._reader.join(timeout=2)
        self._save_log()
        for pid in self.worker_pids():  # orphaned workers are ours to reap
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        _RUNNING.discard(self)

    def _save_log(self) -> None:
        if LOG_DIR is None or self.saved:
            return
        self.saved = True
        name = getattr(_CASE, "name", "gunicorn")
        _CASE.count = getattr(_CASE, "count", 0) + 1
        path = LOG_DIR / f"{name}-{_CASE.count}.log"
        origin = self.lines[0][0] if self.lines else 0.0
        path.write_text("".join(f"{t - origin:8.3f} {line}\n" for t, line in self.lines))

    def __enter__(self) -> Gunicorn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_notes(self) -> list[str]:
        """What gunicorn's log says that matters here."""
        notes = []
        for label, pattern in (
            ("WORKER TIMEOUT", r"WORKER TIMEOUT"),
            ("SIGKILLed workers", r"was sent SIGKILL"),
            ("workers exited non-zero", r"Worker \(pid:\d+\) exited with code"),
            ("boot failures", r"Worker failed to boot|App failed to load"),
        ):
            n = self.count(pattern)
            if n:
                notes.append(f"{label} {n}")
        return notes


def _zombie_status(pid: int) -> int | None:
    """A zombie's wait status (/proc/PID/stat's 52nd field), None if it is not one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    if fields and fields[0] in ("Z", "X") and len(fields) > 49:
        return int(fields[49])
    return None


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux): a worker its master left is ours to reap,
    so its exit status (SIGKILL or not) is known."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


@atexit.register
def _kill_all() -> None:
    for server in list(_RUNNING):
        server.close()


# ------------------------------------------------------------------------ results


@dataclass
class Result:
    """One side of one case: requests lost (refused ones included) and what they were."""

    lost: int
    refused: int = 0
    notes: list[str] = field(default_factory=list)
    key: str = ""  # what matters most, shown in the cell too

    def cell(self) -> str:
        cell = f"{self.lost} (refused {self.refused})" if self.refused else str(self.lost)
        return f"{cell}; {self.key}" if self.key else cell


def since(at: float | None, origin: float) -> str:
    return "-" if at is None else f"+{at - origin:.1f}s"


# ------------------------------------------------------------------------ scenarios


@dataclass
class Options:
    quick: bool


@dataclass
class Case:
    """A row: the same measurement under the stock and the graceful worker."""

    label: str
    stock: Callable[[], Result]
    graceful: Callable[[], Result]
    note: str = ""


def _lost(replies: list[Reply], name: str, origin: float) -> tuple[int, int, str]:
    """Lost, refused, and ``name N: refused r, cut c [kinds] first … at +t``."""
    counts = tally(replies)
    refused = sum(v for k, v in counts.items() if k in REFUSED)
    lost = sum(v for k, v in counts.items() if k != "200")
    text = f"{name} {len(replies)}: refused {refused}, cut {lost - refused}"
    if lost:
        text += f" [{kinds(counts)}]"
    first_refused = next((r for r in replies if r.refused), None)
    first_cut = next((r for r in replies if not r.ok and not r.refused), None)
    for what, first in (("refused", first_refused), ("cut", first_cut)):
        if first is not None:
            text += f", first {what} sent at {since(first.t0, origin)}"
    return lost, refused, text


def _exit_note(server: Gunicorn, rc: int | None, origin: float) -> str:
    if rc is None:
        return "master still running (killed)"
    return f"master exit {since(server.exited_at, origin)} rc {rc}"


# 1. budget ----------------------------------------------------------------------


def budget(spec: Spec, env: dict[str, str]) -> Result:
    with Gunicorn(spec, "--graceful-timeout", "10", workers=2, env=env) as server:
        port = server.ready().port
        t_sig = now() + 0.6
        load = Load(port, clients=4, interval=0.05).start(until=t_sig + 8.5)
        slow = [Later(port, "/sleep?s=3", t_sig + d, timeout=9) for d in (1, 3, 5, 7)]
        sleep_until(t_sig)
        server.signal(signal.SIGTERM)
        fast = load.join()
        slow_replies = [later.join() for later in slow]
        rc = server.wait_exit(t_sig + 13 - now())
        f_lost, f_refused, f_text = _lost(fast, "fast", t_sig)
        s_counts = tally(slow_replies)
        s_refused = sum(v for k, v in s_counts.items() if k in REFUSED)
        s_lost = sum(v for k, v in s_counts.items() if k != "200")
        s_text = "3 s @+1/+3/+5/+7: " + " ".join(r.outcome for r in slow_replies)
        key = f"3 s cut {s_lost - s_refused}"
        notes = [f_text, s_text, _exit_note(server, rc, t_sig), *server.log_notes()]
        return Result(f_lost + s_lost, f_refused + s_refused, notes, key)


def scenario_budget(options: Options) -> list[Case]:
    env: dict[str, str] = {}  # graceful's default policy
    labels = ("sync", "uvicorn") if options.quick else ("sync", "gthread", "uvicorn")
    return [
        Case(label, partial(budget, STOCK[label], {}), partial(budget, GRACEFUL[label], env))
        for label in labels
    ]


# 2. busy --------------------------------------------------------------------------


def busy(spec: Spec, env: dict[str, str]) -> Result:
    with Gunicorn(spec, "--graceful-timeout", "10", workers=2, env=env) as server:
        port = server.ready().port
        t_start = now()
        slow = [Later(port, "/sleep?s=3", t_start + 0.05 * i, timeout=9) for i in range(2)]
        t_sig = t_start + 0.5  # both workers inside their 3 s request
        sleep_until(t_sig)
        server.signal(signal.SIGTERM)
        load = Load(port, clients=32, interval=0.1).start(until=t_sig + 3.0)
        fast = load.join()
        slow_replies = [later.join() for later in slow]
        rc = server.wait_exit(t_sig + 13 - now())
        lost, refused, text = _lost(fast + slow_replies, "requests", t_sig)
        notes = [
            text,
            "3 s: " + " ".join(r.outcome for r in slow_replies),
            _exit_note(server, rc, t_sig),
        ]
        return Result(lost, refused, notes + server.log_notes())


def scenario_busy(options: Options) -> list[Case]:
    return [Case("sync", partial(busy, STOCK["sync"], {}), partial(busy, GRACEFUL["sync"], {}))]


# 3. timeout -----------------------------------------------------------------------

#: The idle waits' seed: 27 draws waits of mean 1.12 s (the range's is 1.1 s), half
#: of them above 1 s, where idle + 3 s passes --timeout 4.
SEED = 27


def timeout(spec: Spec, env: dict[str, str], count: int) -> Result:
    with Gunicorn(spec, "--timeout", "4", workers=1, env=env) as server:
        port = server.ready().port
        rng = random.Random(SEED)
        replies = []
        waits = []
        for _ in range(count):
            wait = rng.uniform(0.3, 1.9)
            waits.append(wait)
            time.sleep(wait)
            replies.append(http_get(port, "/sleep?s=3.0", timeout=10))
        time.sleep(0.3)
        counts = tally(replies)
        lost = sum(v for k, v in counts.items() if k != "200")
        refused = sum(v for k, v in counts.items() if k in REFUSED)
        outcomes = " ".join(f"{w:.1f}s→{r.outcome}" for w, r in zip(waits, replies, strict=True))
        key = f"WORKER TIMEOUT {server.count(r'WORKER TIMEOUT')}"
        return Result(lost, refused, [f"idle→outcome: {outcomes}", *server.log_notes()], key)


def scenario_timeout(options: Options) -> list[Case]:
    count = 4 if options.quick else 8
    return [
        Case(
            "sync",
            partial(timeout, STOCK["sync"], {}, count),
            partial(timeout, GRACEFUL["sync"], {}, count),
            f"{count} sequential 3.0 s requests, --timeout 4",
        )
    ]


# 4. threads -----------------------------------------------------------------------


def threads_start(spec: Spec, env: dict[str, str], graceful: bool) -> Result:
    """Start ``-k spec --threads 4`` with ``GRACEFUL_POLICY=bogus``: refused, or what runs."""
    server = Gunicorn(spec, *THREADS, workers=1, env=env)
    with server:
        try:
            server.ready(timeout=12)
        except RuntimeError:
            rc = server.wait_exit(3)
            errors = [m.group(0) for m in server.matches(r"(?i)error.*graceful.*")][:1]
            return Result(0, 0, [f"refused to start (rc {rc})", *errors])
        using = server.matches(r"Using worker: (\S+)")
        info = http_get_body(server.port, "/info")
        t0 = now()
        parallel = [Later(server.port, "/sleep?s=1", t0) for _ in range(4)]
        elapsed = max(later.join().t1 for later in parallel) - t0
        worker = using[0].group(1) if using else "?"
        notes = [
            f"started; Using worker: {worker}",
            f"middleware: {info}",
            f"4 x 1 s in parallel took {elapsed:.1f}s",
        ]
        failed = int(elapsed > 1.8)  # the threads were not honoured
        if graceful:
            failed += 1  # GRACEFUL_POLICY=bogus was accepted
            notes.append("GRACEFUL_POLICY=bogus accepted")
        return Result(failed, 0, notes)


def http_get_body(port: int, path: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.partition(b"\r\n\r\n")[2].decode().strip()


def threads_rolling(spec: Spec, env: dict[str, str]) -> Result:
    with Gunicorn(spec, *THREADS, "--graceful-timeout", "10", workers=2, env=env) as server:
        port = server.ready().port
        info = http_get_body(port, "/info")
        t_sig = now() + 0.5
        load = Load(port, clients=4, interval=0.05).start(until=t_sig + 1.5)
        slow = [Later(port, "/sleep?s=2", t_sig - 0.2) for _ in range(2)]
        sleep_until(t_sig)
        server.signal(signal.SIGTERM)
        replies = load.join() + [later.join() for later in slow]
        rc = server.wait_exit(t_sig + 13 - now())
        lost, refused, text = _lost(replies, "requests", t_sig)
        notes = [f"middleware: {info}", text, _exit_note(server, rc, t_sig)]
        return Result(lost, refused, notes + server.log_notes())


def scenario_threads(options: Options) -> list[Case]:
    bogus = {"GRACEFUL_POLICY": "bogus"}
    valid = {"GRACEFUL_POLICY": "accept-until-idle"}
    stock, graceful = Spec("sync", WSGI_APP), GRACEFUL["sync"]
    # gunicorn swaps any worker named ...SyncWorker for its stock gthread when --threads
    # is above 1, before importing it: graceful's name for every --threads is WSGIWorker.
    either = Spec("graceful.gunicorn.WSGIWorker", WSGI_APP)
    return [
        Case(
            "SyncWorker --threads 4, POLICY=bogus",
            partial(threads_start, stock, bogus, False),
            partial(threads_start, graceful, bogus, True),
            "stock: -k sync --threads 4",
        ),
        Case(
            "SyncWorker --threads 4, rolling",
            partial(threads_rolling, stock, valid),
            partial(threads_rolling, graceful, valid),
            "1.5 s of new connections after SIGTERM, 2 x 2 s in flight",
        ),
        Case(
            "WSGIWorker --threads 4, POLICY=bogus",
            partial(threads_start, stock, bogus, False),
            partial(threads_start, either, bogus, True),
            "stock: -k sync --threads 4",
        ),
        Case(
            "WSGIWorker --threads 4, rolling",
            partial(threads_rolling, stock, valid),
            partial(threads_rolling, either, valid),
            "1.5 s of new connections after SIGTERM, 2 x 2 s in flight",
        ),
    ]


# 5. sweep -------------------------------------------------------------------------


def sweep(spec: Spec, env: dict[str, str], busy_threads: bool) -> Result:
    with Gunicorn(spec, "--graceful-timeout", "6", workers=2, env=env) as server:
        port = server.ready().port
        t_sig = now() + 0.5
        fast = Load(port, clients=4, interval=0.05).start(until=t_sig + 5.0)
        slow = None
        if busy_threads:  # 8 clients, each a 1 s request a second: every thread busy
            slow = Load(port, clients=8, interval=1.0, path="/sleep?s=1")
            slow.start(until=t_sig + 5.0, start=t_sig - 0.4)
        sleep_until(t_sig)
        server.signal(signal.SIGTERM)
        replies = fast.join()
        lost, refused, text = _lost(replies, "fast", t_sig)
        notes = [text]
        if slow is not None:
            slow_replies = slow.join()
            s_lost, s_refused, s_text = _lost(slow_replies, "1 s", t_sig)
            lost, refused = lost + s_lost, refused + s_refused
            notes.append(s_text)
        rc = server.wait_exit(t_sig + 9 - now())
        notes.append(_exit_note(server, rc, t_sig))
        return Result(lost, refused, notes + server.log_notes())


def scenario_sweep(options: Options) -> list[Case]:
    env = {"GRACEFUL_POLICY": "serve-until-killed"}
    variants = (False,) if options.quick else (False, True)
    return [
        Case(
            "gthread" + (", all threads busy" if busy_threads else ""),
            partial(sweep, STOCK["gthread"], {}, busy_threads),
            partial(sweep, GRACEFUL["gthread"], env, busy_threads),
            "serve-until-killed, --graceful-timeout 6, new connections for 5 s",
        )
        for busy_threads in variants
    ]


# 6. short-timeout -----------------------------------------------------------------


def short_timeout(spec: Spec, env: dict[str, str], grace: int, seconds: float) -> Result:
    with Gunicorn(spec, "--graceful-timeout", str(grace), workers=1, env=env) as server:
        port = server.ready().port
        t_sig = now() + 0.1
        request = Later(port, f"/sleep?s={seconds}", t_sig - 0.1, timeout=grace + 4)
        sleep_until(t_sig)
        server.signal(signal.SIGTERM)
        reply = request.join()
        rc = server.wait_exit(t_sig + grace + 4 - now())
        notes = [
            f"{seconds} s request: {reply.outcome} at {since(reply.t1, t_sig)}",
            _exit_note(server, rc, t_sig),
        ]
        return Result(int(not reply.ok), int(reply.refused), notes + server.log_notes())


def scenario_short_timeout(options: Options) -> list[Case]:
    cases = []
    grids = ((1, 0.8),) if options.quick else ((1, 0.8), (2, 1.6))
    for grace, seconds in grids:
        for label in ("sync", "gthread"):
            cases.append(
                Case(
                    f"{label}, --graceful-timeout {grace}, {seconds} s",
                    partial(short_timeout, STOCK[label], {}, grace, seconds),
                    partial(short_timeout, GRACEFUL[label], {}, grace, seconds),
                )
            )
    return cases


# 7. late-relay --------------------------------------------------------------------


def late_relay(spec: Spec, env: dict[str, str]) -> Result:
    with Gunicorn(spec, "--graceful-timeout", "10", workers=1, env=env) as server:
        port = server.ready().port
        worker = server.worker_pids()[0]
        t0 = now()
        request = Later(port, "/sleep?s=2", t0, timeout=10)
        t_sig = t0 + 0.3
        sleep_until(t_sig)
        server.signal(signal.SIGTERM, worker)  # the worker first (a process group's signal)
        sleep_until(t_sig + 0.5)
        server.signal(signal.SIGTERM)  # then the master, which relays it
        reply = request.join()
        rc = server.wait_exit(t_sig + 13 - now())
        notes = [
            f"2 s request: {reply.outcome} at {since(reply.t1, t_sig)}",
            _exit_note(server, rc, t_sig),
        ]
        return Result(int(not reply.ok), int(reply.refused), notes + server.log_notes())


def scenario_late_relay(options: Options) -> list[Case]:
    labels = ("uvicorn",) if options.quick else ("uvicorn", "hypercorn", "aiohttp")
    return [
        Case(
            label,
            partial(late_relay, STOCK[label], {}),
            partial(late_relay, GRACEFUL[label], {}),
            f"stock: {STOCK[label].worker.rpartition('.')[2]}",
        )
        for label in labels
    ]


# 8. reload ------------------------------------------------------------------------


def reload(spec: Spec, env: dict[str, str], sig: int, probe_s: float) -> Result:
    with Gunicorn(spec, "--graceful-timeout", "10", workers=2, env=env) as server:
        port = server.ready().port
        booted = len(server.worker_pids())
        t_sig = now() + 0.3
        probes = prober(port).start(until=t_sig + probe_s)
        sleep_until(t_sig)
        server.signal(sig)
        replies = probes.join()
        lost, refused, text = _lost(replies, "probes", t_sig)
        alive = server.proc.poll() is None
        booted_after = len(server.worker_pids()) - booted
        notes = [text, f"workers booted after the signal {booted_after}, master alive {alive}"]
        return Result(lost, refused, notes + server.log_notes())


def scenario_reload(options: Options) -> list[Case]:
    probe_s = 5.0 if options.quick else 8.0
    labels = ("sync",) if options.quick else ("sync", "uvicorn")
    return [
        Case(
            f"{label}, {signal.Signals(sig).name}",
            partial(reload, STOCK[label], {}, sig, probe_s),
            partial(reload, GRACEFUL[label], {}, sig, probe_s),
            f"/readyz every 100 ms for {probe_s:g} s",
        )
        for label in labels
        for sig in (signal.SIGHUP, signal.SIGTTOU)
    ]


# 9. kill-margin -------------------------------------------------------------------


def kill_margin(spec: Spec, env: dict[str, str]) -> Result:
    grace = 4.0
    with Gunicorn(spec, "--graceful-timeout", f"{grace:g}", workers=1, env=env) as server:
        port = server.ready().port
        worker = server.worker_pids()[0]
        t0 = now()
        request = Later(port, "/stubborn?s=30", t0, timeout=grace + 4)
        t_sig = t0 + 0.5
        server.watch(worker, until=t_sig + grace + 4)
        sleep_until(t_sig)
        server.signal(signal.SIGTERM)
        reply = request.join()
        rc = server.wait_exit(t_sig + grace + 4 - now())
        time.sleep(0.1)
        exited = server.pid_exits.get(worker, (None, None))[0]
        killed = int(server.killed(worker))
        status = server.pid_exits.get(worker, (None, None))[1]
        if status is not None:
            how = _how(status)
        else:  # the master reaped it, and says so only of a signal or a non-zero exit
            how = "reaped by the master: " + (
                "SIGKILL in its log" if killed else "no signal or non-zero exit in its log"
            )
        when, key = "still alive", "alive"
        if exited is not None:
            margin = t_sig + grace - exited
            key = f"exit {since(exited, t_sig)}"
            when = f"{since(exited, t_sig)} ({margin:+.2f}s before the {grace:g}s deadline)"
        notes = [
            f"worker exit {when}, {how}",
            f"stubborn request: {reply.outcome}",
            _exit_note(server, rc, t_sig),
        ]
        return Result(killed, 0, notes + server.log_notes(), key)


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def scenario_kill_margin(options: Options) -> list[Case]:
    labels = ("uvicorn",) if options.quick else ("uvicorn", "hypercorn", "aiohttp")
    return [
        Case(
            label,
            partial(kill_margin, STOCK[label], {}),
            partial(kill_margin, GRACEFUL[label], {}),
            "failures = SIGKILLed workers",
        )
        for label in labels
    ]


SCENARIOS: dict[str, Callable[[Options], list[Case]]] = {
    "budget": scenario_budget,
    "busy": scenario_busy,
    "timeout": scenario_timeout,
    "threads": scenario_threads,
    "sweep": scenario_sweep,
    "short-timeout": scenario_short_timeout,
    "late-relay": scenario_late_relay,
    "reload": scenario_reload,
    "kill-margin": scenario_kill_margin,
}


# ------------------------------------------------------------------------ main


def run_side_by_side(case: Case, name: str) -> tuple[Result, Result]:
    """The stock and the graceful worker at the same time."""

    def safe(run: Callable[[], Result], side: str) -> Result:
        _CASE.name = re.sub(r"[^A-Za-z0-9.=-]+", "_", f"{name}-{case.label}-{side}")
        _CASE.count = 0
        try:
            return run()
        except Exception as exc:  # a broken run is a row, not a crash
            return Result(-1, 0, [f"ERROR {type(exc).__name__}: {exc}".splitlines()[0]])

    with ThreadPoolExecutor(2) as pool:
        stock = pool.submit(safe, case.stock, "stock")
        graceful = pool.submit(safe, case.graceful, "graceful")
        return stock.result(), graceful.result()


def rows(names: list[str], options: Options, repeats: int) -> Iterator[list[str]]:
    for name in names:
        for case in SCENARIOS[name](options):
            results = []
            for repeat in range(repeats):
                log(f"{name} / {case.label} (run {repeat + 1}/{repeats})")
                started = now()
                results.append(run_side_by_side(case, f"{name}-r{repeat + 1}"))
                log(f"  {now() - started:.1f}s: {results[-1][0].cell()} vs {results[-1][1].cell()}")
            stock_cell = " / ".join(s.cell() for s, _ in results)
            graceful_cell = " / ".join(g.cell() for _, g in results)
            notes = [case.note] if case.note else []
            for i, (stock, graceful) in enumerate(results):
                prefix = f"r{i + 1} " if repeats > 1 else ""
                notes.append(f"{prefix}stock: {'; '.join(stock.notes)}")
                notes.append(f"{prefix}graceful: {'; '.join(graceful.notes)}")
            yield [name, case.label, stock_cell, graceful_cell, "<br>".join(notes)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario",
        action="append",
        choices=list(SCENARIOS),
        help="a scenario to run (repeatable; default: all)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case (default 1)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer variants (budget: sync, uvicorn; one of each elsewhere), 4 requests "
        "in timeout, 5 s of probes in reload",
    )
    parser.add_argument("--logs", type=Path, help="write every gunicorn's log to this directory")
    args = parser.parse_args(argv)
    if args.logs is not None:
        global LOG_DIR
        LOG_DIR = args.logs
        LOG_DIR.mkdir(parents=True, exist_ok=True)
    names = args.scenario or list(SCENARIOS)
    options = Options(quick=args.quick)
    subreaper = become_subreaper()
    import gunicorn

    print(
        f"gunicorn {gunicorn.__version__}, Python {sys.version.split()[0]}, "
        f"stock ASGI worker {_stock_asgi_worker()}; subreaper {subreaper}; "
        "failures: lost (refused n)\n"
    )
    print("| scenario | worker | stock failures | graceful failures | notes |")
    print("|---|---|---|---|---|")
    sys.stdout.flush()
    for row in rows(names, options, max(1, args.repeats)):
        print("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
