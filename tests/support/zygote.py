"""A fork server for the tests' server processes: the imports once, a ``fork`` per server.

Most of what a test server process costs is its interpreter's start and its imports
(uvicorn, hypercorn, aiohttp, gunicorn, h2, graceful: 0.2 to 0.5 CPU-s), and the suite starts
over a thousand of them on two cores.  Each pytest worker therefore starts one *zygote*:
an interpreter that imports those packages (never an app, never a module that reads the
environment at import) and then, for each server, forks.  The child becomes
``python -m MODULE ARGS``, ``python SCRIPT ARGS`` or ``python -c CODE ARGS`` in the
requested directory, environment and session, with the requested pipe as its standard
output and error, and runs the program exactly as the interpreter's ``-m``, script and
``-c`` modes do (``runpy._run_module_as_main`` in a fresh ``__main__``).  The program's
exit — ``SystemExit``, an uncaught exception, ``KeyboardInterrupt`` — unwinds to the top
of the interpreter, which ends as a fresh one would: non-daemon threads joined, ``atexit``
run, modules and garbage collected.  It is a real process with its own pid and session,
real signals and real sockets; only the imports were made before the fork.

What a forked child cannot reproduce gets a fresh interpreter (``subprocess.Popen``, as
before): an interpreter option (``-u``, ``-X``, ``-W``), an environment that differs from
the zygote's in a variable that is not known to be read only at run time (``PYTHON*``
start-up settings, ``PROMETHEUS_MULTIPROC_DIR``, ``WEB_CONCURRENCY``…), ``pass_fds``, or
``GRACEFUL_TESTS_FRESH=1`` in the environment, which turns the zygote off for a whole run
(``.ci/run`` runs the other Python versions' subsets that way).  A test about start-up
itself can pass ``fresh=True`` to :class:`tests.support.servers.ServerProcess`;
``tests/test_zygote.py`` runs servers both ways and compares what they print.

The zygote is one process per pytest worker, started at the first server: a
``SOCK_SEQPACKET`` pair carries a JSON request with the pipe's descriptor attached, the
reply with the pid, and later the exit status (the zygote reaps its children through
pidfds).  When the worker's end closes, the zygote kills what it started and exits.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import io
import json
import locale
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: ``GRACEFUL_TESTS_FRESH=1``: every server process a fresh interpreter.
FRESH_ENV = "GRACEFUL_TESTS_FRESH"
#: Imported by the zygote before it forks: servers, protocols, loops and graceful itself.
#: None of them reads the environment or warns at import (checked by the zygote: a module
#: that warns is reported and the zygote exits, so that the list is corrected).
PRELOAD = (
    "asyncio",
    "concurrent.futures.thread",
    "logging.config",
    "ssl",
    "email.utils",
    "http.cookies",
    "multiprocessing.connection",
    "click",
    "h11",
    "httptools",
    "uvloop",
    "anyio",
    "anyio._backends._asyncio",
    "wsproto",
    "websockets.asyncio.server",
    "uvicorn",
    "uvicorn.main",
    "uvicorn.config",
    "uvicorn.server",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.wsproto_impl",
    "uvicorn.protocols.websockets.websockets_sansio_impl",
    "starlette.applications",
    "starlette.responses",
    "starlette.routing",
    "h2.connection",
    "trio",
    "hypercorn.asyncio",
    "hypercorn.trio",
    "hypercorn.config",
    "hypercorn.protocol",
    "hypercorn.middleware",
    "aiohttp.web",
    "gunicorn.app.wsgiapp",
    "gunicorn.arbiter",
    "gunicorn.workers.sync",
    "gunicorn.workers.gthread",
    "gunicorn.http.wsgi",
    "graceful",
    "graceful._cli.run",
    "graceful._cli.servers",
    "graceful._cli.workers",
    "graceful.asgi",
    "graceful.wsgi",
    "graceful.asyncio",
    "graceful.uvicorn",
    "graceful.hypercorn",
    "graceful.aiohttp",
    "graceful.gunicorn",
)
#: Variables the child's environment may change from the zygote's: read at run time only
#: (graceful's options, the test apps' switches, pytest's own, click's completion).  Any
#: other difference — a ``PYTHON*`` start-up setting, a variable a preloaded package
#: reads at import such as ``WEB_CONCURRENCY`` (gunicorn's default) or
#: ``AIOHTTP_NO_EXTENSIONS`` — needs a fresh interpreter.
RUN_TIME_VARIABLES = re.compile(
    r"GRACEFUL_(?!TESTS_FRESH$).*|FAULTS_.*|SELFTEST_BREAK|RUN_COORDINATOR|ZTTP_CHANGE"
    r"|APP_IMPORT_DELAY|APP_ATEXIT_HANG|COLUMNS|LINES|PYTEST_.*|PYTHONPATH|PYTHONUNBUFFERED"
    r"|PYTHONDONTWRITEBYTECODE|KUBE_CACHE_DIR|COMP_WORDS|COMP_CWORD|_GRACEFUL_COMPLETE"
)
#: The longest wait for the zygote's imports and for a reply to a request.
START_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 30.0


# ------------------------------------------------------------------------ the test side


class ForkedProcess:
    """What the tests use of ``subprocess.Popen``, for a process the zygote forked."""

    def __init__(self, client: _Client, args: list[str], pid: int, stdout: io.TextIOWrapper):
        self._client = client
        self.args = args
        self.pid = pid
        self.stdout: io.TextIOWrapper | None = stdout
        self.returncode: int | None = None

    def __del__(self) -> None:
        # As Popen's: a process the test never waited for is a leak, and the suite makes
        # warnings errors.
        if self.returncode is None and self.pid not in self._client._statuses:
            warnings.warn(
                f"subprocess {self.pid} is still running",
                ResourceWarning,
                stacklevel=1,
                source=self,
            )

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._client.status(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            status = self._client.status(self.pid, timeout)
            if status is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = status
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Client:
    """This process's zygote: started at the first request, one reader thread for its
    replies (pids and exit statuses)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        base = os.environ if _BASELINE is None else _BASELINE
        env = {k: v for k, v in base.items() if k != "PYTEST_CURRENT_TEST"}
        env["PYTHONUNBUFFERED"] = "1"
        self.env = env
        self.sock = ours
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", str(theirs.fileno())],
            cwd=ROOT,
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        theirs.close()
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._statuses: dict[int, int] = {}
        self._next = 0
        self.alive = True
        self.ready = False
        self.error = ""
        self._lock = threading.Lock()  # one request at a time: its descriptor goes with it
        threading.Thread(target=self._read, daemon=True, name="zygote-replies").start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._cond:
                if "ready" in message:
                    self.ready = True
                elif "exit" in message:
                    self._statuses[message["exit"]] = message["status"]
                else:
                    self._replies[message["id"]] = message
                self._cond.notify_all()
        with self._cond:
            self.alive = False
            assert self.process.stderr is not None
            with contextlib.suppress(OSError, ValueError):
                self.error = self.process.stderr.read().decode(errors="replace")[-2000:]
            self._cond.notify_all()

    def status(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._statuses or not self.alive, timeout)
            if pid not in self._statuses and not self.alive:
                raise RuntimeError(f"the zygote is gone; its exit status of {pid} is lost")
            return self._statuses.get(pid)

    def spawn(
        self, args: list[str], cwd: str, env: Mapping[str, str], session: bool, fds: list[int]
    ) -> int | None:
        """Fork ``args`` with ``fds`` as its standard output and error (one descriptor:
        both); its pid, or ``None`` if the zygote could not fork."""
        with self._lock:
            with self._cond:
                if not self._cond.wait_for(lambda: self.ready or not self.alive, START_TIMEOUT_S):
                    raise RuntimeError(f"the zygote did not start in {START_TIMEOUT_S} s")
                if not self.alive:
                    raise RuntimeError(f"the zygote is gone:\n{self.error}")
                self._next += 1
                ident = self._next
            request = {"id": ident, "argv": args[1:], "cwd": cwd, "env": dict(env)}
            request["session"] = session
            # A child inherits the signal mask of the thread that starts it, and what its
            # parent ignores (Popen's restore_signals gives back the three Python ignores).
            request["mask"] = sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))
            request["ignored"] = [
                int(sig)
                for sig in signal.valid_signals()
                if sig not in _PYTHON_IGNORES and signal.getsignal(sig) is signal.SIG_IGN
            ]
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            with self._cond:
                self._cond.wait_for(
                    lambda: ident in self._replies or not self.alive, REPLY_TIMEOUT_S
                )
                reply = self._replies.pop(ident, None)
        return None if reply is None else reply.get("pid")

    def forkable(self, env: Mapping[str, str]) -> bool:
        """Whether a child with ``env`` behaves as a fresh interpreter would (the
        zygote's children are unbuffered: a buffered one loses what it printed when it
        dies by a signal or ``os._exit``)."""
        if env.get("PYTHONUNBUFFERED") != "1":
            return False
        for name in set(env) | set(self.env):
            if env.get(name) != self.env.get(name) and not RUN_TIME_VARIABLES.fullmatch(name):
                return False
        return True


