"""Every example in examples/ under a real SIGTERM: real process on 127.0.0.1, real client.

Each test holds a request, a stream or a websocket open, sends SIGTERM, and checks that
the client saw the clean ending (a complete response, an SSE stream that ends with its
last event, a websocket closed with 1001) and that the process exited 0 in time.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.servers import POLICIES, RawHTTP, ServerProcess, graceful_run, wait_for

#: The longest any example may take from SIGTERM to its exit.
EXIT_DEADLINE_S = 15.0


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    """Servers to kill (whole process group) after the test, whatever happened."""
    servers: list[ServerProcess] = []
    yield servers
    RawHTTP.close_all()
    for server in servers:
        server.stop()


def _uvicorn_port(server: ServerProcess) -> int:
    return int(server.wait_for_line(r"running on http://127\.0\.0\.1:(\d+)").group(1))


def test_fastapi_app_finishes_in_flight_request(started: list[ServerProcess]) -> None:
    pytest.importorskip("fastapi")
    server = ServerProcess(
        [sys.executable, "-m", "examples.fastapi_app", "--port", "0", "--idle", "0.5"]
    )
    started.append(server)
    port = _uvicorn_port(server)
    client = RawHTTP(port)
    client.send("/slow?s=1")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    status, headers, body = client.response()
    assert (status, body) == (200, b'{"slept":1.0}')
    assert headers["connection"] == "close"  # nudged: the client reconnects elsewhere
    assert server.wait_exit(EXIT_DEADLINE_S) == 0


def test_quickstart_runs_as_copied_and_drains(started: list[ServerProcess]) -> None:
    """The Quickstart's first snippet is this whole file: run it as a user would."""
    pytest.importorskip("fastapi")
    server = ServerProcess(
        [sys.executable, str(Path(__file__).parent.parent / "examples" / "quickstart.py")],
        env={**os.environ, "PORT": "0"},
    )
    started.append(server)
    port = _uvicorn_port(server)
    assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).json() == {"hello": "world"}
    server.signal(signal.SIGTERM)
    assert server.wait_exit(EXIT_DEADLINE_S) == 0


def test_uvicorn_run_example_drains(started: list[ServerProcess]) -> None:
    server = ServerProcess([sys.executable, "-m", "examples.uvicorn_run", "--port", "0"])
    started.append(server)
    _slow_request_drains(server, _uvicorn_port(server))


def test_sse_stream_ends_with_its_last_event(started: list[ServerProcess]) -> None:
    server = graceful_run(*POLICIES["accept-until-idle"], app="examples.sse:app")
    started.append(server)
    events: list[str] = []
    timeout = httpx.Timeout(10.0)
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream("GET", f"http://127.0.0.1:{server.port}/events?interval=0.2") as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        for line in lines:  # the stream is live before the SIGTERM
            if line.startswith("data: "):
                events.append(line)
                break
        server.signal(signal.SIGTERM)
        events += [line for line in lines if line]  # ends only at the chunked terminator
    assert events[0] == "data: 0"
    assert events[-2:] == ["event: bye", "data: server draining, reconnect"]
    assert server.wait_exit(EXIT_DEADLINE_S) == 0


def test_websocket_chat_closes_with_1001(started: list[ServerProcess]) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    server = graceful_run(*POLICIES["accept-until-idle"], app="examples.websocket_chat:app")
    started.append(server)
    url = f"ws://127.0.0.1:{server.port}/chat"
    with connect(url, open_timeout=10) as alice, connect(url, open_timeout=10) as bob:
        server.wait_for_line(r"member joined \(2 in the room\)")
        alice.send("hello")
        assert bob.recv(timeout=10) == "hello"
        assert alice.recv(timeout=10) == "hello"
        server.signal(signal.SIGTERM)
        for member in (alice, bob):
            assert member.recv(timeout=10) == "server restarting, reconnect"
            with pytest.raises(ConnectionClosed) as closed:
                member.recv(timeout=10)
            assert closed.value.rcvd is not None
            assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (
                1001,
                "server restarting",
            )
    assert server.wait_exit(EXIT_DEADLINE_S) == 0


def _read_line(sock: socket.socket, buffer: bytearray) -> bytes:
    while b"\n" not in buffer:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionResetError(f"closed before a line: {bytes(buffer)!r}")
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


