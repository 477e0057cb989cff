"""``graceful.gunicorn.ThreadWorker``: gunicorn's ``gthread`` worker following graceful's
shutdown policy (the common part: ``graceful.gunicorn._wsgi``).

gunicorn's loop, thread pool and keep-alive handling are kept; the stop is gunicorn's
own (``alive = False``), with two additions.  On gunicorn 24+ ``set_accept_enabled``
first accepts what already waits in the backlog and then closes this worker's copy of
the listeners at once: gunicorn keeps them open until the last request ends, and a
connection queued meanwhile was reset at that close after its client had sent its
request.  And a connection handed to the pool but still waiting for a thread is
remembered (``enqueue_req``/``handle``), so that the exit answers it 503 rather than
closing it unanswered.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from gunicorn.workers.gthread import ThreadWorker as _StockThreadWorker

from .._core.policy import Phase
from ._http2 import Http2GoAway
from ._wsgi import _GracefulWSGIWorker, _refuse


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

    def _on_phase(self, phase: Phase) -> None:
        super()._on_phase(phase)
        self.wake_http2()  # each HTTP/2 connection's thread looks at its GOAWAY

    def _prestop_waits(self) -> bool:
        return int(self.cfg.threads) > 1

    def enqueue_req(self, conn: Any) -> None:
        """gunicorn hands a connection to its thread pool: it waits for a thread until
        ``handle`` takes it (``_cut_waiting`` answers it if the exit comes first)."""
        self._waiting[id(conn)] = conn
        super().enqueue_req(conn)

    def handle(self, conn: Any) -> Any:
        self._waiting.pop(id(conn), None)
        return super().handle(conn)

    def _cut_waiting(self) -> int:
        waiting = list(getattr(self, "_waiting", {}).values())
        for conn in waiting:
            _refuse(conn.sock, timeout_s=0.0)
        return len(waiting)

    def run(self) -> None:
        self._waiting: dict[int, Any] = {}  # connections waiting for a thread
        self._start_if_signalled()
        try:
            super().run()
        finally:
            self._loop_ended()

    def handle_quit(self, sig: int, frame: Any) -> None:
        """SIGINT, SIGQUIT: stop at once.  gunicorn's ``sys.exit`` here would wait for
        the pool's threads, so a request that runs on would hold the worker."""
        self.cfg.worker_int(self)
        logging.shutdown()
        os._exit(0)

    def _stop_accepting(self) -> None:
        self.alive = False  # gunicorn's loop stops accepting and drains
        self.wake_http2()
        wake = getattr(getattr(self, "method_queue", None), "defer", None)
        if wake is not None:  # gunicorn 24+: wake the loop now, not within 1 s
            wake(lambda: None)

    def set_accept_enabled(self, enabled: bool) -> None:
        """gunicorn 24+: before the listeners leave the loop at the stop, accept what
        already waits in the backlog (the stock worker leaves it to be reset), then
        close this worker's copy of the listeners at once.  gunicorn's stop keeps them
        open until the last request ends: a connection queued meanwhile was reset at
        that close, after its client had sent its request; closed now, a sibling that
        still accepts takes it, or, with none left, the connect is refused (safe to
        retry)."""
        draining = not enabled and self.coordinator.draining
        if draining:
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
            for listener in self.sockets:
                listener.close()  # gunicorn closes them again at the end: a no-op
