"""The one signal helper (graceful._core.signals) and ShutdownCoordinator.run() without a
trigger, in the main thread, with real signals.

SIGUSR1/SIGUSR2 stand in for the shutdown signals wherever the code under test lets us
choose, so a mistake cannot kill pytest; every test restores the handlers it found
(``restore_signals``) and leaves no deferred signal behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from graceful import Phase, RefuseImmediately, ServeUntilKilled, ShutdownCoordinator
from graceful._core.signals import (
    QUICK_SIGNALS,
    SHUTDOWN_SIGNALS,
    catch_signals,
    current_schedule,
    defer_signals,
    signal_name,
    take_deferred,
)

pytestmark = pytest.mark.anyio

USR1, USR2 = signal.SIGUSR1, signal.SIGUSR2
ALL = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, USR1, USR2)
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers


@pytest.fixture(autouse=True)
def restore_signals() -> Iterator[None]:
    before = {sig: signal.getsignal(sig) for sig in ALL}
    take_deferred(ALL)
    try:
        yield
    finally:
        take_deferred(ALL)
        for sig, handler in before.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


class Recorder:
    """A Python-level signal handler that records what it got."""

    def __init__(self) -> None:
        self.got: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.got.append(signum)


class Calls:
    """``on_signal`` for catch_signals: records, and wakes a waiter."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.threads: list[int] = []
        self._event: anyio.Event | None = None

    def __call__(self, signum: int) -> None:
        self.got.append(signum)
        self.threads.append(threading.get_ident())
        if self._event is not None:
            self._event.set()

    async def wait_for(self, count: int) -> None:
        with anyio.fail_after(10):
            while len(self.got) < count:
                self._event = anyio.Event()
                await self._event.wait()


def queued() -> tuple[list[Callable[[], object]], Callable[[Callable[[], object]], object]]:
    """A schedule for a synchronous program: callbacks wait until the test runs them."""
    callbacks: list[Callable[[], object]] = []
    return callbacks, callbacks.append


# ------------------------------------------------------------------ catch_signals


@pytest.mark.parametrize(
    "previous", [Recorder(), signal.SIG_IGN, signal.SIG_DFL], ids=["handler", "ign", "dfl"]
)
def test_previous_handlers_are_restored_exactly(previous: Handler) -> None:
    signal.signal(USR1, previous)
    signal.signal(USR2, signal.SIG_IGN)
    _, schedule = queued()
    with catch_signals([USR1, USR2, USR1], lambda signum: None, schedule=schedule) as installed:
        assert installed is True
        assert signal.getsignal(USR1) is not previous
        assert signal.getsignal(USR2) is not signal.SIG_IGN
    assert signal.getsignal(USR1) is previous
    assert signal.getsignal(USR2) is signal.SIG_IGN


def test_nested_blocks_unwind_to_each_previous_handler() -> None:
    original = Recorder()
    signal.signal(USR1, original)
    _, schedule = queued()
    with catch_signals([USR1], lambda signum: None, schedule=schedule):
        outer = signal.getsignal(USR1)
        with catch_signals([USR1], lambda signum: None, schedule=schedule):
            assert signal.getsignal(USR1) is not outer
        assert signal.getsignal(USR1) is outer
    assert signal.getsignal(USR1) is original


def test_signal_not_delivered_at_exit_is_reraised_to_the_previous_handler() -> None:
    previous = Recorder()
    signal.signal(USR1, previous)
    signal.signal(USR2, previous)
    callbacks, schedule = queued()
    calls = Calls()
    with catch_signals([USR1, USR2], calls, schedule=schedule):
        signal.raise_signal(USR1)
        signal.raise_signal(USR2)
        assert previous.got == []  # caught, scheduled, not yet delivered
        assert callbacks
    assert previous.got == [USR1, USR2]  # re-raised, in order, to the handler now back
    for callback in callbacks:  # the loop gets round to the scheduled delivery: too late
        callback()
    assert calls.got == []  # each signal reaches exactly one handler


def test_delivered_signals_are_not_reraised() -> None:
    previous = Recorder()
    signal.signal(USR1, previous)
    callbacks, schedule = queued()
    calls = Calls()
    with catch_signals([USR1], calls, schedule=schedule):
        signal.raise_signal(USR1)
        for callback in callbacks:
            callback()
        assert calls.got == [USR1]
    assert previous.got == []


def test_signal_caught_while_the_loop_is_closing_is_reraised() -> None:
    previous = Recorder()
    signal.signal(USR1, previous)

    def closed_loop(callback: Callable[[], object]) -> object:
        raise RuntimeError("Event loop is closed")

    with catch_signals([USR1], Calls(), schedule=closed_loop):
        signal.raise_signal(USR1)  # the handler must not raise into arbitrary code
    assert previous.got == [USR1]


