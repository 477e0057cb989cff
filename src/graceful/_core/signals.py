"""One way to handle signals, for the coordinator, the servers and the ``--workers`` parent.

Why not ``loop.add_signal_handler`` / ``anyio.open_signal_receiver``
--------------------------------------------------------------------
asyncio keeps one handler per signal in the loop.  A library that adds its own and later
removes it also removes the host program's (``remove_signal_handler`` knows no stack) and
leaves the signal at ``SIG_DFL`` or ignored: a host with its own SIGTERM handler would
silently stop hearing SIGTERM once our server returned.  So every part of graceful goes
through ``catch_signals``, which uses ``signal.signal`` only:

* the previous Python-level handlers are recorded and put back on exit, whatever they
  were (asyncio's wakeup-fd no-op, uvicorn's, the host's), so nesting leaves no trace;
* the Python-level handler does nothing but record the signal and *schedule* the
  callback (``loop.call_soon_threadsafe``, trio's ``run_sync_soon``), because it runs
  between two arbitrary bytecodes of the main thread; the callback then runs in the
  event loop like any other callback.  A sleeping loop is woken: the handler's
  ``call_soon_threadsafe`` writes to the loop's self-pipe (trio: its wakeup fd);
* a signal that was received but not yet delivered when the block exits is re-raised
  after the previous handlers are back (what trio's ``open_signal_receiver`` does), so
  nothing that was sent to the process is lost;
* ``defer_signals`` records signals that arrive *before* a server is ready — while
  the app is imported, in the window between a ``--workers`` child's start and its
  server's handlers, in a gunicorn worker before ``run()`` — and the next
  ``catch_signals`` delivers them first.  A SIGTERM during start-up therefore
  starts the shutdown once the server is up instead of killing it half-way or being
  dropped.

One thing this cannot change: a host program's own ``loop.add_signal_handler`` callback
for the same signal still runs while we catch it, because asyncio dispatches the signal
numbers written to its wakeup file descriptor itself, whatever the Python-level handler.
Both hear the signal; neither loses it.

Handlers can only be installed in the main thread; elsewhere ``catch_signals``
installs nothing and the caller must use another trigger (hypercorn's
``shutdown_trigger`` convention).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, Final

logger = logging.getLogger("graceful")

__all__ = (
    "QUICK_SIGNALS",
    "SHUTDOWN_SIGNALS",
    "catch_signals",
    "current_schedule",
    "defer_signals",
    "held_while_starting",
    "in_terminal_foreground",
    "judge_terminal_by",
    "leave_signals_to_main_thread",
    "loop_handles",
    "signal_name",
    "take_deferred",
    "teardown_guard",
)

#: Process-directed signals that graceful's own threads leave to the main thread.
_MAIN_THREAD_SIGNALS: Final = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGWINCH")
    if hasattr(signal, name)
)


def leave_signals_to_main_thread() -> None:
    """Block the process's signals in the calling thread (one of graceful's own).

    The kernel hands a process-directed signal to any thread that does not block it,
    and Python runs its handlers in the main thread only: a signal taken by another
    thread does not interrupt the main thread's wait.  A sync WSGI worker whose main
    thread sleeps in the app heard of a SIGTERM that landed in the coordinator's thread
    only when the request ended — after the master's SIGKILL (seen when a stopped worker
    is resumed: every thread is woken, any may take the pending signal).  Threads
    started from this one inherit the mask.  No-op where threads have no signal mask.
    """
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_THREAD_SIGNALS)


#: Signals that request shutdown; a repeat escalates.
SHUTDOWN_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
#: Signals that stop at once (none on Windows, which has no SIGQUIT: ``import graceful``
#: and the middleware work there, only signal handling is POSIX's).
QUICK_SIGNALS: Final[tuple[int, ...]] = tuple(
    getattr(signal, name) for name in ("SIGQUIT",) if hasattr(signal, name)
)

Schedule = Callable[[Callable[[], object]], object]

# Signals recorded by defer_signals, oldest first.  A deque and no lock: the recording
# handler runs in the main thread between two bytecodes, possibly inside take_deferred();
# append and popleft are atomic, where a held lock would deadlock the handler.
_deferred: collections.deque[int] = collections.deque()


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15, the number as text for an unknown signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


#: The process whose terminal decides ``in_terminal_foreground``: this one, or a
#: ``graceful run --workers`` worker's parent (the workers have no terminal of their own).
_terminal_pid: int | None = None


def judge_terminal_by(pid: int | None) -> None:
    """Let ``in_terminal_foreground`` ask about process ``pid`` (``None``: this one)."""
    global _terminal_pid
    _terminal_pid = pid


def in_terminal_foreground() -> bool:
    """Whether this process (or the one set by ``judge_terminal_by``) is in the
    foreground process group of its controlling terminal: a SIGINT then is somebody's
    Ctrl-C, not an orchestrator's stop.

    Asked only when a signal arrives.  ``False`` without a controlling terminal
    (containers, services, CI) and where there is no way to ask.
    """
    pid = _terminal_pid
    try:  # Linux: pgrp, tty_nr and tpgid, after the command name in parentheses
        with open(f"/proc/{pid or 'self'}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        pgrp, tty, foreground = int(fields[2]), int(fields[4]), int(fields[5])
    except (OSError, IndexError, ValueError):
        pass
    else:
        return tty != 0 and foreground == pgrp
    if pid is not None or not hasattr(os, "tcgetpgrp"):
        return False
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | getattr(os, "O_NOCTTY", 0))
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _record(signum: int, frame: FrameType | None) -> None:
    _deferred.append(signum)


def defer_signals(signums: Iterable[int] = (*SHUTDOWN_SIGNALS, *QUICK_SIGNALS)) -> None:
    """Keep ``signums`` for the next ``catch_signals`` instead of acting on them now.

    For the start-up of a process that graceful owns (``graceful run``, gunicorn
    workers): call it first, before the app is imported.  Does nothing outside the main
    thread.
    """
    if not _in_main_thread():
        return
    for signum in signums:
        signal.signal(signum, _record)


def take_deferred(signums: Iterable[int]) -> list[int]:
    """Remove and return the deferred signals among ``signums``, oldest first (for a
    caller that gives up before delivering them, to re-raise them)."""
    signums = set(signums)
    taken: list[int] = []
    kept: list[int] = []
    while _deferred:
        signum = _deferred.popleft()
        (taken if signum in signums else kept).append(signum)
    _deferred.extendleft(reversed(kept))
    return taken


@contextlib.contextmanager
def held_while_starting(signums: Iterable[int], *, wanted: bool = True) -> Iterator[bool]:
    """Keep ``signums`` for later while a server starts (lifespan, binding): the block
    catches them itself once it serves (``catch_signals``, which delivers the deferred
    ones); whatever is still deferred when the block ends is raised again, and the
    handlers found are restored.  Only in the main thread and when ``wanted``; yields
    whether the signals are the block's to handle."""
    signums = tuple(signums)
    if not wanted or threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {sig: signal.getsignal(sig) for sig in signums}
    defer_signals(signums)
    try:
        yield True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in take_deferred(signums):
            signal.raise_signal(signum)


