"""What a gunicorn worker does in, or asks of, its master: the settings checked once at
start-up, whether the pod still serves."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any

from .. import _options as _config

__all__ = ("check_in_master", "master_listens")


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
        _config.gunicorn_values(cfg.graceful_timeout, warn=log.warning, workers=cfg.workers)
    except _config.ConfigError as exc:
        raise RuntimeError(f"graceful: {exc}") from None
