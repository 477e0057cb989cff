"""The seal of a draining listener (``graceful._core.listeners``) never reaches another process.

Real servers, real sockets on 127.0.0.1.  On loopback a SYN the kernel answers completes
the handshake inside the client's non-blocking ``connect()``: a client socket still in
``SYN_SENT`` right after it had its SYN dropped (a sealed listener), and would wait a
second for the retransmission.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import DRAINING, ServerProcess, wait_for

ESTABLISHED, SYN_SENT = 1, 2

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sealing is Linux's")


def state(sock: socket.socket) -> int:
    """``tcp_info.tcpi_state`` of ``sock`` (1 established, 2 SYN sent)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def connect(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex(("127.0.0.1", port))
    return sock


@functools.cache
def _pid_namespaces() -> str | None:
    """Why a server cannot run in its own PID namespace here, or ``None`` if it can."""
    if not sys.platform.startswith("linux"):
        return "PID namespaces are Linux's"
    if os.geteuid() != 0:
        return "a new PID namespace needs root"
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30
    )
    if probe.returncode != 0:
        return f"unshare --pid failed: {probe.stderr.decode(errors='replace').strip()}"
    return None


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _inner_pid(outer: int, timeout_s: float = 10) -> int:
    """The process ``unshare --fork`` (``outer``) started: its only child."""
    wait_for(lambda: _children(outer), timeout_s, f"the child of {outer}")
    return _children(outer)[0]


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock
    sock.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_socket_handed_to_a_server_in_another_pid_namespace_is_not_sealed(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """The test binds the socket and hands it (``--fd``) to ``graceful run`` in its own
    PID namespace, where ``/proc`` shows no other holder.  After the server drained and
    exited, the socket — still the test's — answers a connection: no filter was left on
    it (before the fix the seal outlived the server and every SYN was dropped)."""
    if reason := _pid_namespaces():
        pytest.skip(reason)
    fd, port = listener.fileno(), listener.getsockname()[1]
    command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "graceful"]
    command += ["run", "examples.asgi_app:app", "--fd", str(fd), "--loop", loop]
    command += ["--policy", "refuse-immediately", "--grace-period", "10"]
    with monkeypatch.context() as patched:  # ServerProcess's Popen, passing the socket
        patched.setattr(subprocess, "Popen", functools.partial(subprocess.Popen, pass_fds=[fd]))
        server = ServerProcess(command)
    clients: list[socket.socket] = []
    try:
        server.wait_for_line(r"Application startup complete")
        served = socket.create_connection(("127.0.0.1", port), timeout=10)
        clients.append(served)
        served.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert served.recv(12) == b"HTTP/1.1 200"
        os.kill(_inner_pid(server.proc.pid), signal.SIGTERM)
        server.wait_for_line(DRAINING)
        assert server.wait_exit() == 0
        after = connect(port)
        clients.append(after)
        assert state(after) == ESTABLISHED, "the server's seal outlived it"
        accepted, _ = listener.accept()  # the test's socket serves on
        accepted.close()
    finally:
        for client in clients:
            client.close()
        server.stop()


#: ``reuseport_server.py``: a graceful.asyncio server on a ``SO_REUSEPORT`` socket it
#: binds itself, refusing at SIGTERM, with ``TCP_DEFER_ACCEPT``.
REUSEPORT_SERVER = str(Path(__file__).parents[1] / "support" / "reuseport_server.py")


def _syn_recv(port: int) -> bool:
    """Whether a connection to ``port`` is in SYN_RECV (state 03 in /proc/net/tcp)."""
    with open("/proc/net/tcp", encoding="ascii") as table:
        rows = [line.split() for line in list(table)[1:]]
    return any(row[3] == "03" and row[1].endswith(f":{port:04X}") for row in rows)


@linux
def test_a_reuseport_sibling_answers_every_connection_while_the_other_drains() -> None:
    """Old and new server share a port through SO_REUSEPORT; a handshake is under way
    on it.  While the old one drains, every new connection is answered (by either): a
    sealed reuseport member would drop its hash share of SYNs — each such client waits a
    second for its retransmission — for as long as it waits for handshakes (before the
    fix: the whole second, for a handshake that was not even its own)."""
    old = ServerProcess([sys.executable, REUSEPORT_SERVER, "0"])
    new: ServerProcess | None = None
    clients: list[socket.socket] = []
    try:
        port = int(old.wait_for_line(r"listening on (\d+)").group(1))
        new = ServerProcess([sys.executable, REUSEPORT_SERVER, str(port)])
        new.wait_for_line(r"listening on")
        stuck = socket.create_connection(("127.0.0.1", port), timeout=10)  # sends nothing
        clients.append(stuck)
        wait_for(lambda: _syn_recv(port), 10, "a handshake under way on the port")
        old.signal(signal.SIGTERM)
        old.wait_for_line(DRAINING)
        dropped = 0
        for _ in range(40):  # paced over ~0.2 s: inside the old server's wait
            client = connect(port)
            clients.append(client)
            dropped += state(client) == SYN_SENT
            time.sleep(0.005)
        assert dropped == 0, f"{dropped} of 40 SYNs dropped while the old server drained"
        assert old.wait_exit() == 0
    finally:
        for client in clients:
            client.close()
        old.stop()
        if new is not None:
            new.stop()
