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
import ssl
from typing import Any

from gunicorn import http
from gunicorn.workers.gthread import ThreadWorker as _StockThreadWorker

try:
    from gunicorn.http2.errors import HTTP2ConnectionError, HTTP2ProtocolError
except ImportError:  # gunicorn before HTTP/2
    SEAMS = False
else:
    SEAMS = hasattr(_StockThreadWorker, "_serve_http2_stream") and hasattr(
        _StockThreadWorker, "handle_http2"
    )

__all__ = ("SEAMS", "Http2GoAway")


class Http2GoAway:
    """The mixin of ``graceful.gunicorn.ThreadWorker`` (see the module docs)."""

    alive: bool
    coordinator: Any
    log: Any
    _h2_wake: dict[int, int]  # id(TConn) -> the write end of its thread's wake pipe

    def wake_http2(self) -> None:
        """From any thread: every HTTP/2 connection's thread looks at its GOAWAY."""
        for wake in list(getattr(self, "_h2_wake", {}).values()):
            with contextlib.suppress(OSError):  # full (already woken) or closed
                os.write(wake, b"x")

    def _goaway_if_done(self, h2_conn: Any) -> bool:
        """In the connection's thread: GOAWAY (through h2) and ``True`` once nudging and
        nothing is in flight; ``True`` also for a connection already closed."""
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

    def _serve_http2_stream(self, req: Any, conn: Any, h2_conn: Any) -> None:
        super()._serve_http2_stream(req, conn, h2_conn)  # type: ignore[misc]
        self._goaway_if_done(h2_conn)  # right after the last response in flight

    def handle_http2(self, conn: Any) -> bool:
        if not SEAMS:
            return bool(super().handle_http2(conn))  # type: ignore[misc]
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        if not hasattr(self, "_h2_wake"):
            self._h2_wake = {}
        self._h2_wake[id(conn)] = wake_w
        try:
            if self.coordinator.nudging or not self.alive:
                os.write(wake_w, b"x")  # nudging began before this connection came
            self._loop(conn, wake_r)
        finally:
            self._h2_wake.pop(id(conn), None)
            os.close(wake_r)
            os.close(wake_w)
        return False

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
