"""The ``--workers`` parent's task queue wakes for a signal whatever thread gets it.

CI once saw the parent ignore a SIGQUIT for good: its main thread waited in
``SimpleQueue.get()`` (a blocking lock acquire), and the signal arrived just before the
wait began, so nothing interrupted the wait and the Python-level handler never ran (gdb:
main thread in ``sem_wait``, no signal pending).  A signal handled by a thread other than
the main one is the same lost wake-up, made certain: the test blocks the signal in the main
thread so that the kernel delivers it to a helper thread, and sends it once the main
thread waits.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from graceful._cli.tasks import _Tasks

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread()
    or not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/wchan"),
    reason="signal handlers need the main thread; thread states are read from Linux's /proc",
)


@pytest.fixture
def tasks() -> Iterator[_Tasks]:
    queued = _Tasks()
    yield queued
    queued.close()


@pytest.fixture
def signal_elsewhere() -> Iterator[threading.Event]:
    """SIGUSR1 blocked in the main thread, open in a helper thread that waits; set the
    event to end the helper."""
    done = threading.Event()
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    ready = threading.Event()

    def helper() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield done
    finally:
        done.set()
        thread.join(10)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)


def in_select(tid: int) -> bool:
    with open(f"/proc/self/task/{tid}/wchan") as wchan:
        return wchan.read().startswith(("poll_schedule_timeout", "do_select"))


def test_a_signal_another_thread_receives_wakes_the_main_thread(
    tasks: _Tasks, signal_elsewhere: threading.Event
) -> None:
    """Sent once the main thread waits in ``get``; taken by the helper thread."""
    main = threading.get_native_id()

    def send_once_waiting() -> None:
        deadline = time.monotonic() + 10
        while not in_select(main) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGUSR1)

    def handler(signum: int, frame: object) -> None:
        tasks.put(lambda: signum)

    previous = signal.signal(signal.SIGUSR1, handler)
    sender = threading.Thread(target=send_once_waiting, daemon=True)  # SIGUSR1 blocked
    try:
        with tasks.woken_by_signals():
            sender.start()
            task = tasks.get(timeout=10)
    finally:
        sender.join(10)
        signal.signal(signal.SIGUSR1, previous)
    assert task() == signal.SIGUSR1


def test_put_from_threads_and_timeout(tasks: _Tasks) -> None:
    with pytest.raises(queue.Empty):
        tasks.get(timeout=0.01)
    threads = [threading.Thread(target=tasks.put, args=(lambda n=n: n,)) for n in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(tasks.get(timeout=10)() for _ in range(50)) == list(range(50))
    with pytest.raises(queue.Empty):
        tasks.get(timeout=0)
