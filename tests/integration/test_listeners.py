"""Sealing a listening socket before its last accept (``graceful._listeners``).

Real sockets on 127.0.0.1: on loopback a handshake the kernel answers completes inside
the client's ``connect()``, so a client socket's TCP state right after a non-blocking
connect tells whether its SYN was answered (established) or dropped (SYN sent).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from graceful._listeners import handshakes_under_way, seal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's sealing")

ESTABLISHED, SYN_SENT = 1, 2


def state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def connect(port: int, host: str = "127.0.0.1", family: int = socket.AF_INET) -> socket.socket:
    sock = socket.socket(family)
    sock.setblocking(False)
    sock.connect_ex((host, port))
    return sock


@pytest.fixture(params=[(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")], ids=["v4", "v6"])
def listener(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, str, int]]:
    family, host = request.param
    sock = socket.socket(family)
    sock.bind((host, 0))
    sock.listen(16)
    yield sock, host, family
    sock.close()


def test_a_sealed_listener_drops_new_handshakes_and_keeps_its_connections(
    listener: tuple[socket.socket, str, int],
) -> None:
    sock, host, family = listener
    port = sock.getsockname()[1]
    before = connect(port, host, family)
    queued = connect(port, host, family)  # completed, not accepted yet
    accepted, _ = sock.accept()
    try:
        assert state(before) == state(queued) == ESTABLISHED
        assert seal([sock])
        after = connect(port, host, family)
        assert state(after) == SYN_SENT  # its SYN was dropped: never established
        assert not handshakes_under_way([sock])  # nor half-way: nothing to wait for
        before.setblocking(True)
        before.sendall(b"ping")  # data on an accepted connection passes the filter
        assert accepted.recv(4) == b"ping"
        accepted.sendall(b"pong")
        assert before.recv(4) == b"pong"
        late, _ = sock.accept()  # the queued one is still there to accept
        late.close()
        sock.close()  # closed: a retried SYN is refused, safe to retry
        retry = socket.socket(family)
        with pytest.raises(ConnectionRefusedError):
            retry.connect((host, port))
        retry.close()
        after.close()
    finally:
        accepted.close()
        before.close()
        queued.close()


def test_a_listener_another_process_holds_is_not_sealed(
    listener: tuple[socket.socket, str, int],
) -> None:
    """Sealing a shared socket (a gunicorn master, a sibling worker) would stop the
    others accepting: it is left alone."""
    sock, host, family = listener
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        pass_fds=[sock.fileno()],
    )
    try:
        assert not seal([sock])
        client = connect(sock.getsockname()[1], host, family)
        assert state(client) == ESTABLISHED
        client.close()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)
    assert seal([sock])  # once it is gone, the socket is ours alone


def test_only_tcp_listeners_are_sealed() -> None:
    unix = socket.socket(socket.AF_UNIX)
    try:
        assert not seal([unix])
        assert not handshakes_under_way([unix])
    finally:
        unix.close()
