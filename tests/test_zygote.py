"""The zygote's children against fresh interpreters (``tests/support/zygote.py``): the
same program, started both ways in one test, prints the same and exits the same."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.support import zygote
from tests.support.servers import ROOT, ServerProcess

#: What differs from run to run: times, pids, ports, durations.
_VARYING = re.compile(r"\d+(\.\d+)?")


def _shape(output: str) -> list[str]:
    return [_VARYING.sub("N", line) for line in output.splitlines() if line.strip()]


def _both(args: list[str]) -> tuple[subprocess.CompletedProcess[str], ...]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    env["PYTHONUNBUFFERED"] = "1"
    return tuple(
        zygote.run([sys.executable, *args], cwd=ROOT, env=env, timeout=30, fresh=fresh)
        for fresh in (False, True)
    )


@pytest.mark.parametrize(
    "program",
    [
        pytest.param(["-c", "import sys; print(sys.argv, __name__); sys.exit('bye')", "a"],
                     id="exit-with-text"),
        pytest.param(["-c", "def f(x: Undefined): pass"], id="annotations-evaluated"),
        pytest.param(["-c", "import signal; print(signal.getsignal(signal.SIGINT))"],
                     id="sigint-handler"),
        pytest.param(["-c", "1/0"], id="uncaught-exception"),
        pytest.param(["-c", "import os; print('lost?', flush=False); os._exit(3)"],
                     id="os-exit"),
        pytest.param(["-m", "graceful", "run", "--policy", "nope", "examples.asgi_app:app"],
                     id="usage-error"),
        pytest.param(["tests/support/no_such_script.py"], id="missing-script"),
    ],
)  # fmt: skip
def test_a_forked_program_prints_and_exits_as_a_fresh_one(program: list[str]) -> None:
    forked, fresh = _both(program)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )


def test_a_forked_server_logs_and_exits_as_a_fresh_one(servers: list[ServerProcess]) -> None:
    """``graceful run`` through a SIGTERM, forked and fresh: the same lines (numbers
    aside) and exit status, and the first really was forked."""
    runs = []
    for fresh in (False, True):
        server = ServerProcess(
            [sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0",
             "--policy", "refuse-immediately"],
            fresh=fresh,
        )  # fmt: skip
        servers.append(server)
        server.wait_for_line(r"running on http://127\.0\.0\.1:(\d+)")
        server.signal(signal.SIGTERM)
        runs.append((server.wait_exit(), _shape(server.output()), type(server.proc)))
    (forked_code, forked_lines, forked_type), (fresh_code, fresh_lines, fresh_type) = runs
    assert forked_type is zygote.ForkedProcess
    assert fresh_type is subprocess.Popen
    assert (forked_code, forked_lines) == (fresh_code, fresh_lines)