def current_schedule() -> Schedule:
    """A thread- and signal-safe way to run a callback in the running event loop.

    Raises:
        RuntimeError: outside an asyncio or trio event loop.
    """
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            run_sync_soon: Schedule = token.run_sync_soon
            return run_sync_soon
    raise RuntimeError("catch_signals() needs a running asyncio or trio event loop")


@contextlib.contextmanager
def _wakeup_fd(schedule: Schedule) -> Iterator[None]:
    """Make sure a signal wakes the running asyncio loop from any thread (see above).

    Main thread only.  Keeps a wakeup fd that is already set; sets none for a ``schedule``
    that is not the running asyncio loop's (trio sets its own; a synchronous caller such
    as the ``--workers`` parent blocks the signals in its other threads instead).
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is None or schedule != loop.call_soon_threadsafe:
        yield
        return
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:  # someone already wakes the main thread: leave theirs alone
            signal.set_wakeup_fd(previous)
            yield
            return

        def drain() -> None:
            with contextlib.suppress(OSError):
                while reader.recv(4096):
                    pass

        loop.add_reader(reader.fileno(), drain)
        try:
            yield
        finally:
            loop.remove_reader(reader.fileno())
            current = signal.set_wakeup_fd(-1)
            if current != writer.fileno():  # replaced meanwhile (add_signal_handler): keep
                signal.set_wakeup_fd(current)
    finally:
        reader.close()
        writer.close()


def loop_handles(signum: int) -> bool:
    """Whether an asyncio loop handles ``signum`` (``loop.add_signal_handler``, as
    ``hypercorn.asyncio.serve`` does without a shutdown trigger): it sees the signal
    whatever Python-level handler is installed over it, since the C-level handler writes
    to the loop's wakeup fd."""
    return _is_loop_handler(signal.getsignal(signum))


def _is_loop_handler(handler: Any) -> bool:
    if isinstance(getattr(handler, "__self__", None), asyncio.AbstractEventLoop):
        return True  # uvloop's own handler
    return getattr(handler, "__qualname__", "") == "_sighandler_noop"  # asyncio's


