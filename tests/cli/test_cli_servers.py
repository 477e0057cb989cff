"""``graceful run`` with uvicorn's own options and with ``--server hypercorn|aiohttp``:
real server processes on loopback (or a unix socket), real clients, real signals.

Every wait is on an output line, a response or an exit, each with a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_cli import workers
from tests.support.servers import ACCEPTING, STOPPED, RawHTTP, ServerProcess, sigstop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")

#: A raw ASGI app (no framework, so it runs on asyncio and trio) that answers with what
#: it saw; ``…/slow`` takes 1.5 s.  ``VERSION`` changes to test ``--reload``.
APP = """\
import json, sys
import anyio

VERSION = "{version}"


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({{"type": "lifespan.startup.complete"}})
            elif message["type"] == "lifespan.shutdown":
                await send({{"type": "lifespan.shutdown.complete"}})
                return
    if scope["type"] != "http":
        return
    if scope["path"].endswith("/slow"):
        sys.stdout.write("slow request started\\n")
        sys.stdout.flush()
        await anyio.sleep(1.5)
    client = scope.get("client")
    body = json.dumps({{
        "version": VERSION, "client": client and client[0], "scheme": scope["scheme"],
        "root_path": scope.get("root_path", ""), "path": scope["path"],
    }}).encode()
    await send({{"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
    ]}})
    await send({{"type": "http.response.body", "body": body}})


def create_app():
    sys.stdout.write("factory called\\n")
    sys.stdout.flush()
    return app
"""
AIOHTTP_APP = "tests.support.aiohttp_apps.app:app"
UVICORN_RUNNING = r"running on http://127\.0\.0\.1:(\d+)"
HYPERCORN_RUNNING = r"Running on http://127\.0\.0\.1:(\d+)"
AIOHTTP_RUNNING = r"aiohttp running on http://127\.0\.0\.1:(\d+)"
FAST = ["--policy", "refuse-immediately", "--grace-period", "10"]


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "echoapp.py").write_text(APP.format(version="1"))
    return tmp_path


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    servers: list[ServerProcess] = []
    yield servers
    RawHTTP.close_all()
    for server in servers:
        server.stop()


def start(
    started: list[ServerProcess], *args: str, running: str | None = UVICORN_RUNNING
) -> ServerProcess:
    server = ServerProcess([sys.executable, "-m", "graceful", "run", *args])
    started.append(server)
    if running is not None:
        server.port = int(server.wait_for_line(running).group(1))
    return server


def connect(port: int | None = None, *, path: str | None = None) -> socket.socket:
    if path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(path)
        return sock
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def send(sock: socket.socket, target: str, headers: str = "") -> None:
    sock.sendall(
        f"GET {target} HTTP/1.1\r\nhost: test\r\n{headers}connection: close\r\n\r\n".encode()
    )


def response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of a ``connection: close`` response, read until EOF."""
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data
    return int(head.split()[1]), body


def get(sock: socket.socket, target: str = "/", headers: str = "") -> dict[str, str]:
    send(sock, target, headers)
    status, body = response(sock)
    assert status == 200, body
    result: dict[str, str] = json.loads(body)
    return result


def drains_in_flight(server: ServerProcess, sock: socket.socket, *, stopped: int = 1) -> None:
    """A slow request in flight at SIGTERM completes; the process exits 0."""
    send(sock, "/slow")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    assert response(sock)[0] == 200
    assert server.wait_exit() == 0
    assert server.output().count("stopping -> stopped") == stopped, server.output()


# ------------------------------------------------------------------ uvicorn's options


def test_reload_restarts_on_change_then_sigterm_drains(
    started: list[ServerProcess], app_dir: Path
) -> None:
    # The default policy (accept-until-idle, idle 2 s): a restart drains at once anyway.
    server = start(
        started, "echoapp:app", "--port", "0", "--reload", "--reload-dir", str(app_dir),
        "--app-dir", str(app_dir), "--grace-period", "10",
    )  # fmt: skip
    server.wait_for_line(r"Application startup complete")
    assert get(connect(server.port))["version"] == "1"
    # uvicorn's reloader arms its file watcher some time after the server started (with
    # watchfiles 1.3 here, up to a second or two): change the file until it notices.
    deadline = time.monotonic() + 15
    while "Reloading" not in server.output():
        assert time.monotonic() < deadline, server.output()
        # A new size as well as a new mtime: the run caches bytecode (tests/support/
        # bytecode.py), checked against its source's size and mtime in whole seconds, so a
        # same-size edit within the second the server compiled the module loads the old
        # code (version 1 after the reload, seen under load).
        (app_dir / "echoapp.py").write_text(APP.format(version="2") + "# version 2\n")
        with contextlib.suppress(AssertionError):
            server.wait_for_line(r"Reloading", timeout_s=0.5)
    server.wait_for_line(STOPPED)  # the old server drained, without an idle window:
    assert "policy refuse-immediately; kill deadline: grace period 10 s" in server.output()
    server.wait_for_line(r"Application startup complete", count=2)
    assert get(connect(server.port))["version"] == "2"
    drains_in_flight(server, connect(server.port), stopped=2)


