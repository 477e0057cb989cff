"""The ``--workers`` parent of ``graceful run``.

Why ``--workers`` has a parent process, and what it promises
------------------------------------------------------------
With ``--workers N`` the parent binds the socket and starts N ``graceful run`` worker
processes that share it.  In a container only PID 1 — the parent — gets the kubelet's
SIGTERM, so the parent exists to relay signals and to keep the workers honest:

* **Workers never outlive the parent.**  Each worker asks the kernel (Linux
  ``PR_SET_PDEATHSIG``) to be told when its parent dies, right at start, then checks
  that the parent is still the one that started it (closing the race with a parent that
  died before the request).  The worker then gets one SIGTERM — not SIGKILL: an
  orphaned worker drains like any other, and it still exits by its deadline because a
  worker owns its process (``hard_exit``).  On other systems a SIGKILLed parent leaves
  its workers running until they are stopped themselves.
* **No signal is lost at start-up.**  The parent blocks the shutdown signals while it
  spawns a worker; the worker inherits the mask, records them
  (``graceful._core.signals.defer_signals``) and only then unblocks them, so a SIGTERM
  that arrives while the worker's interpreter starts or the app is imported begins the
  drain once the server is up, instead of killing the worker or being dropped.
* **SIGTERM, SIGINT and SIGQUIT are forwarded** to every worker (a repeat too, which
  escalates there); the parent then waits for the workers until the kill deadline
  (``--grace-period``, else Kubernetes' 30 s) and SIGKILLs what is left.
* **SIGHUP reloads**, as with gunicorn and ``uvicorn --workers``: N new workers start;
  once every one of them serves, the old ones get SIGTERM and drain by the policy while
  the new ones accept on the same socket.  A new worker that fails to start aborts the
  reload and the old workers keep serving.
* **A worker that dies while serving is replaced.**  One that fails to start — exit
  status 3, e.g. an import error — stops everything with status 3 if no worker ever
  started, or after three such failures in a row: a broken app must not be restarted
  forever.

A worker tells the parent it serves through a pipe (one byte at uvicorn's first tick),
and the parent learns of exits from one thread per worker that waits for it; both arrive
as callables on one queue, as do the signals (``catch_signals(…, schedule=tasks.put)``),
so the parent's main loop waits on that queue with the kill deadline as its timeout.  It
waits in ``select()`` on a socket that every ``put`` and every signal (the interpreter's
wakeup fd) writes to, not on a lock: whichever thread the kernel delivers a signal to,
the main thread wakes and runs the Python-level handler.  The parent also unblocks the
signals it handles at start-up, whatever mask it inherited.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from .._core.deadlines import DEFAULT_GRACE_PERIOD_S
from .._core.signals import signal_name
from .address import _listener, _remove_uds, _where
from .command import EXIT_FAILED, EXIT_NOT_STARTED, EXIT_OK, Invocation
from .relay import Relay
from .tasks import _Tasks

if TYPE_CHECKING:
    from .._core.threaded import MetricsText, ThreadedManagement
    from .._options import Values
    from .relay import Relay

logger = logging.getLogger("graceful")

#: Boot failures in a row (after a worker once served) that stop the parent.
MAX_BOOT_FAILURES: Final = 3

#: Signals the parent relays to its workers; SIGHUP it handles itself.
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
PARENT_SIGNALS: Final = (*FORWARDED_SIGNALS, signal.SIGHUP)
#: What the kernel sends a worker when its parent dies (Linux; see _die_with_parent).
PARENT_DEATH_SIGNAL: Final = getattr(signal, "SIGRTMIN", signal.SIGTERM)
_PR_SET_PDEATHSIG: Final = 1


def _serve_workers(inv: Invocation, argv: Sequence[str]) -> int:
    sock = _listener(inv)
    command = [sys.executable, "-m", "graceful", "run", *argv]
    values = inv.values
    try:
        supervisor = _Supervisor(
            sock, command, values["workers"], values["grace_period"], values["kubernetes"]
        )
        if values["management_port"] is not None:
            supervisor.relay = Relay.of(values, lambda: supervisor.deadline)
            supervisor.management = _management(values, supervisor)
        return supervisor.run()
    finally:
        _remove_uds(inv)


def _management(values: Values, supervisor: _Supervisor) -> ThreadedManagement:
    """The pod's management listener, in the parent (``graceful._core.threaded``)."""
    from .._core.threaded import ThreadedManagement

    metrics: MetricsText | None = None
    if values["metrics_path"] is not None:
        from ..metrics import every_process

        metrics = every_process

    return ThreadedManagement(
        values["management_host"] or values["host"],
        values["management_port"],
        {k: values[f"{k}_path"] for k in ("readiness", "liveness", "prestop", "metrics")},
        state=lambda: (supervisor.ever_ready, supervisor.stopping, len(supervisor.workers)),
        stop=lambda: supervisor.tasks.put(supervisor._prestop),
        deadline=lambda: supervisor.deadline,
        metrics=metrics,
        checkers=None if supervisor.relay is None else supervisor.relay.answered,
    )