def test_asyncio_line_server_finishes_command_then_says_bye(
    started: list[ServerProcess],
) -> None:
    server = ServerProcess(
        [sys.executable, "examples/asyncio_lines.py", "--port", "0",
         *POLICIES["accept-until-idle"]]
    )  # fmt: skip
    started.append(server)
    port = int(server.wait_for_line(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        buffer = bytearray()
        sock.sendall(b"PING\n")
        assert _read_line(sock, buffer) == b"PONG"
        sock.sendall(b"SLEEP 1\n")
        server.wait_for_line(r"sleeping 1 s")
        server.signal(signal.SIGTERM)
        assert _read_line(sock, buffer) == b"SLEPT 1"
        assert _read_line(sock, buffer) == b"BYE draining"
        assert sock.recv(1) == b""  # then closed by the server
    assert server.wait_exit(EXIT_DEADLINE_S) == 0


def test_asyncio_http_example_finishes_in_flight_request(started: list[ServerProcess]) -> None:
    server = ServerProcess(
        [sys.executable, "examples/asyncio_http.py", "--port", "0",
         *POLICIES["refuse-immediately"]]
    )  # fmt: skip
    started.append(server)
    port = int(server.wait_for_line(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    _slow_request_drains(server, port, started=r"request started: /slow")


def test_gunicorn_conf_drains_workers(started: list[ServerProcess]) -> None:
    pytest.importorskip("gunicorn")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    server = ServerProcess(
        [sys.executable, "-m", "gunicorn", "-c", "examples/gunicorn.conf.py",
         "-b", "127.0.0.1:0", "examples.asgi_app:app"],
        env={**environment, "GRACEFUL_IDLE": "0.5"},  # the deployment's value wins
    )  # fmt: skip
    started.append(server)
    port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(r"Application startup complete", count=2)
    clients = []
    for _ in range(4):  # spread over both workers
        client = RawHTTP(port)
        client.send("/slow?s=1")
        clients.append(client)
    server.wait_for_line(r"slow request started", count=4)
    server.signal(signal.SIGTERM)
    assert [client.response()[::2] for client in clients] == [(200, b"slept 1\n")] * 4
    assert server.wait_exit(EXIT_DEADLINE_S) == 0
    assert server.output().count("stopping -> stopped") == 2


def _slow_request_drains(
    server: ServerProcess, port: int, *, started: str = r"slow request started"
) -> None:
    """A request in flight at SIGTERM is answered, then the process exits 0."""
    client = RawHTTP(port)
    client.send("/slow?s=1")
    server.wait_for_line(started)
    server.signal(signal.SIGTERM)
    assert client.response()[::2] == (200, b"slept 1\n")
    assert server.wait_exit(EXIT_DEADLINE_S) == 0


def test_uvicorn_server_example_drains(started: list[ServerProcess]) -> None:
    server = ServerProcess([sys.executable, "-m", "examples.uvicorn_server", "--port", "0"])
    started.append(server)
    _slow_request_drains(server, _uvicorn_port(server))


def _hypercorn_port(server: ServerProcess) -> int:
    return int(server.wait_for_line(r"Running on http://127\.0\.0\.1:(\d+)").group(1))


@pytest.mark.parametrize("example", ["examples.hypercorn_run", "examples.hypercorn_serve"])
def test_hypercorn_examples_drain(started: list[ServerProcess], example: str) -> None:
    pytest.importorskip("hypercorn")
    if example == "examples.hypercorn_run":
        pytest.importorskip("trio")
    server = ServerProcess([sys.executable, "-m", example, "--port", "0"])
    started.append(server)
    _slow_request_drains(server, _hypercorn_port(server))


def test_aiohttp_run_app_example_drains(started: list[ServerProcess]) -> None:
    pytest.importorskip("aiohttp")
    server = ServerProcess([sys.executable, "-m", "examples.aiohttp_run_app", "--port", "0"])
    started.append(server)
    port = int(server.wait_for_line(r"Running on http://127\.0\.0\.1:(\d+)").group(1))
    _slow_request_drains(server, port)


def test_aiohttp_runner_example_ends_stream_and_request(started: list[ServerProcess]) -> None:
    pytest.importorskip("aiohttp")
    server = ServerProcess([sys.executable, "-m", "examples.aiohttp_runner", "--port", "0"])
    started.append(server)
    port = int(server.wait_for_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
    client = RawHTTP(port)
    client.send("/slow?s=1")
    server.wait_for_line(r"slow request started")
    events: list[str] = []
    with (
        httpx.Client(timeout=httpx.Timeout(10.0)) as http,
        http.stream("GET", f"http://127.0.0.1:{port}/events") as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        events += [next(line for line in lines if line)]  # live before the SIGTERM
        server.signal(signal.SIGTERM)
        assert client.response()[::2] == (200, b"slept 1\n")
        events += [line for line in lines if line]  # ends only at the chunked terminator
    assert events[0] == "data: tick"
    assert events[-2:] == ["event: bye", "data: server draining"]
    assert server.wait_exit(EXIT_DEADLINE_S) == 0


def test_gunicorn_multiprocess_conf_marks_killed_workers_dead(
    started: list[ServerProcess], tmp_path: Path
) -> None:
    pytest.importorskip("gunicorn")
    pytest.importorskip("prometheus_client")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    server = ServerProcess(
        [sys.executable, "-m", "gunicorn", "-c", "examples/gunicorn_multiprocess.conf.py",
         "-b", "127.0.0.1:0", "examples.asgi_app:app"],
        env={**environment, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
             "GRACEFUL_METRICS_PATH": "/metrics", "GRACEFUL_IDLE": "0.5"},
    )  # fmt: skip
    started.append(server)
    port = int(server.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(r"Application startup complete", count=2)
    killed = int(server.wait_for_line(r"Booting worker with pid: (\d+)").group(1))
    live = f"*live*_{killed}.db"
    wait_for(lambda: list(tmp_path.glob(live)), 10, f"worker {killed} writes its live gauges")
    os.kill(killed, signal.SIGKILL)
    server.wait_for_line(r"Booting worker with pid: (\d+)", count=3)  # its replacement
    assert not list(tmp_path.glob(live))  # child_exit dropped them
    server.wait_for_line(r"Application startup complete", count=3)
    _slow_request_drains(server, port)
