"""What every server of ``graceful run`` does alike: the coordinator of a process that is
graceful's own, telling a ``--workers`` parent it serves, the inherited socket, the
start-up failure's two lines, the event loop ``auto`` means."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import sys
import sysconfig
import traceback
from collections.abc import Awaitable, Callable

from .. import _options as _config
from .._core import logging as _logging
from .._core.coordinator import ShutdownCoordinator
from .._core.policy import AcceptUntilIdle
from .._options import Values
from .command import EXIT_NOT_STARTED, Invocation

__all__ = (
    "_coordinator",
    "_loop",
    "_for_parent",
    "_not_started",
    "_ready_notifier",
    "_worker_socket",
)


def _ready_notifier(inv: Invocation) -> Callable[[], Awaitable[None]]:
    """Tell a ``--workers`` parent, once, that this worker serves."""
    ready_fd = inv.ready_fd

    async def notify_ready() -> None:
        nonlocal ready_fd
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, b"R")
                os.close(ready_fd)
            ready_fd = None

    return notify_ready


def _worker_socket(inv: Invocation) -> socket.socket | None:
    return None if inv.worker_fd is None else socket.socket(fileno=inv.worker_fd)


def _coordinator(inv: Invocation) -> ShutdownCoordinator:
    # The process is ours: a third signal exits at once, and a server that does not
    # stop by the kill deadline is ended just before it.
    coordinator = _config.build_coordinator(inv.values, exit_on_third_request=True, hard_exit=True)
    _for_parent(inv, coordinator)
    return coordinator


def _for_parent(inv: Invocation, coordinator: ShutdownCoordinator) -> None:
    """A ``--workers`` worker whose parent has the management listener: it writes its
    metrics to ``PROMETHEUS_MULTIPROC_DIR``, where the parent reads them, and waits for
    the parent's word that the health checkers probing it let go."""
    policy = coordinator.policy
    if inv.parent_checks and isinstance(policy, AcceptUntilIdle) and policy.readiness_failures:
        from .relay import wait_for_parents_checkers

        wait_for_parents_checkers(coordinator)
    if inv.parent_metrics:
        from ..metrics import register

        register(coordinator)


def _not_started(inv: Invocation, exc: BaseException) -> int:
    """Status 3, and why in two lines: the app, the exception and where it was raised
    (the traceback is logged at debug level: ``--log-level debug`` shows it)."""
    _logging.LOGGER.debug("%s failed to start", inv.app, exc_info=exc)
    reason = " ".join(str(exc).split())
    frames = traceback.extract_tb(exc.__traceback__)[-1:]
    # Where the app's own code raised: not a library's line (a module not found).
    libraries = {sysconfig.get_path(p) for p in ("stdlib", "purelib", "platlib")}
    libraries.add(os.path.dirname(__file__))
    own = [
        f for f in frames if f.filename[:1] != "<" and not f.filename.startswith(tuple(libraries))
    ]
    at = f" ({own[0].filename}, line {own[0].lineno})" if own else ""
    debug = _logging.LOGGER.isEnabledFor(logging.DEBUG)
    print(
        f"graceful run: {inv.app} failed to start: {type(exc).__name__}"
        f"{': ' + reason if reason else ''}{at}\n"
        f"graceful run: exit status {EXIT_NOT_STARTED} (the app could not be loaded or started)"
        + ("" if debug else "; --log-level debug shows the traceback"),
        file=sys.stderr,
        flush=True,
    )
    return EXIT_NOT_STARTED


def _loop(values: Values) -> str:
    """``auto`` is uvloop if it is installed, as with uvicorn."""
    loop = str(values["loop"])
    if loop != "auto":
        return loop
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