async def test_signals_are_delivered_in_the_loop_in_order() -> None:
    calls = Calls()
    with catch_signals([USR1, USR2], calls):
        os.kill(os.getpid(), USR1)
        await calls.wait_for(1)
        signal.raise_signal(USR2)
        signal.raise_signal(USR1)
        await calls.wait_for(3)
    assert calls.got == [USR1, USR2, USR1]
    assert set(calls.threads) == {threading.get_ident()}


def _asleep(native_id: int, syscalls: set[str]) -> bool:
    """Whether the thread sleeps in one of ``syscalls`` (numbers, as /proc shows them)."""
    with open(f"/proc/self/task/{native_id}/syscall") as f:
        return f.read().split()[0] in syscalls


EPOLL_WAIT = {"232", "281"}  # epoll_wait, epoll_pwait (x86_64)
FUTEX = "202"  # anyio runs trio tests in guest mode: the main thread waits on a queue


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # a real clock: the loop sleeps
async def test_a_signal_taken_by_another_thread_wakes_the_sleeping_loop(
    anyio_backend: str,
) -> None:
    """The kernel may hand a process-directed signal to any thread that does not block it
    (a default-executor thread, say).  Its C-level handler then runs in that thread; the
    main thread, asleep in epoll_wait, must still be woken to run the Python-level
    handler — the CI hang of 2026-11-23, where a SIGTERM sat unhandled for 15 s."""
    delivered = threading.Event()
    calls = Calls()
    main = threading.get_native_id()
    asleep_in = EPOLL_WAIT if anyio_backend == "asyncio" else {*EPOLL_WAIT, FUTEX}
    wake_loop = current_schedule()
    in_time: list[bool] = []

    def on_signal(signum: int) -> None:
        delivered.set()
        calls(signum)

    def other_thread() -> None:
        deadline = time.monotonic() + 5  # bounded: if never seen asleep, send anyway
        while not _asleep(main, asleep_in) and time.monotonic() < deadline:
            time.sleep(0.001)
        signal.pthread_kill(threading.get_ident(), USR1)  # this thread takes it
        # Stay alive (a thread's exit would wake the loop); if the signal did not wake
        # it, nothing else would for 10 s: record that, then wake it so the test ends.
        in_time.append(delivered.wait(5))
        wake_loop(lambda: None)

    with catch_signals([USR1], on_signal):
        thread = threading.Thread(target=other_thread)
        thread.start()
        try:
            await calls.wait_for(1)
        finally:
            thread.join(10)
    assert in_time == [True], "the signal did not wake the sleeping loop"
    assert calls.got == [USR1]


def _wakeup_fd_now() -> int:
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    return fd


async def test_catch_signals_sets_a_wakeup_fd_only_where_none_is_set(anyio_backend: Any) -> None:
    before = _wakeup_fd_now()  # -1 on asyncio without add_signal_handler; trio's own on trio
    with catch_signals([USR1], Calls()):
        inside = _wakeup_fd_now()
        assert inside != -1
        if before != -1:
            assert inside == before  # the one already set is kept
    assert _wakeup_fd_now() == before  # and the block leaves no trace


async def test_a_host_wakeup_fd_set_before_the_block_is_kept() -> None:
    host_r, host_w = socket.socketpair()
    host_w.setblocking(False)
    previous = signal.set_wakeup_fd(host_w.fileno(), warn_on_full_buffer=False)
    try:
        with catch_signals([USR1], Calls()):
            assert _wakeup_fd_now() == host_w.fileno()
        assert _wakeup_fd_now() == host_w.fileno()
    finally:
        signal.set_wakeup_fd(previous, warn_on_full_buffer=False)
        host_r.close()
        host_w.close()


async def test_a_signal_raised_by_on_signal_itself_is_delivered_too() -> None:
    got: list[int] = []
    done = anyio.Event()

    def on_signal(signum: int) -> None:
        got.append(signum)
        if signum == USR1:
            signal.raise_signal(USR2)  # the handler runs inside delivery
        else:
            done.set()

    with catch_signals([USR1, USR2], on_signal):
        signal.raise_signal(USR1)
        with anyio.fail_after(10):
            await done.wait()
    assert got == [USR1, USR2]


async def test_signal_pending_at_exit_in_a_running_loop_reaches_one_handler() -> None:
    previous = Recorder()
    signal.signal(USR1, previous)
    calls = Calls()
    with catch_signals([USR1], calls):
        signal.raise_signal(USR1)  # scheduled in the loop, but the block ends first
    assert previous.got == [USR1]
    await anyio.wait_all_tasks_blocked()
    await anyio.lowlevel.checkpoint()
    assert calls.got == []


def test_catch_signals_outside_a_loop_needs_a_schedule() -> None:
    with pytest.raises(RuntimeError, match="running asyncio or trio event loop"):
        current_schedule()
    before = signal.getsignal(USR1)
    with (
        pytest.raises(RuntimeError, match="running asyncio or trio"),
        catch_signals([USR1], Calls()),
    ):
        pass  # pragma: no cover
    assert signal.getsignal(USR1) is before


