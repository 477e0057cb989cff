"""The kubelet's SIGTERM right after a preStop drain, landing while a library entry
point (``graceful.uvicorn.run``, ``graceful.hypercorn.run``; ``graceful.aiohttp.run_app``
in test_aiohttp.py) tears down after the coordinator stopped: the process exits 0 and
logs it, instead of dying with status 143 by the signal's default action (the window is
made certain by a task that takes a second to end when cancelled)."""

from __future__ import annotations

import signal
import sys

import pytest

from .servers import RawHTTP, ServerProcess

RUNNING = r"[Rr]unning on http://127\.0\.0\.1:(\d+)"


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
def test_sigterm_during_the_teardown_after_prestop_is_not_fatal(server: str) -> None:
    process = ServerProcess(
        [sys.executable, "-m", "tests.integration.stock_apps.linger_app", server]
    )
    try:
        port = int(process.wait_for_line(RUNNING).group(1))
        prestop = RawHTTP(port)
        prestop.send("/prestop")
        assert prestop.response()[0] == 200
        process.wait_for_line(r"lingering task cancelled")
        process.signal(signal.SIGTERM)
        assert process.wait_exit() == 0, process.output()
        process.wait_for_line(r"SIGTERM during the teardown: already shut down")
    finally:
        RawHTTP.close_all()
        process.stop()
