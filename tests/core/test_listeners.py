"""Sealing a listening socket before its last accept (``graceful._core.listeners``).

Real sockets on 127.0.0.1: on loopback a handshake the kernel answers completes inside
the client's ``connect()``, so a client socket's TCP state right after a non-blocking
connect tells whether its SYN was answered (established) or dropped (SYN sent).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from graceful._core.listeners import handshakes_under_way, seal

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


def test_a_listener_passed_to_another_process_is_not_sealed(
    listener: tuple[socket.socket, str, int],
) -> None:
    """Sealing a shared socket (a gunicorn master, a sibling worker) would stop the
    others accepting: it is left alone — also once that process is gone, since nothing
    proves it did not pass the socket on."""
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
    assert not seal([sock])


def test_a_sealed_socket_detaches_its_filter_when_closed(
    listener: tuple[socket.socket, str, int],
) -> None:
    """Whoever else holds the socket (here: the same process, through another
    descriptor) gets it back without the filter once the sealed descriptor is closed."""
    sock, host, family = listener
    port = sock.getsockname()[1]
    dup = socket.socket(fileno=os.dup(sock.fileno()))
    assert seal([dup])
    dropped = connect(port, host, family)
    try:
        assert state(dropped) == SYN_SENT
        dup.close()
        after = connect(port, host, family)
        assert state(after) == ESTABLISHED
        after.close()
    finally:
        dropped.close()


def test_a_reuseport_listener_is_not_sealed() -> None:
    """A sealed member of a SO_REUSEPORT group would drop its share of the group's new
    SYNs; closed, its share goes to the others."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        assert not seal([sock])
        client = connect(sock.getsockname()[1])
        assert state(client) == ESTABLISHED
        client.close()
    finally:
        sock.close()


def run_python(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; its output lines."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_socket_created_before_graceful_was_imported_is_not_sealed() -> None:
    """Inherited, or made before graceful was: nothing proves no one else holds it."""
    assert run_python(
        """
        import socket
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        from graceful._core.listeners import seal
        print(seal([sock]))
        """
    ) == ["False"]


def test_after_a_fork_neither_process_seals_what_it_created_before() -> None:
    """Both hold the socket after the fork; a socket created after it is each one's own."""
    assert run_python(
        """
        import os, socket
        from graceful._core.listeners import seal
        def listener():
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(16)
            return sock
        before = listener()
        pid = os.fork()
        if pid == 0:
            print("child", seal([before]), seal([listener()]), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", seal([before]), seal([listener()]), flush=True)
        """
    ) == ["child", "False", "True", "parent", "False", "True"]


def test_sealing_and_waiting_for_handshakes_read_nothing_under_proc() -> None:
    """No /proc scan (tens of thousands of descriptors, a table of every connection)
    blocks the event loop at draining: the kernel answers for the socket itself."""
    assert run_python(
        """
        import socket, sys
        from graceful._core.listeners import handshakes_under_way, seal
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 30)
        idle = socket.socket()
        assert not handshakes_under_way([sock])
        idle.connect(sock.getsockname())  # sends nothing: held in SYN_RECV
        read = []
        def audit(event, args):
            if event in ("open", "os.listdir", "os.scandir") and str(args[0]).startswith("/proc"):
                read.append(str(args[0]))
        sys.addaudithook(audit)
        print(seal([sock]), handshakes_under_way([sock]), read[:3])
        """
    ) == ["True", "True", "[]"]


def test_only_tcp_listeners_are_sealed() -> None:
    unix = socket.socket(socket.AF_UNIX)
    try:
        assert not seal([unix])
        assert not handshakes_under_way([unix])
    finally:
        unix.close()
