"""``graceful.gunicorn.SyncWorker``: gunicorn's ``sync`` worker following graceful's
shutdown policy (the common part: ``graceful.gunicorn._wsgi``).

One thread serves one request at a time, so while it is inside a request nothing of
gunicorn's accepts or notices the stop.  The stop therefore happens in the
coordinator's thread (``_stop_accepting``): it sweeps what the kernel queued on the
listeners and closes this worker's copy of them at once, so that a connection arriving
later finds a sibling that still accepts, or is refused (safe to retry), instead of
queueing behind a busy worker to be reset at its exit.  ``_accept_lock`` keeps that
sweep and the loop's own ``accept()`` from both taking a connection or racing a close.
The loop then serves what was swept, each only if a request as long as the longest
seen can still finish before the exit, and answers the rest 503 (``_serve_held``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import select
import threading
import time
from typing import Any

from gunicorn.workers.sync import SyncWorker as _StockSyncWorker

from ._answers import refuse
from ._wsgi import _GracefulWSGIWorker

_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED)


class SyncWorker(_GracefulWSGIWorker, _StockSyncWorker):  # type: ignore[misc]
    """gunicorn's ``sync`` worker following graceful's shutdown policy
    (``-k graceful.gunicorn.SyncWorker``).

    With ``--threads`` above 1 gunicorn itself replaces any worker named ``…SyncWorker``
    by its stock ``gthread`` before importing it, so no code of graceful's runs: use
    ``ThreadWorker``, or ``WSGIWorker``, which picks by ``--threads``.  Given as a class
    (a config file's ``worker_class = SyncWorker``), gunicorn does not replace it, and
    ``--threads`` above 1 is refused at start-up.
    """

    _draining = False
    _running = False  # run() took over the listeners (see _stop_accepting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._accept_lock = threading.Lock()

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        threads = int(cfg.threads)
        if threads > 1:
            raise RuntimeError(
                f"graceful: --threads {threads} with graceful.gunicorn.SyncWorker, which "
                "serves one request at a time: use -k graceful.gunicorn.ThreadWorker (or "
                "graceful.gunicorn.WSGIWorker, which picks by --threads)"
            )
        super().check_config(cfg, log)

    def run(self) -> None:
        for listener in self.sockets:
            listener.setblocking(False)
        # What gunicorn's handle() is given for a listener: its address, which stays
        # readable once the stop closed the listener under a request still being read.
        self._names = {
            id(listener): _ListenerName(listener.getsockname()) for listener in self.sockets
        }
        self._held: list[tuple[Any, Any, Any]] = []  # swept at the stop, served here
        with self._accept_lock:  # the loop's accept vs the stop's sweep
            self._running = True
            if self._draining:  # the stop came before the loop (while importing)
                self._sweep()
        self._start_if_signalled()
        heartbeat = self.timeout or 0.5
        while self.alive and not self._draining:
            self.notify()
            for listener in self._ready(heartbeat):
                # As gunicorn's own loop: a heartbeat right before each accept, so that a
                # request that arrives after an idle wait gets the whole of ``--timeout``.
                self.notify()
                if not self._accept(listener):
                    break
            if not self.is_parent_alive():
                break
        if self._draining:
            self._serve_held()
        self._loop_ended()

    def _quit_accepting(self) -> None:
        """In SIGQUIT's (SIGINT's) handler: gunicorn's loop takes no more connections —
        not even one already reported ready when the handler ran, which the quick stop
        could only answer 503 where the worker that replaces this one serves it."""
        self.alive = False

    def _stop_accepting(self) -> None:
        """In the coordinator's thread, at draining: take what the kernel queued and
        close this worker's copy of the listeners at once, even while the worker's one
        thread is inside a request.  A connection that arrives later finds a sibling
        still accepting, or is refused (safe to retry) — not queued behind a busy worker
        and reset at its exit.  The loop serves what was taken (``_serve_held``)."""
        with self._accept_lock:
            self._draining = True
            if self._running:  # else run() sweeps when it starts
                self._sweep()
        with contextlib.suppress(OSError):
            os.write(self.PIPE[1], b".")  # wake the loop's select

    def _sweep(self) -> None:
        """Take every connection queued on the listeners, then close them (with
        ``_accept_lock`` held, the listeners non-blocking) — none if the queue stays
        (``_queue_stays``)."""
        taking = not self._queue_stays()
        for listener in self.sockets:
            while taking:
                try:
                    client, address = listener.accept()
                except OSError:
                    break
                self._held.append((self._names[id(listener)], client, address))
            listener.close()

    def _ready(self, timeout: float) -> list[Any]:
        if self._draining:
            return []  # the stop took the listeners
        try:
            ready, _, _ = select.select(self.wait_fds, [], [], timeout)
        except (OSError, ValueError, TypeError) as exc:  # a listener closed at the stop
            # The stop may close them between the check above and the select: a socket
            # gives fileno -1 (ValueError) or EBADF, gunicorn's listener wrapper has no
            # fileno() once closed (TypeError), which ended the worker with its backlog.
            if not isinstance(exc, OSError) or exc.errno in (errno.EINTR, errno.EBADF):
                return []
            raise
        if self.PIPE[0] in ready:
            try:
                while os.read(self.PIPE[0], 4096):
                    pass
            except BlockingIOError:
                pass
        return [fd for fd in ready if not isinstance(fd, int)]  # the listeners, not the pipe

    def _accept(self, listener: Any) -> bool:
        """Accept and serve one connection; ``False`` if none was waiting or the stop
        took the listeners."""
        with self._accept_lock:
            if self._draining or not self.alive:  # the stop, a quick stop, max requests
                return False
            try:
                client, address = listener.accept()
            except OSError as exc:
                if exc.errno in _AGAIN:
                    return False
                raise
        client.setblocking(True)
        # Not the listener itself: the stop may close it while this request is read
        # (gunicorn then reads its address, for the WSGI environ: EBADF, a 500).
        self.handle(self._names[id(listener)], client, address)
        return True

    def _serve_held(self) -> None:
        """Serve the connections the stop took from the backlog, each only if a request
        as long as the longest seen can still finish before the exit; a 503 (``Retry-
        After``) to the others, never a cut or a reset.  The loop sees ``_draining`` as
        soon as the stop sets it, before the sweep (in the coordinator's thread) is
        over: the lock waits for the sweep, which closes the listeners once it is.  One
        at a time, under the lock: what is left when the heartbeat ends the process is
        the exit's to answer (``_cut_waiting``).  Once stopping began (the drain
        deadline), the rest is refused."""
        while True:
            with self._accept_lock:
                if not self._held:
                    return
                listener, client, address = self._held.pop(0)
            self.notify()
            if not self.coordinator.cutting and (
                time.monotonic() + self._longest_request_s() < self._exit_at()
            ):
                client.setblocking(True)
                self.handle(listener, client, address)
            else:
                refuse(client)

    def _cut_waiting(self) -> int:
        """At the exit (the heartbeat's thread): a 503 to what the stop took from the
        backlog and the loop has not served.  Under the lock, so that the loop cannot
        end meanwhile and gunicorn's exit cut these answers short."""
        with self._accept_lock:
            held = getattr(self, "_held", [])
            for _listener, client, _address in held:
                refuse(client, timeout_s=0.0)
            count = len(held)
            held.clear()
        return count

    def _longest_request_s(self) -> float:
        """The longest request the coordinator measured, asked in its thread (its clock
        is its event loop's; what still runs is this worker's own hold, not a request);
        0 if it does not answer at once."""
        answer: concurrent.futures.Future[float | None] = concurrent.futures.Future()
        coordinator = self.coordinator
        assert self.graceful is not None
        if not self.graceful.running:  # its thread is gone: call() would run nothing
            return 0.0
        self.graceful.call(lambda: answer.set_result(coordinator.longest_request_s(running=False)))
        try:
            return answer.result(timeout=0.2) or 0.0
        except concurrent.futures.TimeoutError:
            return 0.0


class _ListenerName:
    """What gunicorn's ``handle`` asks of the listener a connection came from: its
    address, for the WSGI environ, read once at the start, so that it is still there
    after the stop closed the listener."""

    __slots__ = ("_name",)

    def __init__(self, name: Any) -> None:
        self._name = name

    def getsockname(self) -> Any:
        return self._name
