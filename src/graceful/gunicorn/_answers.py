"""What graceful's WSGI workers (``graceful.gunicorn._wsgi``) say on a connection, and
read of a listener, at the level of bytes and socket options: the 503 of a request cut
before its response started, the refusal of a connection that cannot be served (in its
client's protocol), gunicorn's way to close a connection after a response, the
moment a response passes from the app to gunicorn's writer (``HandOver``), and the
kernel's count of connections waiting in a listener's accept queue.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import struct
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from .._core import health as _health
from . import _http2

__all__ = (
    "CUT_RESPONSE",
    "HandOver",
    "accept_queue",
    "await_exit",
    "exit_aware",
    "force_close",
    "hand_over",
    "refuse",
)

#: What a request the exit cuts before its response started is answered (not a bare
#: EOF: a 503 tells the client the request was not served, and it may retry).
CUT_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 0\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    + f"Content-Length: {len(_health.CUT_BODY)}\r\n\r\n".encode()
    + _health.CUT_BODY
)
#: The first byte of a TLS handshake record (a ClientHello), RFC 8446 §5.1.
_TLS_HANDSHAKE = b"\x16"
#: ``struct tcp_info``'s ``tcpi_unacked``: on a listening socket, the connections in its
#: accept queue (Linux, ``include/uapi/linux/tcp.h``; 8 single bytes, then 32-bit fields).
_TCPI_UNACKED = struct.Struct("=24xI")


def accept_queue(sock: Any) -> int:
    """How many connections wait in ``sock``'s accept queue (0 where unknown)."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None or getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return 0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCPI_UNACKED.size)
    except (OSError, AttributeError):  # closed (gunicorn's closed listener has no socket)
        return 0
    if len(info) < _TCPI_UNACKED.size:
        return 0
    queued: int = _TCPI_UNACKED.unpack_from(info)[0]
    return queued


#: What a request the exit answered 503 waits on (``await_exit``): never set, the process
#: ends right after the cut (``os._exit``), and nothing of gunicorn's may follow the 503.
_EXITING = threading.Event()


def await_exit() -> None:
    """In the thread of a request the exit answered 503: wait for the process's end,
    which follows the cut at once — neither the app nor gunicorn's writer may run."""
    _EXITING.wait()


def hand_over(in_flight: dict[int, Any], key: int, lock: threading.Lock, cut: set[int]) -> None:
    """The request ``key`` passes to gunicorn's writer: out of the exit's reach
    (``in_flight``), under the cut lock.  If the exit already answered it 503 (``cut``),
    it never returns: the exit ends the process."""
    if key not in in_flight:
        return  # handed over already
    with lock:
        in_flight.pop(key, None)
        if key not in cut:
            return
    await_exit()


def exit_aware(
    app: Any,
    coordinator: Any,
    in_flight: dict[int, Any],
    cut_lock: threading.Lock,
    cut_keys: set[int],
    *,
    cut_socks: set[int],
    entered: set[int] | None,
) -> Any:
    """``app``, whose responses close their connection while the policy nudges clients
    (``coordinator.nudging``), and whose requests in flight the exit can answer (the
    worker's ``_cut``: ``in_flight``, ``cut_lock``, ``cut_keys``; ``HandOver``).  gunicorn
    drops a ``Connection`` header the app sets (hop-by-hop) and decides itself: its
    response's ``force_close()`` is the way to ask.  With ``entered`` (threads read the
    requests: ``ThreadWorker``), each request notes its socket there once in flight, and
    one whose socket the exit answered already (``cut_socks``) never runs the app."""

    def closing(environ: dict[str, Any], start_response: Any) -> Any:
        response = getattr(start_response, "__self__", None)
        sock = environ.get("gunicorn.socket")
        key = id(environ)
        if sock is not None and response is not None:
            # Before looking at nudging: one that begins meanwhile finds it here.
            in_flight[key] = (sock, response)
            if entered is not None:  # against the exit's answer to what a thread reads:
                entered.add(id(sock))  # noted, then looked (ThreadWorker._cut_reading)
                if cut_socks and id(sock) in cut_socks:
                    await_exit()  # answered 503: the app must not run; the exit follows
        if coordinator.nudging:
            force_close(response)
        if sock is None or response is None:
            return app(environ, start_response)
        try:
            result = app(environ, start_response)
        except BaseException:  # gunicorn answers 500 if nothing was sent yet
            hand_over(in_flight, key, cut_lock, cut_keys)
            raise
        return HandOver(result, in_flight, key, cut_lock, cut_keys)

    return closing