_CLIENT: _Client | None = None
#: The environment the zygote starts with (see :func:`remember_environment`).
_BASELINE: dict[str, str] | None = None
#: Signals a fresh interpreter ignores itself, and Popen restores to their default.
_PYTHON_IGNORES = frozenset(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, name)
)


def remember_environment() -> None:
    """Take this process's environment now (pytest's configuration, before any test's
    ``monkeypatch.setenv``) as the zygote's: a server started by a test whose changes
    are all run-time variables is forked, others get a fresh interpreter."""
    global _BASELINE
    _BASELINE = dict(os.environ)


_CLIENT_LOCK = threading.Lock()


def _program(args: list[str]) -> bool:
    """``[python, -m, MODULE, …]``, ``[python, -c, CODE, …]`` or ``[python, SCRIPT, …]``."""
    if len(args) < 2 or args[0] != sys.executable:
        return False
    if args[1] in ("-m", "-c"):
        return len(args) >= 3
    return not args[1].startswith("-")


def _client(args: list[str], env: Mapping[str, str], fresh: bool) -> _Client | None:
    """This process's zygote, if it can run ``args`` with ``env``."""
    global _CLIENT
    if fresh or os.environ.get(FRESH_ENV) == "1" or not _program(args):
        return None
    with _CLIENT_LOCK:
        if _CLIENT is None:
            _CLIENT = _Client()
        client = _CLIENT
    return client if client.forkable(env) else None


