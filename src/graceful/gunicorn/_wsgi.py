"""What graceful's WSGI workers share: ``graceful.gunicorn.SyncWorker`` (``_sync``) and
``ThreadWorker`` (``_thread``), gunicorn's ``sync`` and ``gthread`` workers with a
shutdown policy, and ``WSGIWorker`` (``_pick``), which picks one by ``--threads``.

gunicorn's workers stop accepting at SIGTERM: connections that kube-proxy or an
ingress still sends for a second or more are refused once every worker is gone, and
those queued in the listener's backlog are reset; ``gthread`` answers a kept-alive
connection once more for at most 2 s and closes the rest.  These workers, configured
with the ``GRACEFUL_*`` variables of the other graceful workers (checked in the master),
follow a ``ShutdownCoordinator`` — the same one as every other adapter, run in a thread
of its own by ``graceful.wsgi.CoordinatorThread``:

* at SIGTERM they keep accepting and serving as the policy says (accept-until-idle:
  until no new connection's first request arrived for ``GRACEFUL_IDLE`` s; probes do
  not count; connections waiting in the listener's accept queue while every thread is
  busy do), then take what already waits in the backlog, close their copy of the
  listeners at once, serve what they took (503 to what cannot finish before the
  exit) and exit;
* every request is timed (``measure_requests_always``): "accepting at most X s" at
  SIGTERM already knows the traffic, and only ends sooner;
* ``graceful.wsgi.GracefulMiddleware`` answers ``/readyz`` (503 from SIGTERM on, 200
  while gunicorn's master still holds its listeners: a reload is not a shutdown),
  ``/livez``, preStop and metrics, counts requests in flight and puts
  ``environ["graceful.drain"]``; responses close their connection while the policy
  nudges (gunicorn's ``force_close``); ``GRACEFUL_KUBERNETES`` reads the pod's kill
  deadline and endpoint removal as for the ASGI workers;
* they keep heartbeating while shutting down, so gunicorn's ``--timeout`` does not kill
  them in a long request, and are out the kill margin before gunicorn's
  ``--graceful-timeout`` whatever the app does: the heartbeat thread answers 503 on
  what it cuts before a response started and ends the process at the exit deadline,
  and if the app holds the interpreter (a C extension that never releases the GIL) an
  alarm signal with its default action, armed at SIGTERM, ends it a moment later (an
  app that holds it when SIGTERM arrives delays even that: gunicorn's SIGKILL ends it);
* a repeated SIGTERM is the master's relay of a process-group signal, however late it
  comes, never an escalation; SIGINT and SIGQUIT (gunicorn's quick shutdown) go straight
  to stopping, as under the ASGI workers.

The drain waits for the worker's own loop: from the start of draining the worker holds
one connection open in the coordinator (``connection_opened``; the log's counts include
it: gunicorn's loop still holds connections) until it has served its backlog and
gunicorn's loop has returned, so the coordinator never declares the drain done while
accepted connections are still on their way.

A thread cannot be cancelled.  When stopping begins before the kill deadline's share
(the drain deadline, SIGINT or SIGQUIT) and a request still runs, the worker answers
503 on each request whose response has not started and ends the process once the
coordinator stopped (status 0: the shutdown is complete, what ran was cut), as an ASGI
worker cancels its tasks.  At the kill deadline the heartbeat's exit does the same, as
late as it can, and says so as an error.

This module is their common base, ``_GracefulWSGIWorker``: everything above but how
accepting stops, which each worker class says (``_stop_accepting``), and the answer
both give a connection they cannot serve (``_answers.refuse``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Any

from gunicorn.arbiter import Arbiter

from .. import _options as _config
from .._core import deadlines as _deadlines
from .._core import logging as _logging
from .._core.coordinator import ShutdownCoordinator
from .._core.policy import Phase
from .._core.signals import leave_signals_to_main_thread
from .._options import ConfigError
from ..wsgi import CoordinatorThread, GracefulMiddleware
from ._answers import CUT_RESPONSE, accept_queue, exit_aware, force_close
from ._master import check_in_master, master_listens, metrics_for_master, worker_values

logger = logging.getLogger("graceful")

#: gunicorn's quick shutdown: SIGINT and SIGQUIT go straight to stopping.
QUICK_SIGNALS = (signal.SIGINT, signal.SIGQUIT)
#: At the stop, how long the heartbeat waits for the coordinator's thread to log its last
#: line before it ends the process (the coordinator's own hard exit is a second later).
_JOIN_S = 0.25
#: While accepting, the listeners' accept queues are looked at this often (see
#: ``_backlog_waiting``).
QUEUE_CHECK_S = 0.1
#: The longest the exit waits for the cut lock (held by an app thread for a dict pop).
_CUT_LOCK_S = 0.1


class _GracefulWSGIWorker:
    """What the graceful WSGI workers share: the options checked in the master, the
    coordinator and its thread, the middleware around the app, SIGTERM, the heartbeat
    and the alarm.  A worker class puts it before gunicorn's and says how accepting
    stops (``_stop_accepting``, called in the coordinator's thread)."""

    cfg: Any
    log: Any
    sockets: list[Any]
    ppid: int
    wsgi: Any
    timeout: float
    notify: Any

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        """Check the ``GRACEFUL_*`` variables in the master (``check_in_master``)."""
        check_in_master(cfg, log)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _logging.to_gunicorn(self.log.error_log)
        self.graceful: CoordinatorThread | None = None
        self._signalled = False  # a SIGTERM came while the app was imported
        self._signalled_at: float | None = None  # the first SIGTERM (the alarm's base)
        self._alarm_armed = False
        self._beating = False  # the heartbeat thread runs
        self._holding = False  # the drain waits for this worker's loop (module docs)
        self._loop_done = False  # gunicorn's loop returned (_loop_ended)
        self._nudged = False  # the requests in flight when nudging began were nudged
        self._stopped_early = False  # stopping began before stop_by (module docs)
        self._in_flight: dict[int, tuple[Any, Any]] = {}  # requests the exit answers (_cut)
        self._cut_lock = threading.Lock()  # a request is cut or handed over (HandOver)
        self._cut_keys: set[int] = set()  # the requests the exit answered 503
        self._cut_socks: set[int] = set()  # requests the exit answered before the app
        self._entered: set[int] = set()  # sockets whose request reached the app (guarded)

    @property
    def coordinator(self) -> ShutdownCoordinator:
        assert self.graceful is not None
        return self.graceful.coordinator

    # ----------------------------------------------------------------- set-up

    def load_wsgi(self) -> None:
        try:
            values = worker_values(self.cfg)
        except ConfigError as exc:  # checked in the master: only if the environment changed
            self.log.error("graceful: %s", exc)
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
        coordinator = _config.build_coordinator(values, hard_exit=True)
        metrics_for_master(coordinator)
        coordinator.classify_connections()  # the middleware reports first requests
        coordinator.measure_requests_always()  # the drain budget knows them at SIGTERM
        coordinator.report_pod_serving(master_listens(self.ppid, self.sockets))
        coordinator.subscribe(self._on_phase)
        self.graceful = CoordinatorThread(coordinator)
        super().load_wsgi()  # type: ignore[misc]
        middleware = _config.middleware_kwargs(values)
        self.middleware = GracefulMiddleware(
            self.wsgi,
            self.graceful,
            readiness_path=middleware["readiness_path"],
            liveness_path=middleware["liveness_path"],
            prestop_path=middleware["prestop_path"],
            metrics_path=middleware["metrics_path"],
            readiness_on_shutdown=middleware["readiness_on_shutdown"],
            prestop_waits=self._prestop_waits(),
        )
        self.wsgi = self._closing(self.middleware)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # see _arm_alarm
        self.graceful.start()

    def _closing(self, app: Any) -> Any:
        """``app`` as the exit can answer its requests (``_answers.exit_aware``)."""
        entered = self._entered if self._reads_in_threads else None
        return exit_aware(
            app, self.coordinator, self._in_flight, self._cut_lock, self._cut_keys,
            cut_socks=self._cut_socks, entered=entered,
        )  # fmt: skip

    def _cut(self) -> int:
        """At the exit: answer 503 on each request in flight whose response has not
        started (gunicorn's ``headers_sent``), and on each connection still waiting for
        a thread, so that its client gets an answer it may retry instead of a bare EOF
        or a reset; return how many.  Under the cut lock, noting what it answered: such
        a request never hands its response to gunicorn (``HandOver``)."""
        cut = self._cut_waiting()
        if not self._cut_lock.acquire(timeout=_CUT_LOCK_S):
            return cut  # cannot happen (held for a dict pop): then nothing clean to say
        try:
            cut += self._cut_reading()
            for key, (sock, response) in list(self._in_flight.items()):
                if id(sock) in self._cut_socks:
                    continue  # answered as read, and its thread will not run the app
                if self._answer_cut(sock, response):
                    self._cut_keys.add(key)
                    cut += 1
        finally:
            self._cut_lock.release()
        return cut

    def _answer_cut(self, sock: Any, response: Any) -> bool:
        """The exit's 503 to one request in flight (HTTP/1.1; ``ThreadWorker`` answers
        its HTTP/2 streams in HTTP/2); whether it was sent."""
        if getattr(response, "headers_sent", True):
            return False  # a response under way: nothing clean to say
        with contextlib.suppress(OSError):
            sock.setblocking(True)
            sock.settimeout(0.05)
            sock.sendall(CUT_RESPONSE)
            return True
        return False

    def _prestop_waits(self) -> bool:
        """Whether a preStop request may wait for the drain (not with one thread)."""
        return False

    def _nudge_in_flight(self) -> None:
        """Nudging began: every request in flight whose response has not started will
        close its connection (``closing`` nudges those that start later).  A response
        whose headers are being written right now may still say keep-alive; gunicorn
        then closes the connection after it all the same."""
        self._nudged = True
        for _sock, response in list(self._in_flight.values()):
            if not getattr(response, "headers_sent", True):
                force_close(response)

    # ---------------------------------------------------------------- signals

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM: start the policy.  A repeated SIGTERM is not an escalation here:
        under gunicorn it is the master relaying a process group's signal, which comes
        late when the machine is loaded (CI saw more than a second); gunicorn's quick
        shutdown is SIGINT or SIGQUIT, which stop a worker at once."""
        now = time.monotonic()
        first = self._signalled_at is None
        if self._signalled_at is None:
            self._signalled_at = now  # the master's SIGKILL counts from here
        if self.graceful is None or not self.graceful.running:  # importing the app:
            self._signalled = True  # run() starts the shutdown
            return
        if first:
            self.graceful.request_shutdown("SIGTERM")
        else:
            logger.info(
                "SIGTERM again %.0f ms after the first: the master's relay, not an "
                "escalation (SIGINT or SIGQUIT stop at once)",
                (now - self._signalled_at) * 1000,
            )
        self._arm_alarm()

    def handle_quit(self, sig: int, frame: Any) -> None:
        """SIGINT, SIGQUIT (gunicorn's quick shutdown): stopping at once, as under the
        ASGI workers — what has not started its response is answered 503, and the
        process ends once the coordinator stopped, without waiting for the threads in
        the app.  Before the coordinator runs (the app is being imported): exit now."""
        self.cfg.worker_int(self)
        if self.graceful is None or not self.graceful.running:
            logging.shutdown()
            os._exit(0)
        self._quit_accepting()
        quick = functools.partial(self.coordinator.signal_received, quick=QUICK_SIGNALS)
        self.graceful.call(quick, sig)

    def _queue_stays(self) -> bool:
        """Whether what the kernel queued on the listeners stays there at the stop: a
        quick stop (SIGQUIT, SIGINT) of this worker alone, while gunicorn's master still
        listens — the worker that replaces this one serves it, as under the stock
        workers, where taken it could only be refused."""
        c = self.coordinator
        return c.cutting and c.pod_still_serving()

    def _quit_accepting(self) -> None:
        """In the signal handler of a quick stop: stop taking connections now, as the
        stock worker does, not once the coordinator's thread has acted — what the loop
        took meanwhile could only be refused, where left in the queue the worker that
        replaces this one serves it (the worker class says how)."""

    def _start_if_signalled(self) -> None:
        """At the start of ``run``: a SIGTERM that came while the app was imported."""
        if self._signalled:
            assert self.graceful is not None
            self.graceful.request_shutdown("SIGTERM (while the app was imported)")
            self._arm_alarm()

    def _exit_at(self) -> float:
        """When the heartbeat ends a worker still running (``time.monotonic()``): at the
        end of stopping (``exit_by``), counted from our own SIGTERM as the alarm is, so
        that the two never swap whatever the coordinator's thread lags; earlier if the
        coordinator's exit deadline is (the pod's deletionTimestamp).  The master counts
        ``--graceful-timeout`` from its own SIGTERM, a little earlier: the kill margin
        (``kill - kill_margin_s`` is the promise) absorbs that."""
        margin = self.coordinator.kill_margin_s
        at = math.inf
        if self._signalled_at is not None:
            grace = float(self.cfg.graceful_timeout)
            at = self._signalled_at + grace - margin - _deadlines.exit_margin(margin)
        deadlines = self.coordinator.deadlines
        if deadlines is not None:  # the coordinator's clock is asyncio's: monotonic
            at = min(at, deadlines.exit_by)
        # Half the exit margin before the coordinator's own hard exit (``exit_by`` plus
        # half of it), which would not answer what the heartbeat's exit cuts.
        return at - _deadlines.exit_margin(margin) / 2

    def _arm_alarm(self) -> None:
        """Last resort for an app that holds the interpreter, so that no thread of ours
        can run: SIGALRM's default action after the heartbeat's exit and the
        coordinator's (half the exit margin after ``exit_by``), before the promised
        exit (``kill - kill_margin_s``)."""
        if self._alarm_armed or self._signalled_at is None:
            return  # armed by the first SIGTERM
        self._alarm_armed = True
        margin = self.coordinator.kill_margin_s
        grace = float(self.cfg.graceful_timeout)
        at = self._signalled_at + grace - margin - _deadlines.exit_margin(margin) / 4
        signal.setitimer(signal.ITIMER_REAL, max(0.001, at - time.monotonic()))

    # ------------------------------------------------------- the coordinator

    def _on_phase(self, phase: Phase) -> None:
        """In the coordinator's thread, at every phase change."""
        if phase > Phase.SERVING and not self._beating:
            self._beating = True
            heartbeat = threading.Thread(target=self._heartbeat, name="graceful-heartbeat")
            heartbeat.daemon = True
            heartbeat.start()
        if self.coordinator.nudging and not self._nudged:
            self._nudge_in_flight()
        if Phase.DRAINING <= phase < Phase.STOPPED and not self._holding:  # or escalated
            # The drain also waits for this worker's loop (backlog, gunicorn's stop).
            self._holding = True
            self.coordinator.connection_opened()
            self._stop_accepting()
        if phase is Phase.STOPPING:
            deadlines = self.coordinator.deadlines
            now = time.monotonic()  # the coordinator's clock is asyncio's: monotonic
            # Only a stop that left work behind (the drain deadline, SIGINT, SIGQUIT): a
            # drained one is gunicorn's own to end (its loop may still be finishing).
            self._stopped_early = (
                not self.coordinator.drained and deadlines is not None and now < deadlines.stop_by
            )
        # At STOPPED the heartbeat ends a process whose loop still runs (_exit_stopped).

    def _heartbeat(self) -> None:
        """While shutting down: tell the master we live (a long request would not), and
        end the process just before the exit deadline if it still runs then (the
        coordinator's own hard exit comes later, too close to SIGKILL for a worker that
        learns of SIGTERM from its master)."""
        leave_signals_to_main_thread()
        beat = max(0.05, min(1.0, (self.timeout or 2) / 4))
        assert self.graceful is not None
        c = self.coordinator
        stopped = False
        next_beat = 0.0
        while True:
            now = time.monotonic()
            left = self._exit_at() - now
            if left <= 0:
                break
            if c.accepting:
                self._backlog_waiting()
                wait = min(QUEUE_CHECK_S, left)
                if now >= next_beat:
                    self.notify()
                    next_beat = now + beat
                if not self.graceful.wait_for_phase(Phase.STOPPED, wait):
                    continue
            wait = min(beat, left)
            if stopped:  # gunicorn's own exit normally ends the process meanwhile
                time.sleep(wait)
            elif self.graceful.wait_for_phase(Phase.STOPPED, wait):
                # Stopped, but a request the cut could not reach (the worker's own
                # thread, in the app) may still hold the process: keep the exit.
                stopped = True
                if self._stopped_early:
                    self._exit_stopped()
            else:
                self.notify()
        cut = self._cut()
        logger.error(
            "still alive at the last moment before SIGKILL (phase %s, a request still "
            "runs); exiting%s",
            c.phase,
            f", {cut} request{'s' if cut != 1 else ''} answered 503" if cut else "",
        )
        logging.shutdown()
        os._exit(1)

    def _exit_stopped(self) -> None:
        """Stopping began early (the drain deadline, SIGINT, SIGQUIT) and the coordinator
        stopped: if gunicorn's loop still runs, a request does, in a thread nothing can
        cancel — answer what has not started its response and end the process, status
        0, before the coordinator's own hard exit (which would answer nothing)."""
        assert self.graceful is not None
        self.graceful.join(_JOIN_S)  # its last line first
        if self._loop_done:
            return  # gunicorn's own exit follows
        running = len(self._in_flight)
        cut = self._cut()
        logger.info(
            "stopped with %d request%s still running in the app%s; ending the worker",
            running,
            "" if running == 1 else "s",
            f", {cut} answered 503" if cut else "",
        )
        logging.shutdown()
        os._exit(0)

    def _cut_waiting(self) -> int:
        """At the exit: refuse the connections accepted but not yet handed to the app
        (the worker class knows them), and take no more; return how many."""
        return 0

    #: Threads read requests the exit may answer before the app (``_cut_reading``): a
    #: request notes its socket in ``_entered`` once in ``_in_flight``.
    _reads_in_threads = False

    def _cut_reading(self) -> int:
        """At the exit, under the cut lock: 503 to the requests threads still read (the
        worker class knows them), noted in ``_cut_socks``; return how many."""
        return 0

    def _backlog_waiting(self) -> None:
        """While accepting: connections waiting in a listener's accept queue are traffic
        the worker has not taken yet (every thread in a request, a sync worker in one):
        the kernel's evidence restarts the idle window, where the absence of accepts
        would end it while the queue fills."""
        if any(accept_queue(listener) for listener in self.sockets):
            assert self.graceful is not None
            self.graceful.call(self.coordinator.report_activity)

    def _stop_accepting(self) -> None:
        """Draining began: stop accepting (the worker class says how)."""

    def _loop_ended(self) -> None:
        """The worker's loop is done (backlog served, gunicorn's stop over): the drain
        may end; then wait for the coordinator to stop, at most until the deadline."""
        self._loop_done = True
        if not self._holding or self.graceful is None:
            return
        self.graceful.call(self.coordinator.connection_closed)
        # Bounded: the coordinator's hard exit ends the process before the deadline.
        self.graceful.join(float(self.cfg.graceful_timeout))
