"""The kubelet's SIGTERM right after a preStop drain, landing while a library entry
point (``graceful.uvicorn.run``, ``graceful.hypercorn.run``; ``graceful.aiohttp.run_app``
in test_aiohttp.py) tears down after the coordinator stopped: the process exits 0 and
logs it, instead of dying with status 143 by the signal's default action (the window is
made certain by a task that takes a second to end when cancelled)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import pytest

from tests.support.servers import RawHTTP, ServerProcess

RUNNING = r"[Rr]unning on http://127\.0\.0\.1:(\d+)"
COMMANDS = {
    "uvicorn": ["-m", "tests.support.stock_apps.linger_app", "uvicorn"],
    "hypercorn": ["-m", "tests.support.stock_apps.linger_app", "hypercorn"],
    "aiohttp": ["-m", "tests.support.aiohttp_apps.app", "run_app", "--policy",
                "refuse-immediately", "--prestop-path", "/prestop"],
}  # fmt: skip


def _after_prestop(server: str) -> ServerProcess:
    """The server, started, once its preStop endpoint answered (the drain is done)."""
    process = ServerProcess([sys.executable, *COMMANDS[server]])
    try:
        port = int(process.wait_for_line(RUNNING).group(1))
        prestop = RawHTTP(port)
        prestop.send("/prestop")
        assert prestop.response()[0] == 200
    except BaseException:
        RawHTTP.close_all()
        process.stop()
        raise
    return process


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
def test_sigterm_during_the_teardown_after_prestop_is_not_fatal(server: str) -> None:
    process = _after_prestop(server)
    try:
        process.wait_for_line(r"lingering task cancelled")
        process.signal(signal.SIGTERM)
        assert process.wait_exit() == 0, process.output()
        process.wait_for_line(r"SIGTERM during the teardown: already shut down")
    finally:
        RawHTTP.close_all()
        process.stop()


@pytest.mark.parametrize("server", list(COMMANDS))
def test_sigterm_storm_after_prestop_never_kills(server: str) -> None:
    """Whenever the kubelet's SIGTERM lands after the preStop drain — before the
    coordinator stopped, during the teardown, after the entry point returned while the
    interpreter ends — the process exits 0.  A SIGTERM every few milliseconds until it
    is gone makes every one of those moments likely (it once lost this race in CI:
    status -15 at the very end)."""
    process = _after_prestop(server)
    try:
        sent = 0
        deadline = time.monotonic() + 10
        while process.proc.poll() is None and time.monotonic() < deadline and sent < 2000:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.proc.pid, signal.SIGTERM)
            sent += 1
            time.sleep(0.002)
        assert process.wait_exit() == 0, process.output()
        assert sent > 1
    finally:
        RawHTTP.close_all()
        process.stop()