def _fork(
    client: _Client, args: list[str], cwd: Path, env: dict[str, str], session: bool, fds: list[int]
) -> int:
    try:
        pid = client.spawn(args, str(cwd), env, session, fds)
    finally:
        for fd in fds:
            os.close(fd)
    if pid is None:
        raise RuntimeError(f"the zygote did not fork {args}:\n{client.error}")
    return pid


def popen(
    args: list[str], *, cwd: Path, env: dict[str, str], start_new_session: bool, fresh: bool
) -> Any:
    """A process running ``args`` whose merged output is its ``stdout`` (text): forked by
    the zygote when it can be, else ``subprocess.Popen``."""
    client = _client(args, env, fresh)
    if client is None:
        return subprocess.Popen(
            args,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=start_new_session,
        )
    read, write = os.pipe()
    pid = _fork(client, args, cwd, env, start_new_session, [write])
    stdout = open(read, encoding=locale.getpreferredencoding(False))  # noqa: SIM115
    return ForkedProcess(client, args, pid, stdout)


def run(
    args: list[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True)``: forked by the zygote
    when it can be.  A process still running at ``timeout`` is killed and
    ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    env = dict(os.environ if env is None else env)
    client = _client(args, env, fresh)
    if client is None:
        return subprocess.run(
            args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    pid = _fork(client, args, cwd, env, False, [out_write, err_write])
    process = ForkedProcess(client, args, pid, None)
    encoding = locale.getpreferredencoding(False)
    captured: dict[int, str] = {}

    def drain(fd: int) -> None:
        with open(fd, encoding=encoding) as stream:
            captured[fd] = stream.read()

    readers = [
        threading.Thread(target=drain, args=(fd,), daemon=True) for fd in (out_read, err_read)
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(REPLY_TIMEOUT_S)
        raise
    for reader in readers:  # a child of the process may still hold the pipes
        reader.join(max(0.0, deadline - time.monotonic()))
        if reader.is_alive():
            raise subprocess.TimeoutExpired(args, timeout)
    return subprocess.CompletedProcess(
        args, code, captured.get(out_read, ""), captured.get(err_read, "")
    )


# ---------------------------------------------------------------------- the zygote side


def _preload() -> None:
    for name in PRELOAD:
        # ``python -m package`` warns if the package's __main__ was imported before.
        assert not name.endswith("__main__"), name
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            probe = warnings.filters[0]
            try:
                importlib.import_module(name)
            except ImportError:
                continue
            kept = [f for f in warnings.filters if f is not probe]
        warnings.filters[:] = kept
        warnings._filters_mutated()  # type: ignore[attr-defined]
        if caught:
            raise SystemExit(f"zygote: importing {name} warned: {caught[0].message}")
    if threading.active_count() != 1:
        raise SystemExit(f"zygote: the imports started threads: {threading.enumerate()}")


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork on each request; reap and report.  Returns the request in a child, ``None``
    in the zygote once the test process is gone."""
    import gc

    gc.collect()
    gc.freeze()  # the children's collections do not touch (copy) the preloaded objects
    children: dict[int, int] = {}  # pidfd -> pid
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        sock.send(json.dumps({"ready": True}).encode())
        while True:
            for key, _ in selector.select():
                if key.fileobj is sock:
                    try:
                        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 2)
                    except OSError:
                        data, fds = b"", []
                    if not data:
                        for pid in children.values():
                            with contextlib.suppress(OSError):
                                os.killpg(pid, signal.SIGKILL)
                            with contextlib.suppress(OSError):
                                os.kill(pid, signal.SIGKILL)
                        return None
                    request = json.loads(data)
                    try:
                        pid = os.fork()
                    except OSError as exc:
                        for fd in fds:
                            os.close(fd)
                        sock.send(json.dumps({"id": request["id"], "error": str(exc)}).encode())
                        continue
                    if pid == 0:
                        selector.close()
                        for pidfd in children:
                            os.close(pidfd)
                        sock.close()
                        request["fds"] = fds
                        return request
                    for fd in fds:
                        os.close(fd)
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = pid
                    selector.register(pidfd, selectors.EVENT_READ)
                    sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())
                else:
                    pidfd = key.fd
                    pid = children.pop(pidfd)
                    selector.unregister(pidfd)
                    os.close(pidfd)
                    _, status = os.waitpid(pid, 0)
                    code = os.waitstatus_to_exitcode(status)
                    sock.send(json.dumps({"exit": pid, "status": code}).encode())


def _trimmed(hook: Any) -> Any:
    """``hook`` shown the traceback a fresh interpreter has: without the frames of the
    zygote's own start (runpy's two, this module's, ``_become``)."""

    def excepthook(typ: Any, value: Any, tb: Any) -> None:
        frame = tb
        while frame is not None:
            if frame.tb_frame.f_code is _become.__code__:
                tb = frame.tb_next
                if isinstance(value, BaseException):
                    value.__traceback__ = tb  # what the display prints
                break
            frame = frame.tb_next
        hook(typ, value, tb)

    excepthook.__wrapped__ = hook  # type: ignore[attr-defined]
    return excepthook


def _become(request: dict[str, Any]) -> None:
    """In the forked child: become the requested program (its exceptions and exit unwind
    to the interpreter, which ends as it would for ``python -m``)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, request["mask"])
    # SIGINT: ignored by the zygote (a Ctrl-C meant for pytest), Python's own handler in
    # a fresh interpreter unless its parent ignored it.
    ignore_int = signal.SIGINT in request["ignored"]
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_int else signal.default_int_handler)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT) or sig in _PYTHON_IGNORES:
            continue
        ignored = signal.getsignal(sig) is signal.SIG_IGN
        if sig in request["ignored"] and not ignored:
            signal.signal(sig, signal.SIG_IGN)
        elif ignored and sig not in request["ignored"]:
            signal.signal(sig, signal.SIG_DFL)
    if request["session"]:
        os.setsid()
    out, err = request["fds"] if len(request["fds"]) == 2 else request["fds"] * 2
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in set(request["fds"]):
        os.close(fd)
    cwd = request["cwd"]
    os.chdir(cwd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    importlib.invalidate_caches()
    argv = request["argv"]
    sys.excepthook = _trimmed(sys.excepthook)
    # As getpath does: every PYTHONPATH entry made absolute ("" is the directory), in
    # place of the zygote's own.
    value = env.get("PYTHONPATH", "")
    extra = [os.path.abspath(entry) for entry in value.split(os.pathsep)] if value else []
    sys.path[1:] = _BASE_PATH
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if argv[0] == "-m":
        sys.path[:1] = [cwd, *extra]
        sys.argv = ["-m", *argv[2:]]
        import runpy

        runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
    elif argv[0] == "-c":
        sys.path[:1] = ["", *extra]
        sys.argv = ["-c", *argv[2:]]
        main.__loader__ = importlib.machinery.BuiltinImporter
        exec(compile(argv[1], "<string>", "exec", dont_inherit=True), main.__dict__)
    else:
        script = os.path.join(cwd, argv[0])
        sys.path[:1] = [os.path.dirname(os.path.realpath(script)), *extra]
        sys.argv = list(argv)
        main.__file__ = script
        main.__cached__ = None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
        try:
            with open(script, "rb") as source:
                text = source.read()
        except OSError as exc:
            print(
                f"{sys.executable}: can't open file {script!r}: [Errno {exc.errno}] {exc.strerror}",
                file=sys.stderr,
            )
            sys.exit(2)
        exec(compile(text, script, "exec", dont_inherit=True), main.__dict__)


if __name__ == "__main__":
    # Its children get the mask of the thread that asks for them, not the one that
    # happened to start the zygote.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    # A Ctrl-C at the terminal reaches the whole process group: pytest tears the tests'
    # servers down, and needs the zygote for their exit statuses.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _own = os.environ.get("PYTHONPATH", "")
    #: sys.path after the script's directory and the zygote's own PYTHONPATH entries.
    _BASE_PATH = sys.path[1 + (len(_own.split(os.pathsep)) if _own else 0) :]
    _preload()
    _request = _serve(socket.socket(fileno=int(sys.argv[1])))
    if _request is not None:
        _become(_request)