def test_factory(started: list[ServerProcess], app_dir: Path) -> None:
    server = start(started, "echoapp:create_app", "--factory", "--app-dir", str(app_dir),
                   "--port", "0", *FAST)  # fmt: skip
    server.wait_for_line(r"factory called")
    assert get(connect(server.port))["path"] == "/"
    drains_in_flight(server, connect(server.port))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_uds(started: list[ServerProcess], app_dir: Path, workers: str) -> None:
    path = str(app_dir / "server.sock")
    server = start(
        started, "echoapp:app", "--app-dir", str(app_dir), "--uds", path,
        "--workers", workers, *FAST, running=None,
    )  # fmt: skip
    if workers == "1":
        server.wait_for_line(r"running on unix socket")
    else:
        server.wait_for_line(r"worker \d+ serves", count=2)
    assert get(connect(path=path))["client"] is None  # no peer address on a unix socket
    drains_in_flight(server, connect(path=path), stopped=int(workers))
    assert not os.path.exists(path)


#: Binds a unix socket, then becomes ``graceful run --fd`` with it (argv: path, options).
FD_LAUNCHER = """\
import os, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.bind(sys.argv[1])
sock.listen(100)
os.set_inheritable(sock.fileno(), True)
os.execv(sys.executable, [sys.executable, "-m", "graceful", "run", *sys.argv[2:],
                          "--fd", str(sock.fileno())])
"""


def test_fd(started: list[ServerProcess], app_dir: Path) -> None:
    path = str(app_dir / "fd.sock")
    server = ServerProcess([sys.executable, "-c", FD_LAUNCHER, path, "echoapp:app",
                            "--app-dir", str(app_dir), *FAST])  # fmt: skip
    started.append(server)
    server.wait_for_line(r"running on socket")
    assert get(connect(path=path))["version"] == "1"
    drains_in_flight(server, connect(path=path))


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (openssl's command line: the
    ``cryptography`` package is not a test dependency)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def tls_connect(port: int, cert: str) -> socket.socket:
    context = ssl.create_default_context(cafile=cert)
    return context.wrap_socket(connect(port), server_hostname="127.0.0.1")


@pytest.mark.parametrize("server_name", ["uvicorn", "hypercorn", "aiohttp"])
def test_ssl(
    started: list[ServerProcess], app_dir: Path, certificate: tuple[str, str], server_name: str
) -> None:
    cert, key = certificate
    app = AIOHTTP_APP if server_name == "aiohttp" else "echoapp:app"
    running = {
        "uvicorn": r"running on https://127\.0\.0\.1:(\d+)",
        "hypercorn": r"Running on https://127\.0\.0\.1:(\d+)",
        "aiohttp": r"aiohttp running on https://127\.0\.0\.1:(\d+)",
    }[server_name]
    server = start(
        started, app, "--server", server_name, "--app-dir", str(app_dir), "--port", "0",
        "--ssl-certfile", cert, "--ssl-keyfile", key, *FAST, running=running,
    )  # fmt: skip
    sock = tls_connect(server.port, cert)
    send(sock, "/slow" if server_name != "aiohttp" else "/slow?s=1.5")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    assert response(sock)[0] == 200
    assert server.wait_exit() == 0


TLS_RUNNING = {
    "uvicorn": r"running on https://127\.0\.0\.1:(\d+)",
    "hypercorn": r"Running on https://127\.0\.0\.1:(\d+)",
    "aiohttp": r"aiohttp running on https://127\.0\.0\.1:(\d+)",
}


