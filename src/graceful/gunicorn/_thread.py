"""``graceful.gunicorn.ThreadWorker``: gunicorn's ``gthread`` worker following graceful's
shutdown policy (the common part: ``graceful.gunicorn._wsgi``).

gunicorn's loop, thread pool and keep-alive handling are kept; the stop is gunicorn's
own (``alive = False``), with these additions:

* on gunicorn 24+ ``set_accept_enabled`` first accepts what already waits in the
  backlog and then closes this worker's copy of the listeners at once: gunicorn keeps
  them open until the last request ends, and a connection queued meanwhile was reset at
  that close after its client had sent its request;
* a connection handed to the pool but still waiting for a thread is remembered
  (``enqueue_req``/``handle``), so that the exit answers it 503 rather than closing it
  unanswered;
* idle kept-alive connections get ``IDLE_GRACE_S`` from the start of draining to send
  one more request, as on graceful's other servers (gunicorn 27.0.1 keeps them 2 s, and
  the drain waits for its loop; gunicorn 26 and 27.0.0 look at them at the next event);
* a connection gunicorn 26+ closes after its response lingers for the client's FIN
  (RFC 9112 §9.6) on gunicorn's poller, not in ``close_graceful`` on the loop's thread:
  there every ``Connection: close`` answered to a client that does not close at once
  held the loop for up to 2 s — no accept, no keep-alive served — and while nudging
  every response closes its connection.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import selectors
import socket
import threading
import time
from concurrent import futures
from typing import Any

from gunicorn.workers.gthread import TConn
from gunicorn.workers.gthread import ThreadWorker as _StockThreadWorker

from .._core.policy import Phase
from .._core.signals import leave_signals_to_main_thread
from ._answers import CUT_RESPONSE, refuse
from ._http2 import Http2GoAway
from ._wsgi import _GracefulWSGIWorker

#: At draining, how long an idle kept-alive connection may still send a request (it is
#: answered with ``Connection: close``), as ``idle_grace_s`` on graceful's other servers.
IDLE_GRACE_S = 1.0
#: How long a connection closed after its response waits for its client's FIN, and how
#: much it reads meanwhile: gunicorn's ``close_graceful``.
LINGER_S = 2.0
_LINGER_BYTES = 65536
#: The start of an HTTP/2 client's connection preface (RFC 9113 §3.4).
_H2_PREFACE = b"PRI * HTTP/2.0"
#: gunicorn 26+ closes a connection after its response with ``close_graceful`` (on the
#: loop's thread), and calls ``murder_pending`` at each turn of its loop.
_LINGERS = "graceful" in inspect.signature(TConn.close).parameters and hasattr(
    _StockThreadWorker, "murder_pending"
)


class ThreadWorker(Http2GoAway, _GracefulWSGIWorker, _StockThreadWorker):  # type: ignore[misc]
    """gunicorn's ``gthread`` worker following graceful's shutdown policy
    (``-k graceful.gunicorn.ThreadWorker``).

    gunicorn's loop, thread pool and keep-alive handling are kept.  At SIGTERM the worker
    keeps accepting while the coordinator asks the policy; responses carry ``Connection:
    close`` (kept-alive clients reconnect, to a new pod once the load balancer knows).
    Once draining begins gunicorn's own stop runs: the connections already queued are
    accepted first (gunicorn 24+), in-flight requests finish, idle kept-alive
    connections are closed.  gunicorn's own HTTP/2 (27+) gets a GOAWAY when nudging
    begins (``graceful.gunicorn._http2``).
    """

    _listeners_closed = False  # set_accept_enabled: the stop's sweep closed them
    _cut_done = False  # the exit answered what waited for a thread (_cut_waiting)
    _quitting = False  # a quick stop: accept no more (accept)

    _lingering: dict[Any, list[float]]  # closed after a response: socket -> [deadline, read]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting: dict[int, Any] = {}  # connections waiting for a thread
        self._taken: dict[int, Any] = {}  # connections a thread has (``handle``)
        self._waiting_lock = threading.Lock()

    def _on_phase(self, phase: Phase) -> None:
        super()._on_phase(phase)
        self.wake_http2()  # each HTTP/2 connection's thread looks at its GOAWAY

    def _prestop_waits(self) -> bool:
        return int(self.cfg.threads) > 1

    def enqueue_req(self, conn: Any) -> None:
        """gunicorn hands a connection to its thread pool: it waits for a thread until
        ``handle`` takes it (``_cut_waiting`` answers it if the exit comes first; after
        the exit's cut, it is answered here)."""
        with self._waiting_lock:
            cut = self._cut_done
            if not cut:
                self._waiting[id(conn)] = conn
        if cut:
            self.nr_conns -= 1
            refuse(conn.sock, timeout_s=0.0)
            return
        super().enqueue_req(conn)

    def handle(self, conn: Any) -> Any:
        """In a pool thread: from waiting to taken (``_taken``, under the same lock) for
        as long as the thread has it; the exit answers those whose request has not
        reached the app yet (``_cut_reading``)."""
        key = id(conn)
        with self._waiting_lock:  # the exit's cut answers under it: never half-written
            mine = self._waiting.pop(key, None) is not None
            if mine:
                self._taken[key] = conn
        if not mine:
            return False  # the exit answered it already (_cut_waiting)
        try:
            return super().handle(conn)
        finally:
            self._taken.pop(key, None)  # first: the exit never finds it taken, not entered
            self._entered.discard(id(conn.sock))

    def handle_http2(self, conn: Any) -> bool:
        """An HTTP/2 connection holds its thread for its whole life: not taken (its
        streams are answered at the exit in HTTP/2, ``Http2GoAway``)."""
        self._taken.pop(id(conn), None)
        return super().handle_http2(conn)

    def handle_h2c_upgrade(self, conn: Any, req: Any, settings: Any) -> Any:
        """An HTTP/1.1 request upgrading to HTTP/2: gunicorn answers ``101`` first, so
        no HTTP/1.1 answer of the exit's may follow — not taken either."""
        self._taken.pop(id(conn), None)
        return super().handle_h2c_upgrade(conn, req, settings)

    _reads_in_threads = True

    def _cut_reading(self) -> int:
        """At the exit, under the cut lock (after ``_cut_waiting``: no thread takes one
        more): a 503 to each connection a thread took whose request has not reached the
        app — being read, or in a ``pre_request`` hook — where the exit's ``os._exit``
        gave a bare EOF (the stock worker's exit waits for its threads and serves it).
        Its thread, arriving at the app, finds its socket noted and waits for the exit.

        Without a lock on the request path: the thread notes ``_entered`` as its request
        enters the app and, done with the connection, leaves ``_taken`` then
        ``_entered``; this notes ``_cut_socks`` then looks at ``_entered`` then at
        ``_taken`` — with one interpreter lock the operations are in one order, so a
        request that entered, or a connection done with (its response written), is never
        answered here, and one that enters later sees the note.  A request seen entered
        is the in-flight cut's to answer.

        Not a connection that sent nothing yet (the close of an idle connection), nor
        TLS (no clear bytes inside it, and not from a second thread), nor HTTP/2: one
        whose protocol is not known yet (its thread reads the preface or the
        handshake), an HTTP/2 preface still unread, or an h2c upgrade
        (``handle_http2``, ``handle_h2c_upgrade``)."""
        if self.cfg.is_ssl:
            return 0
        count = 0
        entered, taken, cut_socks = self._entered, self._taken, self._cut_socks
        for key, conn in list(taken.items()):
            sock = conn.sock
            if id(sock) in entered or not _http1_request_read(conn):
                continue
            cut_socks.add(id(sock))
            if id(sock) in entered or taken.get(key) is not conn:
                cut_socks.discard(id(sock))  # it entered, or is done: not this answer
                continue
            with contextlib.suppress(OSError):
                if sock.send(CUT_RESPONSE, socket.MSG_DONTWAIT) == len(CUT_RESPONSE):
                    count += 1  # a connection with no answer yet: its send buffer is empty
                sock.shutdown(socket.SHUT_WR)  # nothing of the thread's may follow
            with contextlib.suppress(OSError):  # what arrived unread: the exit's close
                while sock.recv(65536, socket.MSG_DONTWAIT):  # sends no reset over it
                    pass
        return count

    def _cut_waiting(self) -> int:
        """At the exit (the heartbeat's thread): a 503 to each connection waiting for a
        thread.  Under the lock, so that a thread taking one (``handle``) finds it
        answered in full, and one queued after (``enqueue_req``) is answered there."""
        with self._waiting_lock:
            self._cut_done = True
            waiting, self._waiting = self._waiting, {}
            for conn in waiting.values():
                refuse(conn.sock, timeout_s=0.0)
        return len(waiting)

    def run(self) -> None:
        self._lingering = {}
        self._start_if_signalled()
        try:
            super().run()
        finally:
            for sock in list(self._lingering):
                self._end_linger(sock, poller=False)
            self._loop_ended()

    def _quit_accepting(self) -> None:
        self._quitting = True  # see accept
        self.alive = False  # gunicorn's loop accepts no more and drains

    def accept(self, *args: Any) -> None:
        """gunicorn's, but none after a quick stop of this worker alone: the handler runs
        as the loop's wait is interrupted, and the loop then dispatched the listener's
        readiness that the same wait reported (``alive`` is looked at only between
        waits) — a connection the quick stop could only cut, where left in the queue the
        worker that replaces this one serves it.  When the pod stops, what is queued is
        taken and answered (``set_accept_enabled``), not left to be reset.  (gunicorn < 24
        passes ``(server, listener)``, later ones ``(listener)``.)"""
        if not (self._quitting and self.coordinator.pod_still_serving()):
            super().accept(*args)

    def get_thread_pool(self) -> Any:
        """gunicorn's pool, whose threads leave the process's signals to the main thread:
        a SIGQUIT a pool thread took did not wake gunicorn's loop, which then accepted a
        queued connection before the handler ran (and the quick stop lost it)."""
        return futures.ThreadPoolExecutor(
            max_workers=self.cfg.threads, initializer=leave_signals_to_main_thread
        )

    def _stop_accepting(self) -> None:
        self.alive = False  # gunicorn's loop stops accepting and drains
        self.wake_http2()
        wake = getattr(getattr(self, "method_queue", None), "defer", None)
        if wake is not None:  # gunicorn 24+: in the loop's thread, now, not within 1 s
            wake(self._cap_idle, time.monotonic() + IDLE_GRACE_S)

    def _cap_idle(self, until: float) -> None:
        """In gunicorn's loop: idle kept-alive connections close by ``until``."""
        for conn in getattr(self, "keepalived_conns", ()):
            conn.timeout = min(conn.timeout, until)

    # ------------------------------------------------- closing after a response

    def finish_request(self, *args: Any) -> None:
        """gunicorn's, but a connection it closes lingers on its poller (module docs).
        gunicorn 26+ calls it with ``(conn, fs)``; before, with ``(fs)`` alone (and
        ``handle`` returns ``(keepalive, conn)``): then it is gunicorn's own."""
        if not _LINGERS or len(args) != 2:
            super().finish_request(*args)
            return
        conn, fs = args
        if fs.cancelled() or fs.exception() is not None or fs.result() is not False:
            super().finish_request(conn, fs)
            return
        self.nr_conns -= 1
        sock = conn.sock
        self._lingering[sock] = [time.monotonic() + LINGER_S, 0]
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            self.poller.register(
                sock, selectors.EVENT_READ, functools.partial(self._read_linger, sock)
            )
        except (OSError, ValueError, KeyError):  # the client left, or the socket is closed
            self._end_linger(sock)

    def _read_linger(self, sock: Any, _fileobj: Any = None) -> None:
        """The lingering socket is readable: the client's FIN, or more to read."""
        state = self._lingering.get(sock)
        if state is None:
            return
        try:
            data = sock.recv(_LINGER_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        state[1] += len(data)
        if not data or state[1] >= _LINGER_BYTES:
            self._end_linger(sock)

    def _end_linger(self, sock: Any, *, poller: bool = True) -> None:
        self._lingering.pop(sock, None)
        if poller:
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.poller.unregister(sock)
        else:  # gunicorn's loop is over: what the client sent, so that the close sends no reset
            with contextlib.suppress(OSError):
                while sock.recv(_LINGER_BYTES):
                    pass
        with contextlib.suppress(OSError):
            sock.close()

    def murder_pending(self) -> None:
        """gunicorn's, and the lingering connections whose time is up."""
        super().murder_pending()
        now = time.monotonic()
        for sock, (deadline, _) in list(self._lingering.items()):
            if deadline > now:
                break  # in the order they began: the same LINGER_S each
            self._end_linger(sock)

    def set_accept_enabled(self, enabled: bool) -> None:
        """gunicorn 24+: before the listeners leave the loop at the stop, accept what
        already waits in the backlog (the stock worker leaves it to be reset), then
        close this worker's copy of the listeners at once.  gunicorn's stop keeps them
        open until the last request ends: a connection queued meanwhile was reset at
        that close, after its client had sent its request; closed now, a sibling that
        still accepts takes it, or, with none left, the connect is refused (safe to
        retry)."""
        if self._listeners_closed:
            return  # the stop's sweep closed them: nothing is left to enable or disable
        draining = not enabled and self.coordinator.draining
        if draining and not self._queue_stays():
            for listener in self.sockets:
                for _ in range(self.cfg.worker_connections):
                    if self.nr_conns >= self.cfg.worker_connections:
                        break
                    before = self.nr_conns
                    self.accept(listener)
                    if self.nr_conns == before:  # nothing was waiting
                        break
        super().set_accept_enabled(enabled)
        if draining:
            # Once: the loop's own toggle at capacity may run this while draining began
            # and before alive is False, and must not use the closed listeners after.
            self._listeners_closed = True
            for listener in self.sockets:
                listener.close()  # gunicorn closes them again at the end: a no-op


def _http1_request_read(conn: Any) -> bool:
    """Whether a taken connection carries an HTTP/1.x request the exit may answer: its
    parser is HTTP/1's, or, before its thread began reading it, what waits on the
    socket is not an HTTP/2 preface.  Not while the thread sets the connection up (its
    protocol unknown), nor before the client sent anything."""
    if getattr(conn, "is_http2", False):
        return False
    if getattr(conn, "initialized", True):
        return getattr(conn, "parser", None) is not None
    if not getattr(conn, "data_ready", True):
        return False  # gunicorn still waits for its first byte
    try:
        head = conn.sock.recv(len(_H2_PREFACE), socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    return bool(head) and not _H2_PREFACE.startswith(head[: len(_H2_PREFACE)])
