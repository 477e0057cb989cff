"""gunicorn's own HTTP/2 under graceful's ``ThreadWorker``: GOAWAY when nudging begins.

gunicorn 27 serves HTTP/2 in its ``gthread`` worker (``--http-protocols h2,h1``, h2c or
TLS with ALPN): one pool thread runs ``handle_http2`` for a connection's whole life and
serves its streams one after another; every frame is written by that thread, and
gunicorn's ``HTTP2ServerConnection`` has no lock.  At its own stop gunicorn sends no
GOAWAY to a busy connection (the end of its loop reads ``b""`` as the client leaving),
and an idle one waits in ``recv`` until its keep-alive expires.  An HTTP/2 client has no
``Connection: close`` to read: without a GOAWAY it keeps sending to this worker.

So, as graceful's hypercorn does (docs/hypercorn.md, "HTTP/2 and GOAWAY"): when nudging
begins every HTTP/2 connection gets a GOAWAY naming the highest stream it received,
sent by the connection's own thread once it has no stream in flight — an h2-based client
such as httpx fails a response still arriving when a GOAWAY comes — and is then closed;
a connection opened while nudging is served its first stream first.  The coordinator's
thread only wakes the connections' threads, through a pipe each: the loop here is
gunicorn 27's ``handle_http2`` waiting on the socket *and* that pipe.

The names of gunicorn's read here (``handle_http2``, ``_serve_http2_stream``; the
connection's ``receive_data``, ``close(last_stream_id=)``, ``is_closed``, ``streams``,
``pending_requests``, ``_deferred_events``, ``idle_timeout`` and its h2 connection's
``highest_inbound_stream_id``) are gunicorn 27's; without them (gunicorn 25 and 26, or a
later change) the worker keeps gunicorn's own HTTP/2 handling, unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import ssl
import struct
import threading
from typing import Any

from gunicorn import __version__ as _gunicorn_version
from gunicorn import http
from gunicorn.workers.gthread import ThreadWorker as _StockThreadWorker

from .._core import health as _health

try:
    from gunicorn.http2.errors import HTTP2ConnectionError, HTTP2ProtocolError
    from gunicorn.http2.response import HTTP2Response
except ImportError:  # gunicorn before HTTP/2
    HTTP2Response = None
    SEAMS = False
else:
    SEAMS = hasattr(_StockThreadWorker, "_serve_http2_stream") and hasattr(
        _StockThreadWorker, "handle_http2"
    )

__all__ = ("SEAMS", "Http2GoAway", "cut_stream", "is_preface", "missing", "refusal")

#: What graceful reads of gunicorn 27's ``HTTP2ServerConnection`` (docs/adapters.md,
#: "Private names each adapter reads"), checked at a worker's first HTTP/2 connection.
CONNECTION_NAMES = (
    "receive_data", "close", "is_closed", "streams", "pending_requests",
    "_deferred_events", "idle_timeout", "h2_conn",
)  # fmt: skip

#: The client's HTTP/2 connection preface with prior knowledge (RFC 9113 §3.4).
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# The frames graceful writes itself, at the exit deadline only (RFC 9113 §6).
_DATA, _HEADERS, _SETTINGS, _GOAWAY = 0x0, 0x1, 0x4, 0x7
_END_STREAM, _END_HEADERS = 0x1, 0x4
_NO_ERROR = 0x0


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    header = struct.pack("!I", len(payload))[1:] + struct.pack("!BBI", kind, flags, stream_id)
    return header + payload


def _goaway(last_stream_id: int) -> bytes:
    """GOAWAY, NO_ERROR: the streams above ``last_stream_id`` were not processed."""
    return _frame(_GOAWAY, 0, 0, struct.pack("!II", last_stream_id, _NO_ERROR))


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK field as a literal without indexing, new name (RFC 7541 §6.2.2): it
    neither reads nor changes the dynamic table the connection's encoder keeps."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def is_preface(received: bytes) -> bool:
    """Whether ``received`` is (the start of) an HTTP/2 client preface."""
    return bool(received) and PREFACE.startswith(received[: len(PREFACE)])


def refusal() -> bytes:
    """The answer to an HTTP/2 connection the exit refuses before serving it: the
    server's preface (an empty SETTINGS) and GOAWAY naming stream 0, so that its client
    knows that none of its streams was processed and retries them elsewhere."""
    return _frame(_SETTINGS, 0, 0) + _goaway(0)


def cut_stream(stream_id: int, body: bytes, window: int) -> bytes:
    """The exit's answer on a stream whose response has not started: 503 (``retry-after:
    0``), and GOAWAY naming that stream (the connection's later streams, served one
    after another, were not).  The body only if the send window takes it."""
    fields = [(b":status", b"503"), (b"retry-after", b"0")]
    if window < len(body):
        body = b""
    if body:
        fields += [(b"content-type", b"text/plain; charset=utf-8")]
    fields += [(b"content-length", str(len(body)).encode())]
    block = b"".join(_literal(name, value) for name, value in fields)
    if not body:
        return _frame(_HEADERS, _END_HEADERS | _END_STREAM, stream_id, block) + _goaway(stream_id)
    return (
        _frame(_HEADERS, _END_HEADERS, stream_id, block)
        + _frame(_DATA, _END_STREAM, stream_id, body)
        + _goaway(stream_id)
    )


def missing(h2_conn: Any) -> list[str]:
    """The names graceful reads that ``h2_conn`` (gunicorn's HTTP/2 connection) lacks."""
    absent = [name for name in CONNECTION_NAMES if not hasattr(h2_conn, name)]
    if "h2_conn" not in absent and not hasattr(h2_conn.h2_conn, "highest_inbound_stream_id"):
        absent.append("h2_conn.highest_inbound_stream_id")
    return absent


class Http2GoAway:
    """The mixin of ``graceful.gunicorn.ThreadWorker`` (see the module docs)."""

    alive: bool
    coordinator: Any
    log: Any
    _h2_wake: dict[int, int]  # id(TConn) -> the write end of its thread's wake pipe
    # Writes to those descriptors and their close: a descriptor closed under a write may
    # already be a new client's socket (the loop's next accept takes the lowest free
    # number).  A worker is one process: its class's lock is its own, never held at fork.
    _h2_lock = threading.Lock()

    def wake_http2(self) -> None:
        """From any thread: every HTTP/2 connection's thread looks at its GOAWAY."""
        with self._h2_lock:
            for wake in getattr(self, "_h2_wake", {}).values():
                with contextlib.suppress(OSError):  # full (already woken)
                    os.write(wake, b"x")

    def _goaway_if_done(self, h2_conn: Any) -> bool:
        """In the connection's thread: GOAWAY (through h2) and ``True`` once nudging and
        nothing is in flight; ``True`` also for a connection already closed.  One GOAWAY,
        naming the highest stream received, not RFC 9113's double GOAWAY (docs/gunicorn.md,
        "HTTP/2 at a rolling restart", says why)."""
        if h2_conn.is_closed:
            return True
        if self.alive and not self.coordinator.nudging:
            return False
        if h2_conn.streams or h2_conn.pending_requests or h2_conn._deferred_events:
            return False  # a stream in flight: GOAWAY after its response
        last = h2_conn.h2_conn.highest_inbound_stream_id
        if last == 0 and self.alive and not self.coordinator.draining:
            return False  # opened while nudging: serve its first stream first
        h2_conn.close(last_stream_id=last)
        return True

    def _answer_cut(self, sock: Any, response: Any) -> bool:
        """At the exit: a stream whose response has not started gets an HTTP/2 503 and
        its connection a GOAWAY (``cut_stream``), never HTTP/1.1 bytes.  One whose
        response is under way gets nothing: the connection's thread may be writing a
        frame, and a frame of ours inside it would be garbage."""
        if not _is_http2(response):
            return bool(super()._answer_cut(sock, response))  # type: ignore[misc]
        stream_id = getattr(response, "stream_id", None)
        h2_conn = getattr(response, "h2_conn", None)
        if stream_id is None or h2_conn is None or getattr(response, "headers_sent", True):
            return False  # under way, or a gunicorn we do not know: nothing clean to say
        try:
            window = h2_conn.h2_conn.local_flow_control_window(stream_id)
        except Exception:  # a stream h2 no longer knows: no body
            window = 0
        with contextlib.suppress(OSError):
            sock.settimeout(0.05)
            sock.sendall(cut_stream(stream_id, _health.CUT_BODY, window))
            _close_after(sock)
            return True
        return False

    def _serve_http2_stream(self, req: Any, conn: Any, h2_conn: Any) -> None:
        super()._serve_http2_stream(req, conn, h2_conn)  # type: ignore[misc]
        self._goaway_if_done(h2_conn)  # right after the last response in flight

    def handle_http2(self, conn: Any) -> bool:
        if not SEAMS or not self._http2_fits(conn.parser):
            return bool(super().handle_http2(conn))  # type: ignore[misc]
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        with self._h2_lock:
            if not hasattr(self, "_h2_wake"):
                self._h2_wake = {}
            self._h2_wake[id(conn)] = wake_w
        try:
            if self.coordinator.nudging or not self.alive:
                os.write(wake_w, b"x")  # nudging began before this connection came
            self._loop(conn, wake_r)
        finally:
            with self._h2_lock:
                self._h2_wake.pop(id(conn), None)
                os.close(wake_w)
            os.close(wake_r)
        return False

    def _http2_fits(self, h2_conn: Any) -> bool:
        """The start-up check, at the first HTTP/2 connection: gunicorn's connection has
        every name graceful reads (``missing``); if not, one warning and gunicorn's own
        HTTP/2 handling for good (no GOAWAY at nudging)."""
        fits: bool | None = getattr(self, "_h2_fits", None)
        if fits is None:
            absent = missing(h2_conn)
            fits = self._h2_fits = not absent
            if absent:
                self.log.warning(
                    "graceful: gunicorn %s's HTTP/2 connection lacks %s: gunicorn's own "
                    "HTTP/2 handling is kept (no GOAWAY when nudging)",
                    _gunicorn_version,
                    ", ".join(absent),
                )
        return fits

    def _loop(self, conn: Any, wake_r: int) -> None:
        """gunicorn 27's ``handle_http2`` loop, waiting on the socket and the wake pipe."""
        h2_conn = conn.parser
        selector = selectors.DefaultSelector()
        selector.register(conn.sock, selectors.EVENT_READ, "socket")
        selector.register(wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._goaway_if_done(h2_conn):
                buffered = (
                    h2_conn.pending_requests
                    or h2_conn._deferred_events
                    or (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending())
                )
                if not buffered:
                    ready = selector.select(timeout=h2_conn.idle_timeout)
                    if not ready:  # the keep-alive expired
                        if not h2_conn.streams:
                            last = h2_conn.h2_conn.highest_inbound_stream_id
                            h2_conn.close(last_stream_id=last)
                            return
                        continue
                    if any(key.data == "wake" for key, _ in ready):
                        with contextlib.suppress(OSError):
                            os.read(wake_r, 64)
                    if not any(key.data == "socket" for key, _ in ready):
                        continue
                for req in h2_conn.receive_data():
                    self._serve_http2_stream(req, conn, h2_conn)
        except http.errors.NoMoreData:
            self.log.debug("HTTP/2 connection closed by client")
        except (HTTP2ConnectionError, HTTP2ProtocolError) as exc:
            self.log.debug("HTTP/2 connection closed: %s", exc)
        except ssl.SSLError as exc:
            self.log.debug("HTTP/2 SSL error: %s", exc)
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                self.log.exception("HTTP/2 socket error")
        except Exception:
            self.log.exception("HTTP/2 connection error")
        finally:
            selector.close()


def _close_after(sock: Any) -> None:
    """Half-close and read what the client still sends (WINDOW_UPDATE, PING, streams),
    so that the exit's close sends no reset that could discard our frames."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        while sock.recv(65536):
            pass


def _is_http2(response: Any) -> bool:
    """Whether a request in flight is an HTTP/2 stream (gunicorn 25+)."""
    return HTTP2Response is not None and isinstance(response, HTTP2Response)