def _describe(status: int) -> str:
    return f"killed by {signal_name(-status)}" if status < 0 else f"exit status {status}"


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Block the parent's signals while a worker is spawned: the worker inherits the
    mask and unblocks it only once it records them (see ``graceful._cli.run.main``)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    ready_fd: int
    ready: bool = False
    retiring: bool = False  # told to stop by a reload or an aborted one


@dataclass(eq=False)
class _Supervisor:
    """The ``--workers`` parent (see the module docs)."""

    sock: socket.socket
    command: list[str]
    count: int
    grace_period_s: float | None
    kubernetes: bool = False
    workers: list[_Worker] = field(default_factory=list)
    tasks: _Tasks = field(default_factory=lambda: _Tasks())
    stopping: bool = False
    deadline: float | None = None
    status: int = EXIT_OK
    ever_ready: bool = False
    boot_failures: int = 0
    reload: list[_Worker] | None = None  # the new workers of a reload in progress
    management: ThreadedManagement | None = None  # --management-port: the pod's listener
    relay: Relay | None = None  # the management port's health checkers (relay.py)

    def run(self) -> int:
        from .._core.signals import catch_signals

        # A mask inherited from whoever started us (a thread of a program that blocks
        # them) would leave these signals pending for ever: they are ours now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENT_SIGNALS)
        if self.relay is not None:
            self.relay.ignore_in_children()
        with (
            self.tasks.woken_by_signals(),
            catch_signals(PARENT_SIGNALS, self._on_signal, schedule=self.tasks.put),
        ):
            for _ in range(self.count):
                self._spawn()
            if self.management is not None:
                self.management.start()
            where = _where(self.sock)
            logger.info(
                "listening on %s with %d workers (pids %s)",
                where,
                self.count,
                ", ".join(str(w.proc.pid) for w in self.workers),
            )
            while self.workers:
                timeout = None
                if self.deadline is not None:
                    timeout = max(0.0, self.deadline - time.monotonic())
                try:
                    task = self.tasks.get(timeout=timeout)
                except queue.Empty:
                    self._kill_all()
                    continue
                task()
            if self.management is not None:  # closed last: a preStop gets its answer
                self.management.workers_gone()
        self.tasks.close()
        self.sock.close()
        return self.status

    # ------------------------------------------------------------ the workers

    def _spawn(self) -> _Worker:
        ready_r, ready_w = os.pipe()
        listening = self.sock.fileno()
        command = [
            *self.command,
            *("--worker-fd", str(listening), "--ready-fd", str(ready_w)),
            *("--parent-pid", str(os.getpid())),
        ]
        try:
            with _signals_blocked():
                proc = subprocess.Popen(
                    command, pass_fds=(listening, ready_w), start_new_session=True
                )
        finally:
            os.close(ready_w)
        worker = _Worker(proc, ready_r)
        self.workers.append(worker)
        # The watcher inherits the blocked mask: a process-directed signal must reach the
        # main thread, which waits on the queue, not a watcher (it would not wake main).
        with _signals_blocked():
            threading.Thread(
                target=self._watch, args=(worker,), name=f"graceful-worker-{proc.pid}", daemon=True
            ).start()
        return worker

    def _watch(self, worker: _Worker) -> None:
        """Report, through the queue, that the worker serves and when it exits."""
        try:
            if os.read(worker.ready_fd, 1):
                self.tasks.put(lambda: self._on_ready(worker))
        except OSError:
            pass
        finally:
            os.close(worker.ready_fd)
        worker.proc.wait()
        self.tasks.put(lambda: self._on_exit(worker))

    def _signal(self, worker: _Worker, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            worker.proc.send_signal(signum)

    def _kill_all(self) -> None:
        """The kill deadline passed."""
        self.deadline = None
        for worker in self.workers:
            logger.error("worker %d outlived the kill deadline; killing it", worker.proc.pid)
            self._signal(worker, signal.SIGKILL)
        self.status = EXIT_FAILED

    # ------------------------------------------------------------------ events

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            self._start_reload()
            return
        if not self.stopping:
            # Not ready from here on (``stopping``), before the line (a write may wait).
            self._stop()
            logger.info(
                "%s: stopping %d workers (pids %s)",
                signal_name(signum),
                len(self.workers),
                ", ".join(str(w.proc.pid) for w in self.workers),
            )
        for worker in self.workers:
            self._signal(worker, signum)

    def _prestop(self) -> None:
        """A preStop request on the management port: as a SIGTERM, once."""
        if not self.stopping:
            self._on_signal(signal.SIGTERM)

    def _stop(self, status: int | None = None) -> None:
        """No more restarts; SIGKILL what is left at the kill deadline."""
        self.stopping = True
        self.reload = None
        # No new worker: our copy would keep the socket (and its backlog) past the last.
        self.sock.close()
        if status is not None:
            self.status = status
        grace = DEFAULT_GRACE_PERIOD_S if self.grace_period_s is None else self.grace_period_s
        self.deadline = time.monotonic() + grace
        if self.relay is not None and status is None:
            self.relay.start(lambda: self.tasks.put(self._checkers_released))
        if self.kubernetes and status is None:
            # The workers plan against the pod's own deadline: so must our SIGKILL.
            threading.Thread(
                target=self._read_pod_deadline, args=(time.time(),), daemon=True
            ).start()

    def _read_pod_deadline(self, requested_at_s: float) -> None:
        from ..kubernetes import read_kill_deadline

        found = read_kill_deadline(
            requested_at_s, grace_period_known=self.grace_period_s is not None
        )
        if found is not None:
            at, why = found
            self.tasks.put(lambda: self._set_deadline(at, why))

    def _set_deadline(self, wall_clock_s: float, why: str) -> None:
        if self.deadline is None:  # already past it
            return
        self.deadline = time.monotonic() + (wall_clock_s - time.time())
        logger.info(
            "kill deadline from %s: workers left then are killed in %.1f s",
            why,
            self.deadline - time.monotonic(),
        )

    def _start_reload(self) -> None:
        if self.stopping:
            logger.info("SIGHUP: ignored while stopping")
            return
        if self.reload is not None:
            logger.info("SIGHUP: ignored, a reload is in progress")
            return
        self.reload = [self._spawn() for _ in range(self.count)]
        logger.info(
            "SIGHUP: reloading: started workers %s; the old ones stop once they serve",
            ", ".join(str(w.proc.pid) for w in self.reload),
        )

    def _retire(self, workers: list[_Worker]) -> None:
        for worker in workers:
            worker.retiring = True
            self._signal(worker, signal.SIGTERM)
            self._release(worker)  # the pod stays in rotation: nothing to wait for

    def _checkers_released(self) -> None:
        assert self.relay is not None
        self.relay.released = True
        for worker in self.workers:
            if worker.ready:
                self._release(worker)

    def _release(self, worker: _Worker) -> None:
        if self.relay is not None:
            from .relay import RELEASED_SIGNAL

            self._signal(worker, RELEASED_SIGNAL)

    def _on_ready(self, worker: _Worker) -> None:
        logger.info("worker %d serves", worker.proc.pid)
        worker.ready = True
        if self.relay is not None and self.relay.released:
            self._release(worker)
        self.ever_ready = True
        self.boot_failures = 0
        if self.reload is not None and all(w.ready for w in self.reload):
            old = [w for w in self.workers if w not in self.reload and not w.retiring]
            logger.info(
                "reload: new workers serve; stopping the old ones (pids %s)",
                ", ".join(str(w.proc.pid) for w in old),
            )
            self.reload = None
            self._retire(old)

    def _on_exit(self, worker: _Worker) -> None:
        self.workers.remove(worker)
        pid, status = worker.proc.pid, worker.proc.returncode
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # A worker that was killed left its live gauges behind (graceful.metrics).
            try:
                from .. import metrics

                metrics.mark_process_dead(pid)
            except Exception:  # no prometheus-client, or a broken directory: not ours
                logger.debug("could not mark worker %d dead for the metrics", pid, exc_info=True)
        if self.stopping:
            log = logger.info if status == 0 else logger.error
            log("worker %d exited (%s)", pid, _describe(status))
            if status != 0 and self.status == EXIT_OK:
                self.status = EXIT_FAILED
            return
        if worker.retiring:
            logger.info("retired worker %d exited (%s)", pid, _describe(status))
            return
        if worker.ready:
            if status == 0:  # stopped by a signal of its own, say
                logger.warning("worker %d stopped; starting a new one", pid)
            else:
                logger.error("worker %d died (%s); starting a new one", pid, _describe(status))
            self._spawn()
            return
        # It never served: the app (or its configuration) is broken, perhaps for good.
        self.boot_failures += 1
        if self.reload is not None and worker in self.reload:
            logger.error(
                "reload failed: new worker %d did not start (%s); the old workers keep serving",
                pid,
                _describe(status),
            )
            self._retire([w for w in self.reload if w is not worker])
            self.reload = None
            return
        if not self.ever_ready or self.boot_failures >= MAX_BOOT_FAILURES:
            times = "" if self.boot_failures == 1 else f" ({self.boot_failures} times in a row)"
            logger.error(
                "worker %d failed to start (%s)%s; stopping", pid, _describe(status), times
            )
            self._stop(EXIT_NOT_STARTED)
            for other in self.workers:
                self._signal(other, signal.SIGTERM)
            return
        logger.error("worker %d failed to start (%s); trying again", pid, _describe(status))
        self._spawn()


# ---------------------------------------------------------------- in the worker


def _die_with_parent(parent_pid: int) -> bool:
    """Have the kernel stop this worker with one SIGTERM when its parent dies (Linux).

    The kernel sends the "parent death" signal each time the worker is re-parented,
    and when the parent is killed it is re-parented once per thread the parent had:
    several SIGTERMs would escalate the drain into a cut.  So the kernel sends
    ``PARENT_DEATH_SIGNAL``, whose handler turns the first into one SIGTERM.

    Returns:
        ``False`` if the parent already died (before the request could cover it).
    """
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
        except (OSError, AttributeError):
            print("graceful: cannot ask to be stopped with the parent (prctl)", file=sys.stderr)
            return os.getppid() == parent_pid
        stopped = False

        def parent_died(signum: int, frame: object) -> None:
            nonlocal stopped
            prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
            if not stopped:
                stopped = True
                signal.raise_signal(signal.SIGTERM)

        signal.signal(PARENT_DEATH_SIGNAL, parent_died)
        if prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
            print("graceful: cannot ask to be stopped with the parent (prctl)", file=sys.stderr)
    return os.getppid() == parent_pid
