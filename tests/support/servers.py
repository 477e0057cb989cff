"""Real server processes for integration tests: start, wait for log lines, signal, reap."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from graceful._core.coordinator import DUPLICATE_WINDOW_S

from . import zygote

ROOT = Path(__file__).resolve().parents[2]

#: Options per policy, short enough for tests, by option name (``max_wait``: ``--max-wait``
#: on a command line, ``GRACEFUL_MAX_WAIT`` under gunicorn).
POLICY_OPTIONS: dict[str, dict[str, str]] = {
    "accept-until-idle": {"policy": "accept-until-idle", "idle": "1"},
    "serve-until-killed": {"policy": "serve-until-killed", "max_wait": "1.5"},
    "refuse-immediately": {"policy": "refuse-immediately"},
}


def command_line(options: Mapping[str, str]) -> list[str]:
    """``{"max_wait": "1.5", "uvloop": ""}`` as ``["--max-wait", "1.5", "--uvloop"]``: an
    option whose value is ``""`` is a flag."""
    args: list[str] = []
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", value] if value else [f"--{key}"]
    return args


#: Command-line options per policy, short enough for tests.
POLICIES = {name: command_line(options) for name, options in POLICY_OPTIONS.items()}
#: Log lines of the coordinator's phase changes.
ACCEPTING = r"serving -> accepting: SIGTERM"
DRAINING = r"accepting -> draining"
STOPPED = r"stopping -> stopped"


def sigstop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (``/proc``).  The stop takes effect
    asynchronously: a signal sent meanwhile may still be delivered first, and a
    connection accepted, by a process the test takes for stopped."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: _state(pid) in ("T", "t"), timeout_s, f"process {pid} stopped")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


class ServerProcess:
    """A server subprocess whose merged output is read line by line in a thread.

    Tests wait on log lines (``wait_for_line``) or on the exit, never on the clock.
    """

    def __init__(
        self, args: list[str], *, env: dict[str, str] | None = None, fresh: bool = False
    ) -> None:
        """``fresh``: a fresh interpreter even where the zygote could fork it (a test of
        what happens at start-up; see :mod:`tests.support.zygote`)."""
        self.args = args
        self.lines: list[str] = []
        self._sent: dict[int, float] = {}  # signal -> when it was last sent
        self._cond = threading.Condition()
        self.proc = zygote.popen(
            args,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # stop() kills the whole group (gunicorn's workers too)
            fresh=fresh,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port = 0
        #: The process that serves and gets signals meant for it alone (gunicorn: the
        #: worker; otherwise the process itself).
        self.worker_pid = self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(
        self, pattern: str, timeout_s: float = 15.0, *, count: int = 1
    ) -> re.Match[str]:
        """Wait until ``count`` output lines match ``pattern``; return the last match."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        matches: list[re.Match[str]] = []
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if match := regex.search(line):
                        matches.append(match)
                        if len(matches) >= count:
                            return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"{len(matches)} of {count} lines matching {pattern!r} within "
                        f"{timeout_s} s; output:\n" + self.output()
                    )
                self._cond.wait(min(left, 0.5))

    def has_line(self, pattern: str) -> bool:
        with self._cond:
            return any(re.search(pattern, line) for line in self.lines)

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def signal(self, sig: int = signal.SIGTERM, *, at_once: bool = False) -> None:
        """Send ``sig``.  A repeat of the same signal is sent only once graceful's
        duplicate window has passed since the previous one (a repeat within it is one
        event, not an escalation: see ``graceful._core.coordinator.DUPLICATE_WINDOW_S``), so
        that a test's deliberate second signal is one; ``at_once`` sends it now."""
        last = self._sent.get(sig)
        if last is not None and not at_once:
            due = last + DUPLICATE_WINDOW_S + 0.05
            while time.monotonic() < due:
                time.sleep(due - time.monotonic())
        if sig == signal.SIGSTOP:
            sigstop(self.proc.pid)
        else:
            self.proc.send_signal(sig)
        self._sent[sig] = time.monotonic()

    def signal_worker(self, sig: int) -> None:
        """``sig`` to :attr:`worker_pid`.  A repeat of a signal sent to the process (which
        a gunicorn master relays) is sent a whole duplicate window after now — the worker
        got the relay at some moment before the caller saw its effect — so that it is a
        deliberate second signal (see :meth:`signal`)."""
        if sig in self._sent:
            due = time.monotonic() + DUPLICATE_WINDOW_S + 0.05
            while time.monotonic() < due:
                time.sleep(due - time.monotonic())
        if sig == signal.SIGSTOP:
            sigstop(self.worker_pid)
        else:
            os.kill(self.worker_pid, sig)

    def wait_exit(self, timeout_s: float = 15.0) -> int:
        """The exit status, once the process exited and its last output lines were read
        (the reader may lag behind the exit: ``has_line`` and ``output`` right after
        this see everything the process wrote)."""
        try:
            status = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"process still running after {timeout_s} s; output:\n{self.output()}"
            ) from None
        # EOF comes once every holder of the pipe is gone: a worker that outlives its
        # parent for a moment still may hold it, so the wait is bounded.
        self._reader.join(5.0)
        return status

    def _descendants(self) -> list[int]:
        """Child processes, found through /proc (graceful run's workers have their own
        sessions, so killing our process group does not reach them)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(entry.name))
        found, todo = [], [self.proc.pid]
        while todo:
            for child in children.get(todo.pop(), []):
                found.append(child)
                todo.append(child)
        return found

    def stop(self) -> None:
        # The tree first (it is lost once the parent is gone), then the parent's group
        # at once: a gunicorn master killed after its worker would log the worker's
        # SIGKILL as an error first.
        descendants = self._descendants()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in descendants:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        self._reader.join(5)
        # Closing the pipe while the reader thread still reads it would deadlock.
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()


def graceful_run(*options: str, app: str = "examples.asgi_app:app") -> ServerProcess:
    """Start ``graceful run`` on a free port and wait until it listens."""
    server = ServerProcess([sys.executable, "-m", "graceful", "run", app, "--port", "0", *options])
    server.port = int(server.wait_for_line(r"running on http://127\.0\.0\.1:(\d+)").group(1))
    return server


def stock_uvicorn(*options: str, app: str = "examples.asgi_app:app") -> ServerProcess:
    server = ServerProcess([sys.executable, "-m", "uvicorn", app, "--port", "0", *options])
    server.port = int(server.wait_for_line(r"running on http://127\.0\.0\.1:(\d+)").group(1))
    return server


#: hypercorn's launcher for the tests (``graceful.hypercorn.run``, or ``--stock``).
HYPERCORN_LAUNCH = str(ROOT / "tests" / "support" / "hypercorn_apps" / "launch.py")
#: The line hypercorn logs once it listens.
HYPERCORN_RUNNING = r"Running on http://127\.0\.0\.1:(\d+)"


def hypercorn_launch(
    *options: str, worker: str = "asyncio", env: dict[str, str] | None = None
) -> ServerProcess:
    """Start ``hypercorn_apps/launch.py`` (with its access log) on a free port and wait
    until it listens.  The caller stops it."""
    server = ServerProcess(
        [sys.executable, HYPERCORN_LAUNCH, "--worker", worker, "--access-log", *options], env=env
    )
    server.port = int(server.wait_for_line(HYPERCORN_RUNNING).group(1))
    return server


#: The aiohttp test app (``aiohttp_apps/app.py``) and the ways it is served.
AIOHTTP_APP = "tests.support.aiohttp_apps.app"
AIOHTTP_MODES = ["run_app", "runner", "gunicorn"]
#: Options graceful reads from GRACEFUL_* under gunicorn.
GUNICORN_ENV_OPTIONS = ("policy", "idle", "max_wait", "drain_timeout", "websocket_close_grace",
                        "prestop_path")  # fmt: skip


def aiohttp_command(mode: str, options: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that serve the aiohttp test app in ``mode``
    (``run_app``, ``runner``, ``stock`` or ``gunicorn``: one ``graceful.gunicorn.AiohttpWorker``
    whose master gets the signals, as in a container) with ``options``."""
    if mode != "gunicorn":
        return [sys.executable, "-m", AIOHTTP_APP, mode, "--port", "0", *command_line(options)], {}
    rest = dict(options)
    grace = rest.pop("grace_period", "10")
    backlog = rest.pop("backlog", "2048")
    env = {f"GRACEFUL_{k.upper()}": rest.pop(k) for k in GUNICORN_ENV_OPTIONS if k in rest}
    assert not rest, f"no gunicorn option for {rest}"
    command = [
        sys.executable, "-m", "gunicorn", f"{AIOHTTP_APP}:app",
        "-k", "graceful.gunicorn.AiohttpWorker", "-w", "1",
        "-b", "127.0.0.1:0", "--graceful-timeout", grace, "--timeout", "3", "--backlog", backlog,
    ]  # fmt: skip
    return command, env


