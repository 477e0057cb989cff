"""The fault suite's harness: real server subprocesses, raw-socket clients, /proc checks.

Servers are started with :class:`integration.servers.ServerProcess` (their merged output
read line by line); the apps in :mod:`tests.support.fault_apps` log ``handled <id>`` per request
to a file the harness gives them, so a test compares what every client saw with what the
app handled.

Every wait here is on something observable — a log line, a process state in ``/proc``, a
pending signal, a socket becoming readable, a process exit — and bounded by a timeout.
Every client outcome is one of:

* ``ok``: a complete response (its status is kept);
* ``refused``: the connect was refused (or reset during the handshake) — nothing was
  sent, a client may retry;
* ``lost``: the request was sent and no complete response came back (reset, EOF, or
  nothing before the deadline) — the client cannot know whether it was processed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import selectors
import signal
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.servers import ServerProcess, wait_for

__all__ = (
    "APP",
    "Client",
    "Harness",
    "Outcome",
    "Response",
    "alive",
    "children",
    "collect",
    "outcomes",
    "request_bytes",
    "summarize",
    "wait_for",
)

APP = "tests.support.fault_apps.basic:app"
RUNNING = r"running on http://127\.0\.0\.1:(\d+)"
LISTENING = r"listening on http://127\.0\.0\.1:(\d+)"
GUNICORN_LISTENING = r"Listening at: http://127\.0\.0\.1:(\d+)"
STARTED = r"Application startup complete"
#: graceful's WSGI workers, and the line each logs once its app is loaded.
WSGI_WORKERS = ("SyncWorker", "ThreadWorker", "WSGIWorker")
WSGI_READY = r"policy .*; kill deadline"
WSGI_APP = "tests.support.fault_apps.wsgi:app"
ACCEPTING = r"serving -> accepting"
DRAINING = r"-> draining"
STOPPING = r"-> stopping"
STOPPED = r"stopping -> stopped"


# ----------------------------------------------------------------------- waiting


# ------------------------------------------------------------------------ /proc


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _start_time(pid: int) -> str:
    """When ``pid`` started (clock ticks after boot): a reused pid has another.  (Not its
    command line: the zygote's children share one, tests/support/zygote.py.)"""
    fields = _stat(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return fields[19]


def state(pid: int) -> str | None:
    """The process state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie), or ``None``."""
    fields = _stat(pid)
    return None if fields is None else fields[0]


def alive(pid: int) -> bool:
    """``True`` if ``pid`` exists and is not a zombie."""
    return state(pid) not in (None, "Z", "X")


def children(pid: int) -> list[int]:
    """Direct, living children of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def signal_pending(pid: int, sig: int) -> bool:
    """``True`` if ``sig`` is pending for ``pid`` (a stopped process keeps it pending)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    bit = 1 << (sig - 1)
    for line in text.splitlines():
        if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & bit:
            return True
    return False


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` (waiting until it is stopped); SIGCONT it on the way out."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: state(pid) in ("T", "t"), 5, f"process {pid} stopped")
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


# --------------------------------------------------------------------- servers


class Harness:
    """Starts servers for one test and stops every one of them at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.servers: list[ServerProcess] = []
        self.adopted: dict[int, str] = {}
        self._count = 0

    def adopt(self, pids: Iterable[int]) -> None:
        """Kill ``pids`` at teardown too (workers that may be orphaned by the test: once
        their parent is gone, :meth:`ServerProcess.stop` cannot find them)."""
        for pid in pids:
            with contextlib.suppress(OSError):
                self.adopted[pid] = _start_time(pid)

    def start(self, args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        """Start ``args`` (output read line by line, app log in ``server.log_path``)."""
        self._count += 1
        log = self.tmp_path / f"app-{self._count}.log"
        server = ServerProcess(args, env={"FAULTS_LOG": str(log), **(env or {})})
        server.log_path = log  # type: ignore[attr-defined]
        server.started_at = time.monotonic()  # type: ignore[attr-defined]
        self.servers.append(server)
        return server

    def graceful(
        self,
        *options: str,
        app: str = APP,
        env: dict[str, str] | None = None,
        wait: bool = True,
        workers: int = 1,
    ) -> ServerProcess:
        """``python -m graceful run APP --port 0 OPTIONS``; waits until it serves."""
        args = [sys.executable, "-m", "graceful", "run", app, "--port", "0", *options]
        if workers > 1:
            args += ["--workers", str(workers)]
        server = self.start(args, env)
        if wait:
            pattern = LISTENING if workers > 1 else RUNNING
            server.port = int(server.wait_for_line(pattern, timeout_s=20).group(1))
            server.wait_for_line(STARTED, timeout_s=20, count=workers)
        return server

    def gunicorn(
        self,
        *options: str,
        app: str = APP,
        env: dict[str, str] | None = None,
        workers: int = 1,
        worker_class: str = "UvicornWorker",
        wait: bool = True,
    ) -> ServerProcess:
        """gunicorn with one of graceful's workers on a free loopback port."""
        args = [
            sys.executable, "-m", "gunicorn", app, "-k", f"graceful.gunicorn.{worker_class}",
            "-w", str(workers), "-b", "127.0.0.1:0", *options,
        ]  # fmt: skip
        server = self.start(args, env)
        if wait:
            server.port = int(server.wait_for_line(GUNICORN_LISTENING, timeout_s=20).group(1))
            # A WSGI worker has no lifespan: it says its policy once the app is loaded.
            ready = WSGI_READY if worker_class in WSGI_WORKERS else STARTED
            server.wait_for_line(ready, timeout_s=20, count=workers)
        return server

    def run_to_exit(
        self, args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 20
    ) -> tuple[int, str]:
        """Run a short-lived command; return its status and merged output."""
        server = self.start(args, env)
        code = server.wait_exit(timeout_s)
        server._reader.join(5)
        return code, server.output()

    def stop_all(self) -> None:
        # Orphans first: they hold their parent's output pipe open.
        for pid, started in self.adopted.items():
            with contextlib.suppress(OSError):
                if _start_time(pid) == started:  # not a reused pid
                    os.kill(pid, signal.SIGKILL)
        for server in self.servers:
            server.stop()


def tracebacks(output: str) -> int:
    """Tracebacks in ``output``, not counting those of requests cut on purpose (uvicorn
    logs a cut request's ``CancelledError``; ``test_cut_request_logs_no_traceback``
    covers that)."""
    cut = len(re.findall(r"CancelledError: graceful: stopping", output))
    return output.count("Traceback (most recent call last)") - cut


def handled(server: ServerProcess) -> list[str]:
    """The ids of requests the app handled (in order), from its log file."""
    path: Path = server.log_path  # type: ignore[attr-defined]
    if not path.exists():
        return []
    return re.findall(r"^handled (\S+)$", path.read_text(), flags=re.MULTILINE)


def worker_pids(server: ServerProcess) -> list[int]:
    """gunicorn: the pids of the workers booted so far."""
    return [int(m) for m in re.findall(r"Booting worker with pid: (\d+)", server.output())]


# ----------------------------------------------------------------------- clients


def request_bytes(
    path: str = "/",
    rid: str | None = None,
    *,
    method: str = "GET",
    version: str = "HTTP/1.1",
    headers: Iterable[str] = (),
    body: bytes = b"",
) -> bytes:
    """One request; ``rid`` is added to the query string as ``id=``."""
    if rid is not None:
        path += ("&" if "?" in path else "?") + f"id={rid}"
    lines = [f"{method} {path} {version}", "Host: faults", *headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_response(buffer: bytes, *, eof: bool = False) -> tuple[Response | None, bytes]:
    """Parse one response from the start of ``buffer``: ``(response, rest)``, or
    ``(None, buffer)`` if it is not complete yet.  Interim (1xx) responses are returned
    like any other."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None, buffer
    lines = buffer[:head_end].decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    rest = buffer[head_end + 4 :]
    if 100 <= status < 200 or status in (204, 304):
        return Response(status, headers, b""), rest
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            line_end = rest.find(b"\r\n")
            if line_end < 0:
                return None, buffer
            size = int(rest[:line_end].split(b";")[0], 16)
            if len(rest) < line_end + 2 + size + 2:
                return None, buffer
            body += rest[line_end + 2 : line_end + 2 + size]
            rest = rest[line_end + 2 + size + 2 :]
            if size == 0:
                return Response(status, headers, body), rest
    if "content-length" in headers:
        length = int(headers["content-length"])
        if len(rest) < length:
            return None, buffer
        return Response(status, headers, rest[:length]), rest[length:]
    if eof:  # delimited by the close
        return Response(status, headers, rest), b""
    return None, buffer


@dataclass
class Client:
    """One raw TCP connection: the requests sent on it, the responses parsed from it, and
    how it ended (``eof``, ``reset``, ``timeout``; ``refused`` if the connect was)."""

    port: int
    sent: list[str] = field(default_factory=list)
    responses: list[Response] = field(default_factory=list)
    interim: list[Response] = field(default_factory=list)
    end: str | None = None
    sock: socket.socket | None = None
    buffer: bytes = b""

    @classmethod
    def connect(cls, port: int, timeout_s: float = 5.0) -> Client:
        client = cls(port)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            sock.close()
            client.end = "refused"
            return client
        except BaseException:
            sock.close()
            raise
        client.sock = sock
        _open.append(client)
        return client

    @property
    def refused(self) -> bool:
        return self.end == "refused"

    def send(self, data: bytes, *rids: str) -> bool:
        """Send ``data`` carrying the requests ``rids``; ``False`` if the connection
        failed (the requests count as sent all the same: the client cannot tell)."""
        self.sent.extend(rids)
        if self.sock is None:
            return False
        try:
            self.sock.sendall(data)
        except OSError as exc:
            self.end = self.end or _classify(exc)
            return False
        return True

    def request(self, path: str = "/", rid: str | None = None, **kwargs: object) -> bool:
        rid = rid or f"r{len(self.sent)}"
        return self.send(request_bytes(path, rid, **kwargs), rid)  # type: ignore[arg-type]

    @property
    def done(self) -> bool:
        return self.end is not None or len(self.responses) >= len(self.sent)

    def _feed(self, data: bytes) -> None:
        self.buffer += data
        eof = not data
        while True:
            response, self.buffer = parse_response(self.buffer, eof=eof)
            if response is None:
                break
            if 100 <= response.status < 200:
                self.interim.append(response)
            else:
                self.responses.append(response)
            if eof and not self.buffer:
                break

    def read_some(self) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            self.end = _classify(exc)
            return
        self._feed(data)
        if not data:
            self.end = "eof"

    def wait(self, timeout_s: float = 10.0) -> Client:
        collect([self], timeout_s)
        return self

    def response(self, timeout_s: float = 10.0) -> Response:
        """The next response not yet returned (waits for it); raises if the connection
        ended first."""
        want = len(self.responses) + 1
        deadline = time.monotonic() + timeout_s
        while len(self.responses) < want and self.end is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"no response within {timeout_s} s")
            collect([self], deadline - time.monotonic(), until=lambda c: len(c.responses) >= want)
        if len(self.responses) < want:
            raise AssertionError(f"connection ended ({self.end}) before response #{want}")
        return self.responses[want - 1]

    def closed_by_peer(self, timeout_s: float = 10.0) -> bool:
        """Read until EOF or reset (``True``), or ``timeout_s`` (``False``)."""
        collect([self], timeout_s, until=lambda c: c.end is not None)
        return self.end in ("eof", "reset")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        with contextlib.suppress(ValueError):
            _open.remove(self)


_open: list[Client] = []


def close_all_clients() -> None:
    while _open:
        _open[-1].close()


def _classify(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return "reset"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return f"error {exc.errno}"


def collect(clients: list[Client], timeout_s: float, *, until: object = None) -> None:
    """Read every client until it is done (all its responses, or ended) or
    ``until(client)`` holds, within ``timeout_s``; clients still waiting then end with
    ``timeout``."""
    check = until if callable(until) else (lambda c: c.done)
    deadline = time.monotonic() + timeout_s
    selector = selectors.DefaultSelector()
    timeouts = {id(c): c.sock.gettimeout() for c in clients if c.sock is not None}
    try:
        waiting = 0
        for client in clients:
            if client.sock is not None and client.end is None and not check(client):
                client.sock.setblocking(False)
                selector.register(client.sock, selectors.EVENT_READ, client)
                waiting += 1
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in selector.select(min(left, 0.5)):
                client = key.data
                client.read_some()
                if client.end is not None or check(client):
                    selector.unregister(key.fileobj)
                    waiting -= 1
        for key in list(selector.get_map().values()):
            if until is None:
                key.data.end = "timeout"
            selector.unregister(key.fileobj)
    finally:
        selector.close()
        for client in clients:
            if client.sock is not None:
                client.sock.settimeout(timeouts.get(id(client)))


@dataclass(frozen=True)
class Outcome:
    rid: str
    kind: str  # "ok", "refused", "lost"
    status: int | None = None
    detail: str = ""


def outcomes(clients: Iterable[Client]) -> list[Outcome]:
    """One outcome per request sent (or per refused connection)."""
    found = []
    for n, client in enumerate(clients):
        if client.refused and not client.sent:
            found.append(Outcome(f"conn{n}", "refused"))
        for i, rid in enumerate(client.sent):
            if i < len(client.responses):
                found.append(Outcome(rid, "ok", client.responses[i].status))
            elif client.refused:
                found.append(Outcome(rid, "refused"))
            else:
                found.append(Outcome(rid, "lost", detail=client.end or "open"))
    return found


def summarize(results: Iterable[Outcome]) -> str:
    """``"200/200 answered 200"`` or ``"150 x 200, 50 refused, 0 lost"``."""
    results = list(results)
    statuses = collections.Counter(r.status for r in results if r.kind == "ok")
    refused = sum(r.kind == "refused" for r in results)
    lost = [r for r in results if r.kind == "lost"]
    if len(statuses) == 1 and not refused and not lost:
        ((status, count),) = statuses.items()
        return f"{count}/{len(results)} answered {status}"
    parts = [f"{count} x {status}" for status, count in sorted(statuses.items())]
    resets = sum(r.kind == "refused" and r.detail == "reset at connect" for r in results)
    parts.append(f"{refused} refused" + (f" ({resets} reset at connect)" if resets else ""))
    detail = collections.Counter(r.detail for r in lost)
    parts.append(
        f"{len(lost)} lost"
        + (f" ({', '.join(f'{n} {d}' for d, n in detail.items())})" if lost else "")
    )
    return ", ".join(parts)


def lost(results: Iterable[Outcome]) -> list[Outcome]:
    return [r for r in results if r.kind == "lost"]


# ----------------------------------------------------------------- asyncio clients


class AsyncClients:
    """Many concurrent clients in one event loop (raw non-blocking sockets), for load.

    Each exchange returns an :class:`Outcome`; sockets are always closed.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.results: list[Outcome] = []

    async def connect(self, rid: str) -> socket.socket | None:
        """A connected socket, or ``None`` (and a ``refused`` outcome for ``rid``) if the
        connect failed: refused, or reset during the handshake — either way nothing was
        sent, so a client may retry."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", self.port)), 5)
        except (ConnectionRefusedError, ConnectionResetError) as exc:
            sock.close()
            detail = "" if isinstance(exc, ConnectionRefusedError) else "reset at connect"
            self.results.append(Outcome(rid, "refused", detail=detail))
            return None
        except BaseException:
            sock.close()
            raise
        return sock

    async def exchange(
        self, sock: socket.socket, data: bytes, rid: str, timeout_s: float, buffer: list[bytes]
    ) -> Response | None:
        """Send one request and read its response; ``None`` (and a ``lost`` outcome)
        if the connection failed after the send."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await loop.sock_sendall(sock, data)
            pending = buffer[0]
            while True:
                response, pending = parse_response(pending)
                if response is not None and response.status >= 200:
                    buffer[0] = pending
                    self.results.append(Outcome(rid, "ok", response.status))
                    return response
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), left)
                if not chunk:
                    self.results.append(Outcome(rid, "lost", detail="eof"))
                    return None
                pending += chunk
        except (OSError, asyncio.TimeoutError) as exc:
            self.results.append(
                Outcome(
                    rid, "lost", detail=_classify(exc) if isinstance(exc, OSError) else "timeout"
                )
            )
            return None