def test_outside_the_main_thread_nothing_is_installed_or_deferred() -> None:
    before = {sig: signal.getsignal(sig) for sig in ALL}
    seen: list[object] = []

    def thread() -> None:
        defer_signals([USR1])
        with catch_signals([USR1], Calls(), schedule=lambda callback: None) as installed:
            seen.append(installed)
            seen.append(signal.getsignal(USR1))

    t = threading.Thread(target=thread)
    t.start()
    t.join(10)
    assert seen == [False, before[USR1]]
    assert {sig: signal.getsignal(sig) for sig in ALL} == before


def test_signal_names() -> None:
    assert signal_name(signal.SIGTERM) == "SIGTERM"
    assert signal_name(999) == "999"
    assert set(SHUTDOWN_SIGNALS) == {signal.SIGTERM, signal.SIGINT}
    assert QUICK_SIGNALS == (signal.SIGQUIT,)


# ------------------------------------------------------------------ deferred signals


def test_take_deferred_returns_only_the_asked_signals_oldest_first() -> None:
    defer_signals([USR1, USR2])
    signal.raise_signal(USR1)
    signal.raise_signal(USR2)
    signal.raise_signal(USR1)
    assert take_deferred([USR2]) == [USR2]
    assert take_deferred([USR1, USR2]) == [USR1, USR1]
    assert take_deferred([USR1, USR2]) == []


async def test_deferred_signal_is_delivered_by_the_next_catch_signals() -> None:
    defer_signals([USR1])
    signal.raise_signal(USR1)  # start-up: recorded, not acted on
    calls = Calls()
    with catch_signals([USR1], calls):
        await calls.wait_for(1)
    assert calls.got == [USR1]
    assert take_deferred([USR1]) == []


async def test_deferred_sigterm_starts_the_shutdown_once_run_starts() -> None:
    defer_signals([signal.SIGTERM])
    signal.raise_signal(signal.SIGTERM)  # while the app was being imported
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(c.run)
            assert await c.wait_for_phase(Phase.ACCEPTING)
            assert c.statistics().reason == "SIGTERM"
            c.request_shutdown("test", immediate=True)


# --------------------------------------------------------------------- coordinator


async def test_run_restores_the_python_handlers_it_found() -> None:
    found = {sig: Recorder() for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)}
    for sig, handler in found.items():
        signal.signal(sig, handler)
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(c.run)
            for sig in found:
                assert signal.getsignal(sig) is not found[sig]
            os.kill(os.getpid(), signal.SIGTERM)
            assert await c.wait_for_phase(Phase.ACCEPTING)
            os.kill(os.getpid(), signal.SIGQUIT)
            assert await c.wait_for_phase(Phase.STOPPED)
    assert {sig: signal.getsignal(sig) for sig in found} == found
    # The coordinator had them; once it stopped, the handler it replaced for the first
    # signal (a server's, say) gets that one, so that its owner stops too.
    assert {sig: handler.got for sig, handler in found.items()} == {
        signal.SIGTERM: [signal.SIGTERM],
        signal.SIGINT: [],
        signal.SIGQUIT: [],
    }


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_host_loop_signal_handlers_survive_a_coordinator() -> None:
    """A host program's ``loop.add_signal_handler`` handlers still work after a
    coordinator ran and exited (anyio's signal receiver used to remove them)."""
    loop = asyncio.get_running_loop()
    heard: dict[int, asyncio.Event] = {USR1: asyncio.Event(), signal.SIGTERM: asyncio.Event()}
    for sig, event in heard.items():
        loop.add_signal_handler(sig, event.set)
    try:
        c = ShutdownCoordinator(policy=RefuseImmediately())
        async with anyio.create_task_group() as tg:
            await tg.start(c.run)
            c.request_shutdown("test", immediate=True)
            assert await c.wait_for_phase(Phase.STOPPED, timeout_s=10)
        # Never SIG_DFL here: the SIGTERM below must not kill pytest.
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        for sig, event in heard.items():
            event.clear()
            os.kill(os.getpid(), sig)
            await asyncio.wait_for(event.wait(), 10)
    finally:
        for sig in heard:
            loop.remove_signal_handler(sig)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_host_loop_sigterm_callback_also_hears_the_signal_the_coordinator_catches() -> None:
    """Documented in graceful._core.signals: asyncio dispatches the signal numbers written to
    its wakeup fd itself, so a host's ``add_signal_handler`` callback runs too while the
    coordinator catches the signal.  Both hear it; neither loses it."""
    loop = asyncio.get_running_loop()
    host_heard = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, host_heard.set)
    try:
        c = ShutdownCoordinator(policy=ServeUntilKilled())
        async with anyio.create_task_group() as tg:
            await tg.start(c.run)
            os.kill(os.getpid(), signal.SIGTERM)
            assert await c.wait_for_phase(Phase.ACCEPTING, timeout_s=10)
            assert c.statistics().reason == "SIGTERM"
            await asyncio.wait_for(host_heard.wait(), 10)
            c.request_shutdown("test", immediate=True)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