def aiohttp_ready(server: ServerProcess, mode: str) -> ServerProcess:
    """Wait until the aiohttp test app serves; set the server's port and worker."""
    if mode != "gunicorn":
        server.port = int(server.wait_for_line(r"Running on http://127\.0\.0\.1:(\d+)")[1])
        return server
    server.port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)")[1])
    server.worker_pid = int(server.wait_for_line(r"Booting worker with pid: (\d+)")[1])
    server.wait_for_line(r"aiohttp worker serving on")
    return server


def silent_websocket(port: int, path: str = "/ws") -> socket.socket:
    """A websocket client that completes the handshake and then never reads, writes or
    answers a close frame: only the server can end it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nhost: test\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
        f"sec-websocket-key: {key}\r\nsec-websocket-version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def wait_for(condition: object, timeout_s: float, what: str, *, poll_s: float = 0.005) -> None:
    """Poll ``condition()`` (a cheap read of /proc or of a socket) until true.

    Raises:
        AssertionError: naming ``what`` if ``timeout_s`` elapsed first.
    """
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(poll_s)


def sigkill_expected_in(output: str) -> list[float]:
    """The "SIGKILL expected in N s" of each ``serving -> accepting`` line in ``output``.
    The kill deadline is the grace period from when the coordinator's loop took the
    signal; the line reads the clock again when the accepting transition is dispatched,
    after the deadlines were planned (which starts a hard-exit worker's watchdog thread):
    on a loaded machine N is up to a second below the grace period (CI: 0.7 s below a
    1 s one)."""
    found = re.findall(r"serving -> accepting: .*SIGKILL expected in ([\d.]+) s", output)
    return [float(n) for n in found]


def connection_refused(port: int) -> bool:
    """``True`` if a TCP connect to ``port`` is refused (not accepted, not reset).

    A reset before ``connect`` returns is a listener caught closing: the handshake put the
    connection in its accept queue and the close reset it, unaccepted.  That is not a
    refusal yet; a poll asks again.
    """
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False
    return False


def decoded_body(headers: Mapping[str, str], body: bytes) -> bytes:
    """``body`` as :meth:`RawHTTP.response` returned it, without its chunked framing."""
    if headers.get("transfer-encoding") != "chunked":
        return body
    decoded, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        length = int(size.split(b";")[0], 16)
        decoded, rest = decoded + rest[:length], rest[length + 2 :]
    return decoded


class RawHTTP:
    """One HTTP/1.1 connection over a raw socket, for keep-alive behaviour.

    Every instance is closed by :func:`close_all` (an autouse fixture calls it).
    """

    opened: ClassVar[list[RawHTTP]] = []

    def __init__(self, port: int, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self._buffer = b""
        RawHTTP.opened.append(self)

    @classmethod
    def close_all(cls) -> None:
        while cls.opened:
            cls.opened.pop().close()

    @classmethod
    def get_once(cls, port: int, path: str) -> tuple[int, dict[str, str], bytes]:
        """``GET path`` on a connection of its own, closed after the response as a probe
        or curl closes it: no idle keep-alive connection left for the drain to give its
        ``idle_grace_s`` (a second) before closing it."""
        client = cls(port)
        try:
            return client.get(path)
        finally:
            client.close()

    def send(self, path: str, *, headers: str = "") -> None:
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nhost: test\r\n{headers}\r\n".encode())

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionResetError(f"closed before a response: {self._buffer!r}")
            self._buffer += chunk
        head, _, rest = self._buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }
        if headers.get("transfer-encoding") == "chunked":
            while b"0\r\n\r\n" not in rest:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError("closed mid-body")
                rest += chunk
            body, _, self._buffer = rest.partition(b"0\r\n\r\n")
        else:
            length = int(headers.get("content-length", "0"))
            while len(rest) < length:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError("closed mid-body")
                rest += chunk
            body, self._buffer = rest[:length], rest[length:]
        return int(lines[0].split()[1]), headers, body

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        self.send(path)
        return self.response()

    def has_data(self, timeout_s: float = 0.0) -> bool:
        """Whether the server sent something not read yet, or closed, within
        ``timeout_s``."""
        readable, _, _ = select.select([self.sock], [], [], timeout_s)
        return bool(self._buffer) or bool(readable)

    def closed_by_peer(self, timeout_s: float = 10.0) -> bool:
        """Wait until the server closes the connection (EOF or reset)."""
        self.sock.settimeout(timeout_s)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def metric(port: int, name: str) -> float:
    """The value of the unlabelled metric ``name`` on ``/metrics`` (a new connection)."""
    status, _, body = RawHTTP(port).get("/metrics")
    assert status == 200, (status, body)
    found = re.search(rf"(?m)^{name} (\S+)$", body.decode())
    assert found, body
    return float(found[1])


def h2_tls_request_across_sigterm(server: ServerProcess, cert: str, path: str) -> Any:
    """Over TLS with ALPN h2 (httpx): one request first, then ``path`` — which must
    print ``slow request started`` — in flight while ``server`` gets SIGTERM; its
    response (an ``httpx.Response``)."""
    import httpx

    context = ssl.create_default_context(cafile=cert)
    result: dict[str, Any] = {}
    with httpx.Client(http1=False, http2=True, verify=context, timeout=15) as client:
        url = f"https://127.0.0.1:{server.port}"
        assert client.get(f"{url}/").http_version == "HTTP/2"
        thread = threading.Thread(
            target=lambda: result.setdefault("response", client.get(f"{url}{path}"))
        )
        thread.start()
        server.wait_for_line(r"slow request started")
        server.signal(signal.SIGTERM)
        thread.join(15)
    assert "response" in result, f"no response to {path}"
    return result["response"]
