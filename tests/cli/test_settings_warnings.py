"""Settings that work, but not as meant, are warned of once at start-up: a misspelt
``GRACEFUL_*`` variable (naming the closest option) and a metrics endpoint served by
several workers without ``prometheus_client``'s multiprocess mode (each scrape would
answer with one random worker's numbers).  Real gunicorn and ``graceful run --workers``
processes; the warning appears once, in the master or parent, never per worker."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.support.servers import STOPPED, ServerProcess

APP = "tests.support.metrics_apps.app:app"
IDLE_HINT = "GRACEFUL_IDEL is not a graceful option and is ignored (did you mean GRACEFUL_IDLE?)"
METRICS_HINT = "with 2 workers and no PROMETHEUS_MULTIPROC_DIR: each scrape answers with one"


def _environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GRACEFUL_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    return {**env, "GRACEFUL_IDEL": "3", **extra}


COMMANDS = {
    "gunicorn": [sys.executable, "-m", "gunicorn", APP, "-k", "graceful.gunicorn.UvicornWorker",
                 "-w", "2", "-b", "127.0.0.1:0", "--graceful-timeout", "10"],
    "graceful-run": [sys.executable, "-m", "graceful", "run", APP, "--port", "0",
                     "--workers", "2", "--grace-period", "10"],
}  # fmt: skip
BOOTED = {"gunicorn": r"Application startup complete", "graceful-run": r"worker \d+ serves"}


@pytest.mark.parametrize("host", COMMANDS)
@pytest.mark.parametrize("multiprocess", [False, True], ids=["one-process", "multiprocess"])
def test_warned_once_at_start_up(host: str, multiprocess: bool, tmp_path: os.PathLike[str]) -> None:
    env = _environment(GRACEFUL_METRICS_PATH="/metrics", GRACEFUL_POLICY="refuse-immediately")
    if multiprocess:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    server = ServerProcess(COMMANDS[host], env=env)
    try:
        server.wait_for_line(BOOTED[host], count=2)
        server.signal(signal.SIGTERM)
        server.wait_for_line(STOPPED, count=2)
        assert server.wait_exit() == 0
    finally:
        server.stop()
    output = server.output()
    assert output.count(IDLE_HINT) == 1, output
    assert output.count(METRICS_HINT) == (0 if multiprocess else 1), output
