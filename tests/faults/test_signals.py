"""Signals: during startup, repeated, mixed, a storm, SIGQUIT, SIGHUP; exit statuses.

``graceful run`` documents: SIGTERM or SIGINT starts the policy, a second one escalates
to stopping (requests still running are cut with a 503), a third exits at once with
status 1, SIGQUIT stops at once; a graceful shutdown exits 0.  Each case waits for the
log line of the previous signal's effect before sending the next one, so the kernel
never merges two pending signals into one.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from graceful._core.coordinator import DUPLICATE_WINDOW_S
from tests.support.harness import ACCEPTING, STOPPED, Client, Harness, tracebacks
from tests.support.servers import RawHTTP, ServerProcess

OPTIONS = ["--policy", "accept-until-idle", "--idle", "1", "--grace-period", "10"]
#: dumb-init, from its wheel (the test extra), beside this interpreter.
DUMB_INIT = Path(sys.executable).with_name("dumb-init")


def slow_client(server: object) -> Client:
    client = Client.connect(server.port)  # type: ignore[attr-defined]
    client.request("/slow?s=30", "slow")
    server.wait_for_line(r"started slow ")  # type: ignore[attr-defined]
    return client


def describe(client: Client) -> str:
    client.wait(10)
    if client.responses:
        return f"in-flight request: {client.responses[0].status}"
    return f"in-flight request: connection {client.end}"


def test_sigterm_during_lifespan_startup(
    harness: Harness, record: Callable[[str], None], tmp_path: Path
) -> None:
    """SIGTERM while lifespan startup runs: startup finishes, then the shutdown runs;
    exit 0"""
    gate = tmp_path / "gate"
    server = harness.graceful(*OPTIONS, env={"FAULTS_STARTUP_GATE": str(gate)}, wait=False)
    server.wait_for_line("startup waiting")
    server.signal(signal.SIGTERM)
    gate.touch()
    began = time.monotonic()
    code = server.wait_exit(10)
    took = time.monotonic() - began
    record(f"exit {code} {took:.1f} s after startup was let go")
    assert code == 0
    assert server.has_line("startup complete")
    assert server.has_line(r"serving -> accepting: SIGTERM")
    assert server.has_line(STOPPED)
    assert "Traceback" not in server.output()


def test_sigterm_during_lifespan_startup_that_never_ends(
    harness: Harness, record: Callable[[str], None], tmp_path: Path
) -> None:
    """SIGTERM while lifespan startup hangs: the process exits before the kill deadline
    (--grace-period 3)"""
    gate = tmp_path / "gate"  # never created: startup waits 60 s
    server = harness.graceful(
        "--grace-period", "3", env={"FAULTS_STARTUP_GATE": str(gate)}, wait=False
    )
    server.wait_for_line("startup waiting")
    began = time.monotonic()
    server.signal(signal.SIGTERM)
    try:
        code: int | None = server.proc.wait(4)
    except Exception:
        code = None
    took = time.monotonic() - began
    record(
        f"exit {code} {took:.1f} s after SIGTERM"
        if code is not None
        else f"still running {took:.1f} s after SIGTERM (grace 3 s)"
    )
    assert code is not None
    assert took < 3.0


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM)],
    ids=["SIGTERM-twice", "SIGINT-then-SIGTERM"],
)
def test_second_signal_escalates(
    harness: Harness,
    record: Callable[[str], None],
    first: signal.Signals,
    second: signal.Signals,
) -> None:
    """A second shutdown signal skips to stopping: the in-flight request gets 503; exit 0"""
    server = harness.graceful(*OPTIONS)
    client = slow_client(server)
    sent = time.monotonic()
    server.signal(first)
    server.wait_for_line(rf"serving -> accepting: {first.name}")
    # A deliberate second signal: later than a process group's duplicate could be.
    wait_until = sent + DUPLICATE_WINDOW_S + 0.1
    while time.monotonic() < wait_until:
        time.sleep(0.02)
    began = time.monotonic()
    server.signal(second)
    code = server.wait_exit(10)
    took = time.monotonic() - began
    record(f"{describe(client)}; exit {code} {took:.1f} s after the second signal")
    assert client.responses[0].status == 503
    assert client.responses[0].headers.get("connection") == "close"
    assert code == 0
    assert server.has_line(rf"accepting -> stopping: {second.name} \(escalated\)")
    assert took < 3


def test_sigquit_stops_at_once(harness: Harness, record: Callable[[str], None]) -> None:
    """SIGQUIT with a request in flight: stop at once, the request gets 503; exit 0"""
    server = harness.graceful(*OPTIONS)
    client = slow_client(server)
    began = time.monotonic()
    server.signal(signal.SIGQUIT)
    code = server.wait_exit(10)
    took = time.monotonic() - began
    record(f"{describe(client)}; exit {code} {took:.1f} s after SIGQUIT")
    assert client.responses[0].status == 503
    assert code == 0
    assert server.has_line(r"serving -> stopping: SIGQUIT")
    assert took < 3


def test_signal_storm(harness: Harness, record: Callable[[str], None]) -> None:
    """50 SIGTERM/SIGINT within 100 ms while a request is in flight: the second signal
    escalates (the request gets 503); a third exits at once with status 1 — unless the
    process finished stopping first (status 0); out within 3 s either way, no traceback"""
    server = harness.graceful(*OPTIONS)
    client = slow_client(server)
    began = time.monotonic()
    for i in range(50):
        server.signal(signal.SIGTERM if i % 2 == 0 else signal.SIGINT, at_once=True)
        time.sleep(0.002)  # the scenario: 50 signals spread over ~100 ms
    sent_in = time.monotonic() - began
    code = server.wait_exit(15)
    took = time.monotonic() - began
    record(f"{describe(client)}; 50 signals in {sent_in * 1000:.0f} ms; exit {code} {took:.1f} s")
    assert code in (0, 1)
    if code == 1:
        assert server.has_line("third shutdown request, exiting immediately")
    else:
        assert server.has_line(STOPPED)
        assert client.responses[0].status == 503
    assert tracebacks(server.output()) == 0
    assert took < 3


def test_sighup(harness: Harness, record: Callable[[str], None]) -> None:
    """SIGHUP is not a shutdown signal: its default action ends the process at once
    (status -1, i.e. 129 in a shell); the in-flight request is lost"""
    # Started with SIGHUP at its default even when this test run ignores it (under
    # ``nohup`` every child inherits the ignore, and then so does the server — rightly).
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        server = harness.graceful(*OPTIONS)
    finally:
        signal.signal(signal.SIGHUP, previous)
    client = slow_client(server)
    server.signal(signal.SIGHUP)
    code = server.wait_exit(10)
    record(f"{describe(client)}; exit {code} (killed by SIGHUP)")
    assert code == -signal.SIGHUP
    assert not server.has_line(ACCEPTING)


def test_sigterm_then_sigquit_while_draining(
    harness: Harness, record: Callable[[str], None]
) -> None:
    """SIGTERM, then SIGQUIT while draining: stop at once, 503 for the in-flight request;
    exit 0"""
    server = harness.graceful("--policy", "refuse-immediately", "--grace-period", "10")
    client = slow_client(server)
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"accepting -> draining")
    began = time.monotonic()
    server.signal(signal.SIGQUIT)
    code = server.wait_exit(10)
    took = time.monotonic() - began
    record(f"{describe(client)}; exit {code} {took:.1f} s after SIGQUIT")
    assert client.responses[0].status == 503
    assert code == 0
    assert server.has_line(r"draining -> stopping: SIGQUIT")
    assert took < 3


def test_the_same_signal_twice_at_once_is_not_an_escalation(
    harness: Harness, record: Callable[[str], None]
) -> None:
    """The same SIGTERM twice back to back (a process group's signal and its relay):
    the in-flight request completes (200), nothing escalates."""
    server = harness.graceful(*OPTIONS)
    client = Client.connect(server.port)  # type: ignore[attr-defined]
    client.request("/slow?s=1", "slow")
    server.wait_for_line(r"started slow ")
    server.signal(signal.SIGTERM)
    server.signal(signal.SIGTERM, at_once=True)
    code = server.wait_exit(15)
    record(f"{describe(client)}; exit {code}")
    assert client.responses[0].status == 200
    assert code == 0
    assert "(escalated)" not in server.output()  # (the kernel may also merge the two)


def _gunicorn(worker: str, app: str = "examples.asgi_app:app") -> list[str]:
    return [sys.executable, "-m", "gunicorn", app, "-k", worker, "-w", "1",
            "-b", "127.0.0.1:0", "--graceful-timeout", "10"]  # fmt: skip


def _graceful_run(*options: str) -> list[str]:
    return [sys.executable, "-m", "graceful", "run", "examples.asgi_app:app", "--port", "0",
            "--grace-period", "10", *options]  # fmt: skip


GUNICORN_LISTENING = r"Listening at: http://127\.0\.0\.1:(\d+)"
RUN_LISTENING = r"(?:running on|listening on) http://127\.0\.0\.1:(\d+)"
#: What systemd's KillMode=control-group, dumb-init's setsid mode, supervisord's
#: stopasgroup and ``timeout`` do: the signal to every process of the group — and a
#: gunicorn master or a --workers parent relays it to its workers as well.
GROUP_CASES = {
    "gunicorn UvicornWorker": (_gunicorn("graceful.gunicorn.UvicornWorker"), GUNICORN_LISTENING),
    "gunicorn HypercornWorker": (
        _gunicorn("graceful.gunicorn.HypercornWorker"),
        GUNICORN_LISTENING,
    ),
    "gunicorn AiohttpWorker": (
        _gunicorn("graceful.gunicorn.AiohttpWorker", "tests.support.aiohttp_apps.app:app"),
        GUNICORN_LISTENING,
    ),
    "graceful run": (_graceful_run(), RUN_LISTENING),
    "graceful run --workers 2": (_graceful_run("--workers", "2"), RUN_LISTENING),
}


def _slow_request(server: ServerProcess, port: int) -> RawHTTP:
    """A 2 s request in flight (the worker may still be starting: bounded retries)."""
    client = RawHTTP(port)
    for _ in range(100):
        try:
            client.send("/slow?s=2")
            server.wait_for_line(r"slow request started", timeout_s=0.5)
            return client
        except (OSError, AssertionError):
            client = RawHTTP(port)
    raise AssertionError(f"no slow request started:\n{server.output()}")


@pytest.mark.parametrize("case", GROUP_CASES)
def test_sigterm_to_the_process_group_is_not_an_escalation(
    record: Callable[[str], None], case: str
) -> None:
    """``kill -TERM -- -$PGID``: each worker gets SIGTERM from the kernel and again from
    its master or parent.  The in-flight request completes (200), as under stock
    uvicorn-worker; nothing escalates."""
    command, listening = GROUP_CASES[case]
    _in_flight_survives(
        command, listening, lambda pid: os.killpg(os.getpgid(pid), signal.SIGTERM), record
    )


def _in_flight_survives(
    command: list[str],
    listening: str,
    terminate: Callable[[int], None],
    record: Callable[[str], None],
) -> None:
    """Start ``command``, put a 2 s request in flight, ``terminate(pid)``: the request
    completes (200), the exit status is 0, nothing escalates."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    server = ServerProcess(command, env={**environment, "GRACEFUL_IDLE": "0.5"})
    try:
        port = int(server.wait_for_line(listening).group(1))
        client = _slow_request(server, port)
        terminate(server.proc.pid)
        status = client.response()[0]
        code = server.wait_exit(20)
        record(f"in-flight request: {status}; exit {code}")
        assert code == 0, server.output()
        assert status == 200, server.output()
        assert "(escalated)" not in server.output()
    finally:
        RawHTTP.close_all()
        server.stop()


@pytest.mark.skipif(not DUMB_INIT.exists(), reason="dumb-init is Linux-only")
def test_sigterm_through_dumb_init_is_not_an_escalation(record: Callable[[str], None]) -> None:
    """dumb-init as PID 1 (its default setsid mode) forwards the SIGTERM it gets to the
    whole process group of its child: gunicorn's worker gets it from dumb-init and again
    from the master.  The in-flight request completes; dumb-init exits with the
    server's status."""
    _in_flight_survives(
        [str(DUMB_INIT), *_gunicorn("graceful.gunicorn.UvicornWorker")],
        GUNICORN_LISTENING,
        lambda pid: os.kill(pid, signal.SIGTERM),  # to dumb-init only, as the kubelet does
        record,
    )


PRESTOP_CASES = {
    "uvicorn": (["examples.asgi_app:app"], RUN_LISTENING),
    "hypercorn": (
        ["examples.asgi_app:app", "--server", "hypercorn"],
        r"Running on http://127\.0\.0\.1:(\d+)",
    ),
    "aiohttp": (["tests.support.aiohttp_apps.app:app", "--server", "aiohttp"], RUN_LISTENING),
}


@pytest.mark.parametrize("server_name", PRESTOP_CASES)
def test_sigterm_right_after_a_prestop_drain_is_not_fatal(
    record: Callable[[str], None], server_name: str
) -> None:
    """The kubelet sends SIGTERM as soon as the preStop hook returned, which is when the
    drain is done: the signal lands while the server tears down.  It must not kill the
    process with its default action (status 143)."""
    app_args, listening = PRESTOP_CASES[server_name]
    server = ServerProcess(
        [sys.executable, "-m", "graceful", "run", *app_args, "--port", "0",
         "--policy", "refuse-immediately", "--grace-period", "10", "--prestop-path", "/prestop"],
    )  # fmt: skip
    try:
        port = int(server.wait_for_line(listening).group(1))
        prestop = RawHTTP(port)
        prestop.send("/prestop")
        status = prestop.response()[0]
        server.signal(signal.SIGTERM, at_once=True)  # the kubelet's, right away
        code = server.wait_exit(15)
        record(f"preStop: {status}; exit {code}")
        assert (status, code) == (200, 0), server.output()
    finally:
        RawHTTP.close_all()
        server.stop()
