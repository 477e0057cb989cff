"""The management listener of a process that runs workers: one for the pod, answering for
every worker — the ``--workers`` parent of ``graceful run`` (``graceful._cli.workers``)
and gunicorn's master (``graceful.gunicorn._master``).

There the workers open no management listener and answer none of the health paths on
the app's port (unless ``--health-on-app-port``); the parent does, on a thread of its own
(the parent's main thread is busy with its workers), with the standard library's
threading HTTP server:

* readiness is the pod's: 503 ``starting`` until a worker serves, 200 while the parent
  serves, 503 from its shutdown on (SIGTERM, SIGINT, or a preStop request);
* liveness: 200 while the parent runs its workers;
* preStop starts the parent's shutdown as a SIGTERM would (every worker drains by the
  policy) and answers once every worker exited, or at the kill deadline;
* metrics: every process's, from ``PROMETHEUS_MULTIPROC_DIR`` (the workers write theirs
  there; the option is refused without it), rendered by the caller's ``metrics``.

The listener is bound when it is made (a port in use raises ``OSError``) and closed after
the last worker exited and the preStop requests in progress were answered.  Its
connections are the parent's: no worker ever counts them as traffic.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

__all__ = ("ANSWER_GRACE_S", "MetricsText", "ThreadedManagement")

#: ``(names) -> (status, body, content type)``: every process's metrics
#: (``graceful.metrics.every_process``).
MetricsText = Callable[[Sequence[str]], tuple[int, bytes, str]]

logger = logging.getLogger("graceful")

#: How long a preStop request in progress may still take to be answered once the last
#: worker exited, s.
ANSWER_GRACE_S: Final = 1.0


class ThreadedManagement:
    """A parent's management listener, on a thread.

    Args:
        host, port: Where to listen (port 0: any free port; ``port`` tells which).
        paths: ``{kind: path or None}`` for ``readiness``, ``liveness``, ``prestop``,
            ``metrics``.
        state: ``() -> (serving, stopping, workers)``: what the parent knows, asked from
            the listener's threads (plain reads of the parent's attributes).
        stop: Starts the parent's shutdown, once (a preStop request).
        deadline: ``() -> the monotonic kill deadline, or None``.
        metrics: Renders every process's metrics (with ``paths["metrics"]``).
        who: How the start-up line names the listener's owner.
        checkers: Told of each readiness answer: ``(peer, user agent, status)``.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        paths: dict[str, str | None],
        *,
        state: Callable[[], tuple[bool, bool, int]],
        stop: Callable[[], None],
        deadline: Callable[[], float | None],
        metrics: MetricsText | None = None,
        who: str = "for every worker",
        checkers: Callable[[str | None, str | None, int], None] | None = None,
    ) -> None:
        self._state = state
        self._checkers = checkers
        self._stop = stop
        self._deadline = deadline
        self._done = threading.Event()
        self._pid = 0  # the process that serves it, once started
        self._answering = 0
        self._lock = threading.Lock()
        self._metrics_text = metrics
        self._who = who
        self.paths: Final = {path: kind for kind, path in paths.items() if path is not None}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        handler = _handler(self)
        server_class = type(
            "_Server",
            (http.server.ThreadingHTTPServer,),
            {"address_family": family, "daemon_threads": True, "allow_reuse_address": True},
        )
        self._server = server_class((host, port), handler)
        self.host: Final = host
        self.port: Final = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="graceful-management", daemon=True
        )

    def start(self, say: Callable[[str], object] | None = None) -> None:
        """Serve on a thread; ``say`` logs the start-up line (default: graceful's
        logger, at INFO)."""
        self._pid = os.getpid()
        self._thread.start()
        line = "management listener on {} port {}, {}: {}".format(
            self.host,
            self.port,
            self._who,
            ", ".join(f"{kind} {path}" for path, kind in self.paths.items()) or "no paths",
        )
        (say or logger.info)(line)

    def forget(self) -> None:
        """In a child forked with the listener's socket: close the child's copy (the
        parent's thread alone serves it)."""
        with contextlib.suppress(OSError):
            self._server.socket.close()

    def workers_gone(self) -> None:
        """The last worker exited: answer the preStop requests waiting, then close.
        Nothing in a child forked from the process that started it (its ``atexit``
        handlers are inherited; the thread is not)."""
        if os.getpid() != self._pid:
            return
        self._done.set()
        until = time.monotonic() + ANSWER_GRACE_S
        while time.monotonic() < until:
            with self._lock:
                if not self._answering:
                    break
            time.sleep(0.01)
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ answers

    def answer(
        self, path: str, query: str, peer: str | None = None, user_agent: str | None = None
    ) -> tuple[int, str, bytes]:
        """(status, content type, body) for ``path``; a readiness answer is reported to
        ``checkers`` with who asked (``peer``, ``user_agent``)."""
        status, content_type, body = self._answer(path, query)
        if self._checkers is not None and self.paths.get(path) == "readiness":
            self._checkers(peer, user_agent, status)
        return status, content_type, body

    def _answer(self, path: str, query: str) -> tuple[int, str, bytes]:
        kind = self.paths.get(path)
        text = "text/plain; charset=utf-8"
        serving, stopping, workers = self._state()
        if kind is None:
            known = ", ".join(self.paths) or "none"
            return 404, text, f"not found (served here: {known})\n".encode()
        if kind == "readiness":
            if stopping:
                return 503, text, f"shutting down ({workers} workers left)\n".encode()
            if not serving:
                return 503, text, b"starting\n"
            return 200, text, f"ready ({workers} workers)\n".encode()
        if kind == "liveness":
            return 200, text, f"alive ({workers} workers)\n".encode()
        if kind == "prestop":
            return self._prestop(text)
        return self._metrics(parse_qs(query).get("name[]", []))

    def _prestop(self, text: str) -> tuple[int, str, bytes]:
        with self._lock:
            self._answering += 1
        try:
            self._stop()
            while not self._done.is_set():
                deadline = self._deadline()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return 200, text, b"stopping: the kill deadline passed\n"
                self._done.wait(0.5 if left is None else min(0.5, left))
            return 200, text, b"stopped: every worker exited\n"
        finally:
            with self._lock:
                self._answering -= 1

    def _metrics(self, names: list[str]) -> tuple[int, str, bytes]:
        if self._metrics_text is None:
            return 404, "text/plain", b"no metrics here\n"
        status, body, content_type = self._metrics_text(names)
        return status, content_type, body


def _handler(management: ThreadedManagement) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "graceful"
        protocol_version = "HTTP/1.1"
        timeout = 10  # a client that sends nothing is dropped

        def do_GET(self) -> None:
            self._respond(head_only=False)

        def do_HEAD(self) -> None:
            self._respond(head_only=True)

        def _respond(self, *, head_only: bool) -> None:
            try:
                url = urlsplit(self.path)
            except ValueError:  # a malformed target: this request's end, not the listener's
                status, content_type, body = 400, "text/plain", b"bad request target\n"
            else:
                if head_only and management.paths.get(url.path) == "prestop":
                    status, content_type, body = 405, "text/plain", b"method not allowed\n"
                else:
                    status, content_type, body = management.answer(
                        url.path, url.query, self.client_address[0], self.headers["User-Agent"]
                    )
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if not head_only:
                self.wfile.write(body)
            self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("management: " + format, *args)

    return Handler