@pytest.mark.parametrize("server_name", ["uvicorn", "hypercorn", "aiohttp"])
def test_tls_backlog_queued_at_sigterm_is_served(
    started: list[ServerProcess], app_dir: Path, certificate: tuple[str, str], server_name: str
) -> None:
    """The accept race over TLS, made likely: stop the server (SIGSTOP), queue 20 TLS
    clients in the kernel's backlog, SIGTERM (refuse-immediately: draining at once),
    SIGCONT.  Each queued connection does its handshake and gets its answer — none is
    reset (hypercorn and aiohttp closed TLS listeners the stock way before)."""
    cert, key = certificate
    app = AIOHTTP_APP if server_name == "aiohttp" else "echoapp:app"
    server = start(
        started, app, "--server", server_name, "--loop", "asyncio", "--app-dir", str(app_dir),
        "--port", "0", "--ssl-certfile", cert, "--ssl-keyfile", key, *FAST,
        running=TLS_RUNNING[server_name],
    )  # fmt: skip
    context = ssl.create_default_context(cafile=cert)
    count = 20
    queued = threading.Semaphore(0)
    results: list[object] = []

    def client() -> None:
        try:
            raw = connect(server.port)  # completes in the kernel: the server is stopped
            raw.settimeout(30)
            queued.release()
            sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
            send(sock, "/")
            results.append(response(sock)[0])
        except Exception as exc:  # recorded: the assertion below names it
            queued.release()
            results.append(exc)

    sigstop(server.proc.pid)
    try:
        threads = [threading.Thread(target=client) for _ in range(count)]
        for thread in threads:
            thread.start()
        for _ in range(count):
            assert queued.acquire(timeout=30)
        server.signal(signal.SIGTERM)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    for thread in threads:
        thread.join(60)
    assert results == [200] * count
    assert server.wait_exit() == 0


def test_proxy_headers_and_root_path(started: list[ServerProcess], app_dir: Path) -> None:
    forwarded = "x-forwarded-for: 203.0.113.7\r\nx-forwarded-proto: https\r\n"
    server = start(
        started, "echoapp:app", "--app-dir", str(app_dir), "--port", "0",
        "--proxy-headers", "--forwarded-allow-ips", "127.0.0.1", "--root-path", "/api", *FAST,
    )  # fmt: skip
    seen = get(connect(server.port), "/api/x", forwarded)
    assert (seen["client"], seen["scheme"], seen["root_path"]) == ("203.0.113.7", "https", "/api")
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    # Not a trusted proxy: the headers are ignored (as with uvicorn).
    server = start(
        started, "echoapp:app", "--app-dir", str(app_dir), "--port", "0",
        "--proxy-headers", "--forwarded-allow-ips", "192.0.2.1", *FAST,
    )  # fmt: skip
    seen = get(connect(server.port), "/", forwarded)
    assert (seen["client"], seen["scheme"]) == ("127.0.0.1", "http")


# ------------------------------------------------------------- --server hypercorn|aiohttp

SERVERS = [
    pytest.param(["--server", "hypercorn", "--loop", "asyncio"], "echoapp:app",
                 HYPERCORN_RUNNING, id="hypercorn"),
    pytest.param(["--server", "hypercorn", "--loop", "trio"], "echoapp:app",
                 HYPERCORN_RUNNING, id="hypercorn-trio"),
    pytest.param(["--server", "aiohttp"], AIOHTTP_APP, AIOHTTP_RUNNING, id="aiohttp"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "app", "running"), SERVERS)
def test_server_drains_in_flight_request(
    started: list[ServerProcess], app_dir: Path, options: list[str], app: str, running: str
) -> None:
    server = start(
        started, app, *options, "--app-dir", str(app_dir), "--port", "0", *FAST,
        running=running,
    )  # fmt: skip
    drains_in_flight(server, connect(server.port))


