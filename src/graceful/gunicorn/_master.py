"""What a gunicorn worker does in, or asks of, its master: the settings checked once at
start-up, whether the pod still serves, and the pod's management listener.

With ``GRACEFUL_MANAGEMENT_PORT`` the master serves readiness, liveness, preStop and
metrics for every worker (``graceful._core.threaded``, a thread of the master started by
the first ``check_config``, which gunicorn runs in the master once its signals and
listeners are set up); the workers open none, close their inherited copy of its socket
and leave the paths to the app on its port.  What the master knows is read from
gunicorn's ``Arbiter`` — found as the owner of the master's SIGTERM handler (its
``signal`` method) — through two attributes: ``LISTENERS`` (emptied when the master
stops: readiness 503 from then on) and ``WORKERS`` (ready once one runs).  A preStop
request sends the master a SIGTERM, as the kubelet would, and is answered once the last
worker exited (at gunicorn's exit, from ``atexit``).  With ``--reuse-port`` the master
holds no listener, so readiness fails only once no worker runs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
from collections.abc import Callable, Iterable
from typing import Any

from .. import _options as _config
from .._core.threaded import MetricsText, ThreadedManagement

__all__ = ("check_in_master", "master_listens", "worker_values")

#: The master's management listener (inherited, as memory, by every worker it forks).
_management: ThreadedManagement | None = None
#: Set in a worker whose master serves the metrics: it writes its own to
#: ``PROMETHEUS_MULTIPROC_DIR`` (``metrics_for_master``).
_metrics_for_master = False


def master_listens(ppid: int, sockets: Iterable[Any]) -> Callable[[], bool]:
    """A check (``ShutdownCoordinator.report_pod_serving``) whether gunicorn's master
    still holds one of ``sockets``: it closes its listeners when it stops, and keeps them
    through a ``HUP`` reload, a ``TTOU`` and a ``max_requests`` recycle, when the pod
    still serves through the other workers.  The kernel's answer (``/proc/PPID/fd``, the
    master's own descriptors: our parent, in our PID namespace), read at each probe; a
    master gone or unreadable counts as stopping, as before."""
    targets = set()
    for sock in sockets:
        with contextlib.suppress(OSError, ValueError):
            targets.add(f"socket:[{os.fstat(sock.fileno()).st_ino}]")

    def check() -> bool:
        if not targets or os.getppid() != ppid:
            return False
        directory = f"/proc/{ppid}/fd"
        try:
            descriptors = os.listdir(directory)
        except OSError:
            return False
        for fd in descriptors:
            with contextlib.suppress(OSError):
                if os.readlink(f"{directory}/{fd}") in targets:
                    return True
        return False

    return check


def check_in_master(cfg: Any, log: Any) -> None:
    """Every graceful worker's ``check_config``: the ``GRACEFUL_*`` variables, checked
    once in the master before any worker boots (gunicorn's arbiter calls it at start-up;
    the ``RuntimeError`` stops gunicorn with ``Error: graceful: …`` and status 1 instead
    of workers that fail to boot, respawned forever)."""
    try:
        values = _config.gunicorn_values(
            cfg.graceful_timeout, warn=log.warning, workers=cfg.workers
        )
        if values["management_port"] is not None and _management is None:  # not at a reload
            _serve_management(values, cfg, log)
    except _config.ConfigError as exc:
        raise RuntimeError(f"graceful: {exc}") from None


def _arbiter() -> Any:
    """gunicorn's ``Arbiter``: the owner of the master's SIGTERM handler."""
    return getattr(signal.getsignal(signal.SIGTERM), "__self__", None)


def _bind_host(cfg: Any) -> str:
    """The host of gunicorn's first ``--bind`` (``127.0.0.1`` for a UNIX socket or an fd)."""
    bind = (cfg.bind or [""])[0]
    if bind.startswith(("unix:", "fd://")) or ":" not in bind:
        return "127.0.0.1"
    return bind.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"


def _serve_management(values: _config.Values, cfg: Any, log: Any) -> None:
    global _management
    arbiter = _arbiter()
    had_listeners = bool(getattr(arbiter, "LISTENERS", None))

    def state() -> tuple[bool, bool, int]:
        workers = len(getattr(arbiter, "WORKERS", None) or ())
        stopping = had_listeners and not getattr(arbiter, "LISTENERS", None)
        return workers > 0, stopping, workers

    metrics: MetricsText | None = None
    if values["metrics_path"] is not None:
        from ..metrics import every_process

        metrics = every_process

    stopped: list[bool] = []

    def stop() -> None:
        if not stopped:  # once: a second SIGTERM is no escalation in gunicorn, but still
            stopped.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    host = values["management_host"] or _bind_host(cfg)
    try:
        management = ThreadedManagement(
            host,
            values["management_port"],
            {k: values[f"{k}_path"] for k in ("readiness", "liveness", "prestop", "metrics")},
            state=state,
            stop=stop,
            deadline=lambda: None,
            metrics=metrics,
            who="in gunicorn's master, for every worker",
        )
    except OSError as exc:
        raise _config.ConfigError(
            f"{values.label('management_port')}: cannot listen on {host} port "
            f"{values['management_port']}: {exc.strerror or exc}"
        ) from None
    management.start(say=log.info)  # gunicorn's log: graceful's logger has no handler here
    atexit.register(management.workers_gone)  # gunicorn exits once its workers are gone
    _management = management


def worker_values(cfg: Any) -> _config.Values:
    """A worker's values (``GRACEFUL_*``, gunicorn's timeout); where the master serves the
    management port, none for the worker, and its inherited copy of the socket closed."""
    global _metrics_for_master
    values = _config.gunicorn_values(cfg.graceful_timeout)  # the master warned already
    if values["management_port"] is None:
        return values
    if _management is not None:
        _management.forget()
    _metrics_for_master = values["metrics_path"] is not None
    return _config.answered_by_parent(values)


def metrics_for_master(coordinator: Any) -> None:
    """In a worker whose master serves the metrics: write this worker's to
    ``PROMETHEUS_MULTIPROC_DIR``, where the master reads them."""
    if _metrics_for_master:
        from ..metrics import register

        register(coordinator)
