"""Signal handling: SIGTERM/SIGINT request shutdown (and escalate), SIGQUIT stops at once.

Handlers are installed only when the caller gives no shutdown trigger (hypercorn's
``shutdown_trigger`` convention) and only in the main thread — elsewhere Python cannot
install them, and the caller must pass a trigger.  The handlers that were there before
are put back on exit, so a coordinator nested in a larger program leaves no trace.

We go through :func:`anyio.open_signal_receiver`, which on asyncio uses
``loop.add_signal_handler`` (the loop's wakeup fd, so a signal wakes a sleeping loop at
once) and on trio ``trio.open_signal_receiver``.  asyncio's ``remove_signal_handler``
resets a signal to ``SIG_DFL`` rather than to what was there before, so we record and
restore the previous handlers ourselves.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Final

import anyio
from anyio.abc import TaskStatus

if TYPE_CHECKING:
    from ._coordinator import ShutdownCoordinator

__all__ = ("SHUTDOWN_SIGNALS", "handle_signals")

#: Signals that request shutdown; a repeat escalates.
SHUTDOWN_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # pragma: no cover - only known signals are installed
        return str(signum)


async def handle_signals(
    coordinator: ShutdownCoordinator,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Forward shutdown signals to ``coordinator`` until cancelled.

    Reports started once the handlers are in place (or at once outside the main thread,
    where none can be installed).
    """
    if threading.current_thread() is not threading.main_thread():
        task_status.started()
        return
    signums = [*SHUTDOWN_SIGNALS, signal.SIGQUIT]
    previous = {signum: signal.getsignal(signum) for signum in signums}
    try:
        with anyio.open_signal_receiver(*signums) as received:
            task_status.started()
            async for signum in received:
                coordinator.request_shutdown(
                    _signal_name(signum), immediate=signum == signal.SIGQUIT
                )
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
