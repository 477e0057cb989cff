"""aiohttp's hot path self-test against real servers (``graceful.aiohttp.run_app`` and
gunicorn's ``graceful.gunicorn.AiohttpWorker``) whose request handling was changed on
purpose (``tests/support/selftest_apps/aiohttp_broken.py``): one warning naming
aiohttp, its version and what did not hold, and every later request through the
middleware — a request in flight at SIGTERM is still counted and waited for."""

from __future__ import annotations

import aiohttp
import pytest

from tests.matrix.test_hot_path_selftest import assert_self_test
from tests.support.servers import (
    AIOHTTP_APP,
    RawHTTP,
    ServerProcess,
    aiohttp_command,
    aiohttp_ready,
)

BROKEN_APP = "tests.support.selftest_apps.aiohttp_broken"
#: What the warning says did not hold, by the way the contract was broken.
WHAT = {
    "await": "the request's task does not await the request handler's coroutine",
    "clone": "the request the handler gets is not the one its task holds",
}


def start(servers: list[ServerProcess], mode: str, broken: str) -> ServerProcess:
    """The aiohttp test app with ``SELFTEST_BREAK=broken``, served in ``mode``."""
    options = {"policy": "accept-until-idle", "idle": "0.5", "grace_period": "30"}
    if mode == "gunicorn":
        del options["grace_period"]  # the master's --graceful-timeout (10 s)
    command, env = aiohttp_command(mode, options)
    command = [arg.replace(AIOHTTP_APP, BROKEN_APP) for arg in command]
    server = ServerProcess(command, env={**env, "SELFTEST_BREAK": broken})
    servers.append(server)
    return aiohttp_ready(server, mode)


@pytest.mark.parametrize(
    ("broken", "mode"),
    [
        ("", "run_app"),
        ("await", "run_app"),
        ("clone", "run_app"),
        ("", "gunicorn"),
        ("await", "gunicorn"),
    ],
    ids=["intact", "await", "clone", "intact-gunicorn", "await-gunicorn"],
)
def test_aiohttp_hot_path_self_test(servers: list[ServerProcess], broken: str, mode: str) -> None:
    """With the contract broken the first request logs one warning (aiohttp, its
    version, what did not hold) and is answered; a slow request in flight at SIGTERM
    is counted (the middleware's) and waited for (200, not cut).  Intact: no warning,
    the same drain (the hot path's finder counts it)."""
    server = start(servers, mode, broken)
    assert RawHTTP(server.port).get("/readyz")[0] == 200  # a probe first: not the one tested
    said = (f"aiohttp {aiohttp.__version__}: ", f"({WHAT[broken]})") if broken else ()
    output = assert_self_test(server, bool(broken), *said)
    assert " cut: " not in output, output