def _is_server_handler(handler: Any) -> bool:
    """Whether ``handler`` is somebody's own (a server's, as plain uvicorn's
    ``handle_exit``): not a default, not ours, not asyncio's Ctrl-C handling, not an
    event loop's (which saw the signal already, through its wakeup fd)."""
    if not callable(handler) or handler in (signal.default_int_handler, _record):
        return False
    if _is_loop_handler(handler):
        return False
    func = getattr(handler, "func", handler)  # functools.partial
    return getattr(func, "__qualname__", "") != "Runner._on_sigint"


@contextlib.contextmanager
def catch_signals(
    signums: Iterable[int],
    on_signal: Callable[[int], None],
    *,
    schedule: Schedule | None = None,
    hand_over: bool = False,
) -> Iterator[bool]:
    """Call ``on_signal(signum)`` in the event loop for each of ``signums`` received.

    Args:
        signums: The signals to catch.
        on_signal: Called once per signal received, in order, never from inside the
            Python-level signal handler.
        schedule: Runs a callback in the loop, thread- and signal-safely; default: the
            running asyncio loop's ``call_soon_threadsafe`` or trio's ``run_sync_soon``.
            A synchronous program (the ``--workers`` parent) passes a function that
            queues the call for its own main loop.
        hand_over: On exit, give the first signal received to the handler it replaced
            when that is somebody's own (a server's: plain uvicorn running an app whose
            lifespan runs the coordinator), so that it stops too once we are done.

    Yields:
        ``True`` if handlers were installed, ``False`` outside the main thread.
    """
    if not _in_main_thread():
        yield False
        return
    wanted = list(dict.fromkeys(signums))
    if schedule is None:
        schedule = current_schedule()
    # A deque, not a list and a lock: the handler runs between two bytecodes of the main
    # thread, possibly inside deliver(); append and popleft are atomic, a lock held by
    # deliver() would deadlock the handler.
    pending: collections.deque[int] = collections.deque()

    received: list[int] = []

    def deliver() -> None:
        while pending:
            signum = pending.popleft()
            received.append(signum)
            on_signal(signum)

    def enqueue(signum: int) -> None:
        pending.append(signum)
        with contextlib.suppress(RuntimeError):  # the loop is closing: re-raised on exit
            schedule(deliver)

    def handler(signum: int, frame: FrameType | None) -> None:
        enqueue(signum)

    previous: dict[int, Any] = {}
    try:
        with _wakeup_fd(schedule):
            try:
                for signum in wanted:
                    previous[signum] = signal.signal(signum, handler)
                for signum in take_deferred(wanted):
                    enqueue(signum)
                yield True
            finally:
                for signum, old in previous.items():
                    signal.signal(signum, signal.SIG_DFL if old is None else old)
    finally:
        while pending:
            signal.raise_signal(pending.popleft())
        if hand_over and received and _is_server_handler(previous.get(received[0])):
            signal.raise_signal(received[0])


@contextlib.contextmanager
def teardown_guard(
    shutdown_requested: Callable[[], bool], *, enabled: bool = True
) -> Iterator[None]:
    """Around a server's whole life in a library entry point (``graceful.uvicorn.run``,
    ``graceful.hypercorn.run``, ``graceful.aiohttp.run_app``).

    Until the server's handlers are in place, SIGTERM, SIGINT and SIGQUIT are recorded
    (and delivered once it runs); after it ran, while it tears down, too.  On exit the
    handlers found are back and a signal never delivered is re-raised to them — unless
    the shutdown was requested already: then a SIGTERM recorded during the teardown (the
    kubelet's, right after a preStop drain; a process group's second copy) asks for what
    is done, and re-raising it would kill the process with its default action (status
    143).  It is logged instead; one that arrives later, while the process ends, is
    ignored: where the handler found was the default action, SIG_IGN replaces it (a
    Python-level handler would not do: the interpreter resets those to the default
    action at its very end).
    """
    if not enabled or not _in_main_thread():
        yield
        return
    handled = (*SHUTDOWN_SIGNALS, *QUICK_SIGNALS)
    previous = {sig: signal.getsignal(sig) for sig in handled}
    defer_signals(handled)
    try:
        yield
    finally:
        done = shutdown_requested()
        for sig, handler in previous.items():
            if done and handler in (None, signal.SIG_DFL):
                signal.signal(sig, signal.SIG_IGN)
            else:
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        late = take_deferred(handled)
        if done:
            if late:
                counts = collections.Counter(signal_name(s) for s in late)
                logger.info(
                    "%s during the teardown: already shut down",
                    ", ".join(
                        name if n == 1 else f"{name} ({n} times)" for name, n in counts.items()
                    ),
                )
        else:
            for signum in late:
                signal.raise_signal(signum)
