"""graceful's log lines look like the server's they run in, and follow its settings.

``graceful run``: uvicorn's format (its formatter, a ``--log-config`` honoured), the
``--log-level`` applies to our lines and to nothing else (the root logger is never
configured), each line of a ``--workers`` worker names its pid, no banner twice, one
start-up line with the policy and the kill deadline's source.  The Python API
(``graceful.uvicorn.run``, ``graceful.aiohttp.run_app``) shows our lines without any
logging set up by the application.  Real processes, real signals."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.support.servers import STOPPED, ServerProcess

ASGI_APP = "examples.asgi_app:app"
AIOHTTP_APP = "tests.support.aiohttp_apps.app:app"
#: An app whose own logger writes a debug line at import: ``--log-level debug`` must
#: not show it (graceful does not configure the root logger).
NOISY_APP = """\
import logging
logging.getLogger("noisy").debug("noisy debug line")
from examples.asgi_app import app
"""
STARTUP = r"policy accept-until-idle \(idle 2 s, at most 30 s\); kill deadline: grace period 10 s"
RUNNING = r"(?:running on|Running on|listening on) http://127\.0\.0\.1:(\d+)"


def run(*args: str, stopped: int = 1, ready: str = RUNNING) -> str:
    """Start ``graceful run``, SIGTERM it once ``ready`` is printed, return its output."""
    server = ServerProcess(
        [sys.executable, "-m", "graceful", "run", *args, "--port", "0", "--grace-period", "10"]
    )
    try:
        server.wait_for_line(ready)
        if "--workers" in args:
            server.wait_for_line(r"worker \d+ serves", count=2)
        server.signal(signal.SIGTERM)
        assert server.wait_exit() == 0
    finally:
        server.stop()
    output = server.output()
    assert output.count("stopping -> stopped") == stopped, output
    return output


def ours(output: str) -> list[str]:
    """graceful's lines: the phase changes and the start-up line."""
    return [line for line in output.splitlines() if "->" in line or "kill deadline:" in line]


def test_uvicorn_format_and_one_startup_line() -> None:
    output = run(ASGI_APP)
    lines = ours(output)
    assert len(lines) == 5, output  # start-up line, then serving -> … -> stopped
    assert all(line.startswith("INFO:     ") for line in lines), output
    assert len(re.findall(STARTUP, output)) == 1
    assert "serving -> accepting: SIGTERM (0 connections, 0 requests; SIGKILL" in output
    assert " graceful: " not in output  # not the root logger's format


def test_log_level_warning_silences_our_info_lines() -> None:
    # uvicorn's "running on" is an INFO line too: a SIGTERM during start-up drains as well.
    output = run(ASGI_APP, "--log-level", "warning", ready="lifespan startup", stopped=0)
    assert not ours(output), output


def test_log_level_debug_does_not_turn_on_the_root_logger(tmp_path: Path) -> None:
    (tmp_path / "noisyapp.py").write_text(NOISY_APP)
    output = run("noisyapp:app", "--app-dir", str(tmp_path), "--log-level", "debug")
    assert "noisy debug line" not in output
    assert re.search(STARTUP, output)


def test_log_config_is_honoured(tmp_path: Path) -> None:
    from uvicorn.config import LOGGING_CONFIG

    config = json.loads(json.dumps(LOGGING_CONFIG))
    config["formatters"]["default"]["fmt"] = "CUSTOM %(levelname)s | %(message)s"
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    output = run(ASGI_APP, "--log-config", str(path))
    assert re.search(r"^CUSTOM INFO \| " + STARTUP, output, re.M), output
    assert re.search(r"^CUSTOM INFO \| serving -> accepting: SIGTERM", output, re.M), output


def test_workers_lines_name_their_pid_and_no_banner_twice() -> None:
    output = run(ASGI_APP, "--workers", "2", stopped=2)
    pids = re.findall(r"worker (\d+) serves", output)
    for pid in pids:
        assert re.search(rf"^INFO:     \[{pid}\] serving -> accepting", output, re.M), output
        assert re.search(rf"^INFO:     \[{pid}\] Started server process", output, re.M), output
    assert len(re.findall(r"listening on http", output)) == 1, output


@pytest.mark.parametrize(
    ("args", "banner"),
    [([ASGI_APP, "--server", "hypercorn"], r"Running on http"),
     ([AIOHTTP_APP, "--server", "aiohttp"], r"[Rr]unning on http")],
    ids=["hypercorn", "aiohttp"],
)  # fmt: skip
def test_other_servers_one_banner_in_hypercorn_format(args: list[str], banner: str) -> None:
    output = run(*args)
    assert len(re.findall(banner, output)) == 1, output
    line = r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}\] \[\d+\] \[INFO\] "
    assert re.search(line + STARTUP, output, re.M), output
    assert re.search(line + r"serving -> accepting: SIGTERM", output, re.M), output


PYTHON_API = {
    "uvicorn": "examples.uvicorn_run",
    "aiohttp": "examples.aiohttp_run_app",
}


@pytest.mark.parametrize("api", PYTHON_API)
def test_python_api_shows_our_lines_without_logging_set_up(api: str) -> None:
    server = ServerProcess([sys.executable, "-m", PYTHON_API[api], "--port", "0"])
    try:
        server.wait_for_line(RUNNING)
        server.signal(signal.SIGTERM)
        server.wait_for_line(STOPPED)
        server.wait_exit()
    finally:
        server.stop()
    output = server.output()
    prefix = "INFO:     " if api == "uvicorn" else ""
    assert re.search(rf"^{re.escape(prefix)}.*serving -> accepting: SIGTERM", output, re.M), output
    assert re.search(r"policy accept-until-idle", output), output
