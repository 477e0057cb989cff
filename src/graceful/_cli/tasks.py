"""The ``--workers`` parent's one queue: what its main thread waits on.

The threads that watch the workers report here that one serves or exited, the signal
handlers schedule their work here, and the main thread takes one callable at a time,
with the kill deadline as its timeout (see ``graceful._cli.workers``).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator


class _Tasks:
    """The ``--workers`` parent's queue of callables, put from any thread (and from a
    signal handler), taken by the main thread.

    ``get`` waits in ``select()`` on a socket pair that each ``put`` writes a byte to, and
    that ``woken_by_signals`` makes the interpreter's wakeup fd: a signal wakes the main
    thread through it even when the kernel delivered the signal to another thread, and
    the main thread then runs the Python-level handler before it looks at the queue
    again.  (A blocking lock acquire is woken only by a signal delivered to the main
    thread itself, and not by one that arrives between the interpreter's last check and
    the start of the wait: the parent once ignored a SIGQUIT for good that way.)
    """

    def __init__(self) -> None:
        self._items: collections.deque[Callable[[], object]] = collections.deque()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)

    def put(self, task: Callable[[], object]) -> None:
        self._items.append(task)  # atomic: safe from a thread and from a signal handler
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            self._writer.send(b"\0")

    def get(self, timeout: float | None = None) -> Callable[[], object]:
        """The oldest task; waits at most ``timeout`` seconds (``None``: no limit).

        Raises:
            queue.Empty: ``timeout`` elapsed with nothing queued.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._items:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise queue.Empty
            select.select([self._reader], [], [], left)
            with contextlib.suppress(BlockingIOError):
                while self._reader.recv(4096):
                    pass
        return self._items.popleft()

    @contextlib.contextmanager
    def woken_by_signals(self) -> Iterator[None]:
        """Main thread only: make the socket the interpreter's signal wakeup fd."""
        previous = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous)

    def close(self) -> None:
        self._reader.close()
        self._writer.close()
