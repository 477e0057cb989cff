"""The Python API's run functions take graceful's command-line options by their Python
names, and they take effect: ``graceful.uvicorn.run(app, grace_period_s=7)`` plans for
SIGKILL 7 s after SIGTERM, as ``graceful run --grace-period 7`` does (it used to crash
inside uvicorn: ``Config.__init__() got an unexpected keyword argument``).

Real server processes on a free loopback port, a real SIGTERM; the test waits on log
lines."""

from __future__ import annotations

import signal
import sys

import pytest

from tests.support.servers import STOPPED, ServerProcess, sigkill_expected_in

RUNNING = r"[Rr]unning on http://127\.0\.0\.1:(\d+)"

#: Each run function with graceful's options (and the server's own) as keywords.
SCRIPTS = {
    "uvicorn": """\
import graceful.uvicorn
graceful.uvicorn.run("examples.asgi_app:app", host="127.0.0.1", port=0,
                     policy="accept-until-idle", idle_s=0.5, grace_period_s=7, kill_margin_s=2)
""",
    "hypercorn": """\
import graceful.hypercorn
from hypercorn.config import Config
config = Config()
config.bind = ["127.0.0.1:0"]
graceful.hypercorn.run("examples.asgi_app:app", config, worker_class="asyncio",
                       policy="accept-until-idle", idle_s=0.5, grace_period_s=7, kill_margin_s=2)
""",
    "aiohttp": """\
import graceful.aiohttp
from examples.aiohttp_app import make_app
graceful.aiohttp.run_app(make_app(), host="127.0.0.1", port=0,
                         policy="accept-until-idle", idle_s=0.5, grace_period_s=7, kill_margin_s=2)
""",
}


@pytest.mark.parametrize("server", SCRIPTS)
def test_run_takes_the_grace_period_and_the_policy_by_their_python_names(server: str) -> None:
    pytest.importorskip(server)
    process = ServerProcess([sys.executable, "-c", SCRIPTS[server]])
    try:
        process.wait_for_line(
            r"policy accept-until-idle \(idle 0\.5 s, at most 30 s\); "
            r"kill deadline: grace period 7 s"
        )
        process.wait_for_line(RUNNING)
        process.signal(signal.SIGTERM)
        # The kill deadline is the grace period (less what logging it took under load:
        # sigkill_expected_in); stopping gets the kill margin.
        process.wait_for_line(r"serving -> accepting: SIGTERM .*SIGKILL expected in")
        (expected,) = sigkill_expected_in(process.output())
        assert 6.0 <= expected <= 7.0, process.output()
        process.wait_for_line(r"accepting -> draining: no new connection for 0\.5")
        process.wait_for_line(STOPPED)
        assert process.wait_exit() == 0
    finally:
        process.stop()
    assert "no kill deadline known" not in process.output()