@pytest.mark.parametrize(("options", "app", "running"), SERVERS)
def test_server_workers_drain_both(
    started: list[ServerProcess], app_dir: Path, options: list[str], app: str, running: str
) -> None:
    server = start(
        started, app, *options, "--app-dir", str(app_dir), "--port", "0", "--workers", "2",
        *FAST, running=r"listening on http://127\.0\.0\.1:(\d+)",
    )  # fmt: skip
    server.wait_for_line(r"worker \d+ serves", count=2)
    first, second = workers(server)
    clients = []
    # One slow request on each worker: the other one is stopped while it connects.
    for stopped in (second, first):
        sigstop(stopped)
        try:
            client = connect(server.port)
            send(client, "/slow")
            server.wait_for_line(r"slow request started", count=len(clients) + 1)
            clients.append(client)
        finally:
            os.kill(stopped, signal.SIGCONT)
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING + r" \(\d+ connections?, 1 request\b", count=2)
    assert [response(client)[0] for client in clients] == [200, 200]
    assert server.wait_exit() == 0
    assert server.output().count("stopping -> stopped") == 2


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--server", "hypercorn", "--reload"], ["--reload", "hypercorn"]),
        (["--server", "aiohttp", "--root-path", "/x"], ["--root-path", "aiohttp"]),
        (["--server", "aiohttp", "--http", "h11"], ["--http", "aiohttp"]),
        (["--server", "aiohttp", "--loop", "trio"], ["--loop", "trio", "hypercorn"]),
        (["--lifespan", "sometimes"], ["--lifespan", "sometimes", "auto"]),
        (["--ws-max-size", "big"], ["--ws-max-size", "big"]),
        (["--header", "no-colon"], ["--header", "no-colon"]),
        (["--reload", "--workers", "2"], ["--reload", "--workers"]),
        (["--timeout-graceful-shutdown", "3", "--drain-timeout", "4"],
         ["--timeout-graceful-shutdown", "--drain-timeout"]),
        (["--timeout-graceful-shutdown", "-1"], ["--timeout-graceful-shutdown"]),
    ],
    ids=lambda x: " ".join(x)[:40] if isinstance(x, list) and x and x[0].startswith("-") else "",
)  # fmt: skip
def test_bad_server_option_exits_2_with_one_line(args: list[str], names: list[str]) -> None:
    from tests.cli.test_cli import assert_usage_error, graceful_run

    assert_usage_error(graceful_run("examples.asgi_app:app", *args), *names)


def test_uvicorn_variables_are_read() -> None:
    from tests.cli.test_cli import assert_usage_error, clean_environment, graceful_run

    env = clean_environment(UVICORN_WS_MAX_SIZE="big")
    assert_usage_error(graceful_run("examples.asgi_app:app", env=env), "UVICORN_WS_MAX_SIZE")
    env = clean_environment(UVICORN_PORT="99999")
    assert_usage_error(graceful_run("examples.asgi_app:app", env=env), "UVICORN_PORT")
    env = clean_environment(UVICORN_PORT="99999", GRACEFUL_PORT="100000")
    assert_usage_error(graceful_run("examples.asgi_app:app", env=env), "GRACEFUL_PORT")


def test_uvicorn_http2_with_zttp_drains_and_counts_connections(
    started: list[ServerProcess], app_dir: Path
) -> None:
    """``--http zttp --http2`` (uvicorn's own choices pass through): uvicorn's dispatcher
    hands each connection to zttp's HTTP/1.1 or HTTP/2 protocol, which graceful does not
    see close; the connections are still counted out, so the drain ends once they are
    gone rather than at the deadline, and an HTTP/2 request in flight completes."""
    import httpx

    pytest.importorskip("uvicorn.protocols.http.zttp_impl", reason="uvicorn before zttp")
    server = start(
        started, "echoapp:app", "--app-dir", str(app_dir), "--port", "0", "--http", "zttp",
        "--http2", "--policy", "refuse-immediately", "--grace-period", "20",
    )  # fmt: skip
    url = f"http://127.0.0.1:{server.port}"
    with httpx.Client(http1=False, http2=True, timeout=10) as h2:
        assert h2.get(f"{url}/").http_version == "HTTP/2"
    with httpx.Client(timeout=10) as h1:
        assert h1.get(f"{url}/").http_version == "HTTP/1.1"
    result: dict[str, httpx.Response] = {}
    with httpx.Client(http1=False, http2=True, timeout=10) as h2:
        thread = threading.Thread(target=lambda: result.setdefault("r", h2.get(f"{url}/slow")))
        thread.start()
        server.wait_for_line(r"slow request started")
        server.signal(signal.SIGTERM)
        thread.join(10)
    assert (result["r"].status_code, result["r"].http_version) == (200, "HTTP/2")
    assert server.wait_exit() == 0
    output = server.output()
    assert re.search(r"draining -> stopping: drained \(0 connections", output), output