class HandOver:
    """The app's response iterable on its way to gunicorn's writer.

    Until it yields its first chunk (or ends, or fails) nothing of the response was
    written, and the exit may answer the request 503 (``_wsgi``'s ``_cut``, which looks
    for it in ``in_flight`` under ``key``).  From then on gunicorn writes: its response's
    ``headers_sent`` only becomes true once the head was sent, so that flag alone let a
    503 land inside a response being written (seen under load: a 200's head, then the
    503).  The exit answers under the worker's cut lock and notes what it answered in
    ``cut``; the hand-over takes the same lock: a request is either cut or handed over,
    never both, and one that was cut never writes a byte (``hand_over``).  A request
    handed over after the cut goes on as before, however little time the exit leaves it.
    """

    __slots__ = ("_cut", "_in_flight", "_key", "_lock", "_result")

    def __init__(
        self,
        result: Iterable[bytes],
        in_flight: dict[int, Any],
        key: int,
        lock: threading.Lock,
        cut: set[int],
    ) -> None:
        self._result = result
        self._in_flight = in_flight
        self._key = key
        self._lock = lock
        self._cut = cut

    def __iter__(self) -> Iterator[bytes]:
        items = iter(self._result)
        try:
            first = next(items)
        except StopIteration:
            hand_over(self._in_flight, self._key, self._lock, self._cut)
            return iter(())
        except BaseException:  # gunicorn answers 500 if nothing was sent yet
            hand_over(self._in_flight, self._key, self._lock, self._cut)
            raise
        hand_over(self._in_flight, self._key, self._lock, self._cut)
        return itertools.chain((first,), items)

    def close(self) -> None:
        try:
            close = getattr(self._result, "close", None)
            if close is not None:
                close()
        finally:
            hand_over(self._in_flight, self._key, self._lock, self._cut)  # never iterated


def force_close(response: Any) -> None:
    """gunicorn's way to ask that a response close its connection (the ``Connection``
    header an app sets is dropped: hop-by-hop)."""
    force_close = getattr(response, "force_close", None)
    if force_close is not None:
        force_close()


def refuse(client: socket.socket, timeout_s: float = 0.2) -> None:
    """Read what the client sent (bounded by ``timeout_s``), answer that its request was
    not served and it may retry, close.  The answer is in the client's protocol: 503
    with ``Connection: close`` on HTTP/1.1, GOAWAY naming no stream after an HTTP/2
    preface; a TLS handshake nobody answered gets a plain close (bytes in clear would be
    garbage to it)."""
    received = b""
    with contextlib.suppress(OSError):
        client.settimeout(timeout_s)
        while b"\r\n\r\n" not in received and len(received) < 65536:
            chunk = client.recv(65536)
            if not chunk:
                break
            received += chunk
    if _http2.is_preface(received):
        answer = _http2.refusal()
    elif received[:1] == _TLS_HANDSHAKE:
        answer = b""
    else:
        answer = CUT_RESPONSE
    with contextlib.suppress(OSError):
        client.settimeout(max(timeout_s, 0.05))
        client.sendall(answer)
        client.shutdown(socket.SHUT_WR)
    with contextlib.suppress(OSError):
        client.setblocking(False)
        while client.recv(65536):  # what is left, so that the close sends no reset
            pass
    with contextlib.suppress(OSError):
        client.close()
