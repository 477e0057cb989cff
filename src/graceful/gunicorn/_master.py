"""What a gunicorn worker may ask of its master: whether the pod still serves."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ("master_listens",)


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
