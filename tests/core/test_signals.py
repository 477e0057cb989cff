"""Signal handling of ShutdownCoordinator.run() without a trigger (main thread)."""

from __future__ import annotations

import os
import signal
import threading

import anyio
import pytest

from graceful import Phase, ServeUntilKilled, ShutdownCoordinator

pytestmark = pytest.mark.anyio

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


async def test_sigterm_requests_shutdown_and_handlers_are_restored() -> None:
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    async with anyio.create_task_group() as tg:
        await tg.start(c.run)
        os.kill(os.getpid(), signal.SIGTERM)
        assert await c.wait_for_phase(Phase.ACCEPTING, timeout_s=5)
        assert c.statistics().reason == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # the second one escalates
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=5)
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before


async def test_sigquit_stops_at_once() -> None:
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    async with anyio.create_task_group() as tg:
        await tg.start(c.run)
        os.kill(os.getpid(), signal.SIGQUIT)
        assert await c.wait_for_phase(Phase.STOPPED, timeout_s=5)


def test_outside_the_main_thread_nothing_is_installed() -> None:
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    seen: list[object] = []

    async def main() -> None:
        c = ShutdownCoordinator()
        async with anyio.create_task_group() as tg:
            await tg.start(c.run)
            seen.extend(signal.getsignal(sig) for sig in SIGNALS)
            c.request_shutdown("test", immediate=True)

    thread = threading.Thread(target=anyio.run, args=(main,))
    thread.start()
    thread.join(10)
    assert seen == list(before.values())
