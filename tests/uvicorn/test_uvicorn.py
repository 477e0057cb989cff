"""graceful run / graceful.uvicorn.Server against real clients, real signals: what only
uvicorn's side has — the command line, ``--workers``, the third signal, a rolling restart.

The behaviour every server shares (requests in flight, keep-alive, websockets, health,
preStop, escalation), on asyncio and uvloop with h11 and httptools, is in
``test_server_matrix.py``.  Every test starts ``graceful run examples.asgi_app:app`` (or
stock uvicorn) as a subprocess on a free loopback port and waits on its log lines — the
coordinator logs every phase change (``serving -> accepting: SIGTERM``) — never on the
clock.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

import graceful._demo as demo
from graceful._demo._scenario import run_scenario
from tests.support.servers import ACCEPTING, POLICIES, RawHTTP, ServerProcess


def test_bad_policy_exits_2_naming_it(servers: list[ServerProcess]) -> None:
    """An unknown ``--policy`` exits 2 with one message that names it and the choices."""
    server = ServerProcess(
        [
            sys.executable,
            "-m",
            "graceful",
            "run",
            "examples.asgi_app:app",
            "--policy",
            "drain-slowly",
        ]
    )
    servers.append(server)
    assert server.wait_exit() == 2
    assert "unknown policy 'drain-slowly'" in server.output()
    assert "accept-until-idle" in server.output()


@pytest.mark.parametrize(
    ("server", "fails"), [("graceful:accept-until-idle", False), ("uvicorn", True)]
)
def test_rolling_restart(server: str, fails: bool) -> None:
    """Backend A gets SIGTERM while the balancer keeps routing new connections to it for
    1 s (graceful._demo's balancer: L4, no retries); keep-alive, fresh-connection and long
    requests run throughout.  Counts, not timings, are asserted."""
    args = demo.parse(
        ["--servers", server, "--propagation-delay", "1", "--keepalive-clients", "3",
         "--fresh-clients", "3", "--long-requests", "1"]
    )  # fmt: skip
    outcome = asyncio.run(run_scenario(args.kinds[0], args))
    tally = outcome.tally
    assert tally.requests > 60  # traffic across the restart: a floor, not a throughput claim
    assert outcome.terminating is not None
    assert outcome.terminating.ended != "killed"
    if fails:
        assert tally.failed > 0, tally.results  # stock uvicorn refuses new connections
    else:
        assert tally.failed == 0, tally.results


def test_workers_drain_together(servers: list[ServerProcess]) -> None:
    """``--workers 2``: SIGTERM to the parent alone (as in a container) reaches both
    workers, each drains its own requests in flight and stops."""
    server = ServerProcess(
        [sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0",
         "--workers", "2", *POLICIES["accept-until-idle"]]
    )  # fmt: skip
    servers.append(server)
    server.port = int(server.wait_for_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(r"Application startup complete", count=2)
    clients = [RawHTTP(server.port) for _ in range(4)]
    for client in clients:
        client.send("/slow?s=1")
    server.wait_for_line(r"slow request started", count=4)
    server.signal(signal.SIGTERM)  # to the parent only, as in a container
    server.wait_for_line(ACCEPTING, count=2)  # forwarded to both workers
    assert [client.response()[0] for client in clients] == [200] * 4
    assert server.wait_exit() == 0
    assert server.output().count("stopping -> stopped") == 2


def test_third_signal_exits_at_once(servers: list[ServerProcess]) -> None:
    """With ``exit_on_third_request`` a third SIGTERM while a hook hangs exits at once
    (status 1) instead of waiting for the hook's timeout."""
    script = (
        "import anyio, graceful, logging\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "c = graceful.ShutdownCoordinator(hook_timeout_s=60, exit_on_third_request=True)\n"
        "async def hang():\n"
        "    print('hook hanging', flush=True)\n"
        "    await anyio.sleep(60)\n"
        "c.add_hook(hang)\n"
        "async def main():\n"
        "    async with anyio.create_task_group() as tg:\n"
        "        await tg.start(c.run)\n"
        "        print('ready', flush=True)\n"
        "anyio.run(main)\n"
    )
    server = ServerProcess([sys.executable, "-c", script])
    servers.append(server)
    server.wait_for_line("ready")
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    server.signal(signal.SIGTERM)
    server.wait_for_line("hook hanging")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(timeout_s=10) == 1
    assert server.has_line("third shutdown request, exiting immediately")
