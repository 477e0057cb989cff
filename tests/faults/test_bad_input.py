"""Bad input: exit status 2 and one clear line naming the option, never a traceback.

Every case runs ``python -m graceful run`` with one bad option (or ``GRACEFUL_*``
variable) and expects it to refuse to start: status 2, no traceback, and exactly one
error line that names the option (or the variable).  A value that is accepted instead
must then work: the server starts, drains at SIGTERM and exits 0.  gunicorn with a bad
``GRACEFUL_*`` variable must stop with one clear line, not respawn crashing workers.
"""

from __future__ import annotations

import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from tests.support.harness import ACCEPTING, APP, RUNNING, Client, Harness

HUGE = "9" * 30

#: (case id, extra command-line arguments, environment, the name the message must use —
#: a regular expression; a first argument not starting with "-" replaces MODULE:APP)
CASES: list[tuple[str, list[str], dict[str, str], str]] = [
    ("idle-not-a-number", ["--idle", "abc"], {}, "--idle"),
    ("idle-negative", ["--idle", "-1"], {}, "--idle"),
    ("drain-timeout-nan", ["--drain-timeout", "nan"], {}, "--drain-timeout"),
    ("grace-period-inf", ["--grace-period", "inf"], {}, "--grace-period"),
    ("max-wait-empty", ["--max-wait", ""], {}, "--max-wait"),
    ("policy-unknown", ["--policy", "drain-slowly"], {}, "--policy"),
    ("http-unknown", ["--http", "h3"], {}, "--http"),
    ("port-huge", ["--port", HUGE], {}, "--port"),
    ("port-negative", ["--port", "-80"], {}, "--port"),
    ("workers-zero", ["--workers", "0"], {}, "--workers"),
    ("kill-margin-over-grace", ["--grace-period", "4", "--kill-margin", "5"], {}, "--kill-margin"),
    ("idle-with-refuse-immediately", ["--policy", "refuse-immediately", "--idle", "1"], {},
     "--idle"),
    ("prestop-path-no", ["--prestop-path", "no"], {}, "--prestop-path"),
    ("nudge-clients-not-a-boolean", ["--nudge-clients", "maybe"], {}, "--nudge-clients"),
    ("app-without-colon", ["tests.support.fault_apps.basic"], {}, "MODULE:APP"),
    ("env-idle-not-a-number", [], {"GRACEFUL_IDLE": "abc"}, "GRACEFUL_IDLE"),
    ("env-idle-negative", [], {"GRACEFUL_IDLE": "-1"}, "GRACEFUL_IDLE"),
    ("env-drain-timeout-nan", [], {"GRACEFUL_DRAIN_TIMEOUT": "nan"}, "GRACEFUL_DRAIN_TIMEOUT"),
    ("env-grace-period-inf", [], {"GRACEFUL_GRACE_PERIOD": "inf"}, "GRACEFUL_GRACE_PERIOD"),
    ("env-idle-empty", [], {"GRACEFUL_IDLE": ""}, "GRACEFUL_IDLE"),
    ("env-policy-unknown", [], {"GRACEFUL_POLICY": "drain-slowly"}, "GRACEFUL_POLICY"),
    ("env-port-huge", [], {"GRACEFUL_PORT": HUGE}, "GRACEFUL_PORT"),
    ("env-workers-not-a-number", [], {"GRACEFUL_WORKERS": "two"}, "GRACEFUL_WORKERS"),
    ("env-loop-unknown", [], {"GRACEFUL_LOOP": "trio"}, "GRACEFUL_LOOP"),
    ("env-prestop-path-no", [], {"GRACEFUL_PRESTOP_PATH": "no"}, "GRACEFUL_PRESTOP_PATH"),
    ("env-idle-with-refuse-immediately", [],
     {"GRACEFUL_POLICY": "refuse-immediately", "GRACEFUL_IDLE": "1"}, "GRACEFUL_IDLE|--idle"),
]  # fmt: skip

#: Cases that were defects when the suite was written: (case id, arguments, environment,
#: name, what was wrong).  They run as plain ``test_bad_value_is_refused`` cases now.
FIXED_DEFECTS: list[tuple[str, list[str], dict[str, str], str, str]] = [
    (
        "duplicate-health-paths",
        ["--readiness-path", "/x", "--liveness-path", "/x"],
        {},
        "--liveness-path",
        "duplicate health paths pass the parser; GracefulMiddleware raises ValueError when "
        "the server starts: a traceback and status 1",
    ),
    (
        "env-duplicate-health-paths",
        [],
        {"GRACEFUL_READINESS_PATH": "/x", "GRACEFUL_LIVENESS_PATH": "/x"},
        "GRACEFUL_LIVENESS_PATH",
        "duplicate health paths pass the parser; GracefulMiddleware raises ValueError when "
        "the server starts: a traceback and status 1",
    ),
    (
        "host-garbage",
        ["--host", "no such host!"],
        {},
        "--host",
        "--host is not checked: uvicorn fails to bind later, logs only '[Errno -2] Name or "
        "service not known' (not naming --host) and graceful run exits 3",
    ),
    (
        "env-host-garbage",
        [],
        {"GRACEFUL_HOST": "no such host!"},
        "GRACEFUL_HOST",
        "GRACEFUL_HOST is not checked: uvicorn fails to bind later, logs only '[Errno -2] "
        "Name or service not known' (not naming the variable) and graceful run exits 3",
    ),
    (
        "workers-huge",
        ["--workers", HUGE],
        {},
        "--workers",
        "--workers has no upper bound: 10**30 is accepted (and would fork until the machine "
        "gives out; here the port is taken, so it fails to bind with a traceback instead)",
    ),
    (
        "env-nudge-clients-not-a-boolean",
        [],
        {"GRACEFUL_NUDGE_CLIENTS": "maybe"},
        "GRACEFUL_NUDGE_CLIENTS",
        "there is no boolean option (no --nudge-clients): GRACEFUL_NUDGE_CLIENTS=maybe is "
        "silently ignored, like every unknown GRACEFUL_* variable",
    ),
]

PARAMS = [pytest.param(*case[1:], id=case[0]) for case in CASES] + [
    pytest.param(*case[1:4], id=case[0]) for case in FIXED_DEFECTS
]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port already listening, so a run that gets past parsing fails to bind
    instead of starting (or forking ``--workers`` processes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def run_bad(
    harness: Harness, args: list[str], env: dict[str, str], port: int
) -> tuple[int | None, str]:
    """Run ``graceful run`` until it exits, or until it serves (``None``: accepted)."""
    app = APP
    if args and not args[0].startswith("-"):  # the case is about the app argument
        app, args = args[0], args[1:]
    port_option = [] if "GRACEFUL_PORT" in env else ["--port", str(port)]  # the CLI wins
    command = [sys.executable, "-m", "graceful", "run", app, *port_option, *args]
    server = harness.start(command, env)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            server._reader.join(5)
            return server.proc.returncode, server.output()
        if server.has_line(RUNNING):
            server.port = int(server.wait_for_line(RUNNING).group(1))
            return None, server.output()
        time.sleep(0.02)
    raise AssertionError(f"neither exited nor served within 20 s:\n{server.output()}")


def message_lines(output: str) -> list[str]:
    """The output's lines, without an argparse usage block (``usage:`` and its indented
    continuation lines) and blank lines."""
    lines, in_usage = [], False
    for line in output.splitlines():
        if line.startswith("usage:"):
            in_usage = True
            continue
        if in_usage and line.startswith(" "):
            continue
        in_usage = False
        if line.strip():
            lines.append(line)
    return lines


def check(code: int | None, output: str, name: str) -> None:
    """Refused: status 2, no traceback, one message line, naming ``name``."""
    assert code is not None, f"accepted and started serving:\n{output}"
    assert "Traceback" not in output, output
    assert code == 2, output
    lines = message_lines(output)
    assert len(lines) == 1, output
    assert re.search(name, lines[0]), output


def summary(code: int | None, output: str) -> str:
    if code is None:
        return "accepted: the server started"
    lines = message_lines(output)
    shown = next((line for line in lines if re.search(r"error", line, re.I)), None)
    shown = shown or (lines[-1] if lines else "")
    extra = f" ({len(lines)} lines)" if len(lines) > 1 else ""
    traceback = ", traceback" if "Traceback" in output else ""
    return f"exit {code}{traceback}{extra}: {shown.strip()[:150]}"


@pytest.mark.parametrize(("args", "env", "name"), PARAMS)
def test_bad_value_is_refused(
    harness: Harness,
    record: Callable[[str], None],
    taken_port: int,
    args: list[str],
    env: dict[str, str],
    name: str,
) -> None:
    """Bad value: exit 2 with one error line naming it"""
    code, output = run_bad(harness, args, env, taken_port)
    record(summary(code, output))
    check(code, output, name)


@pytest.mark.parametrize(
    ("args", "env"),
    [
        pytest.param(["--grace-period", "1" + "0" * 20], {}, id="grace-period-1e20"),
        pytest.param(
            [],
            {"GRACEFUL_GRACE_PERIOD": "1" + "0" * 20},
            id="env-grace-period-1e20",
        ),
        pytest.param(["--idle", "1" + "0" * 20, "--grace-period", "3"], {}, id="idle-1e20"),
    ],
)
def test_huge_value_refused_or_works(
    harness: Harness, record: Callable[[str], None], args: list[str], env: dict[str, str]
) -> None:
    """Huge but finite value: refused with exit 2, or accepted and then a SIGTERM still
    drains and exits 0 without a traceback"""
    code, output = run_bad(harness, args, env, 0)
    if code is not None:
        record(summary(code, output))
        check(code, output, args[0] if args else next(iter(env)))
        return
    server = harness.servers[-1]
    began = time.monotonic()
    server.signal(signal.SIGTERM)
    code = server.wait_exit(15)
    took = time.monotonic() - began
    tracebacks = server.output().count("Traceback")
    errors = [line for line in server.output().splitlines() if "Error" in line][:1]
    record(
        f"accepted; SIGTERM: exit {code} in {took:.1f} s, {tracebacks} traceback(s)"
        + (f": {errors[0].strip()[:120]}" if errors else "")
    )
    assert code == 0
    assert tracebacks == 0, server.output()


def test_gunicorn_bad_environment_stops_the_master(
    harness: Harness, record: Callable[[str], None]
) -> None:
    """GRACEFUL_IDLE=abc gunicorn -w 2: the master stops with one clear line, within 10 s,
    without a crash loop"""
    server = harness.gunicorn(workers=2, env={"GRACEFUL_IDLE": "abc"}, wait=False)
    began = time.monotonic()
    deadline = began + 10
    while time.monotonic() < deadline and server.proc.poll() is None:
        if server.output().count("Booting worker") > 6:
            break  # a crash loop: no need to watch it longer
        time.sleep(0.05)
    code = server.proc.poll()
    output = server.output()
    boots = output.count("Booting worker")
    tracebacks = output.count("Traceback")
    took = time.monotonic() - began
    record(
        f"{boots} workers booted, {tracebacks} tracebacks in {took:.1f} s; "
        + (f"master exit {code}" if code is not None else "master still running")
    )
    assert code is not None
    assert code != 0
    assert boots <= 2
    assert tracebacks <= 2
    assert any("GRACEFUL_IDLE" in line for line in output.splitlines())


@pytest.mark.parametrize("how", ["option", "environment"])
def test_boolean_no_means_false(harness: Harness, record: Callable[[str], None], how: str) -> None:
    """A boolean given 'no' (--nudge-clients no / GRACEFUL_NUDGE_CLIENTS=no) is false:
    accept-until-idle, which nudges by default, then sends no Connection: close while
    accepting"""
    options = ["--policy", "accept-until-idle", "--idle", "1", "--grace-period", "10"]
    env = {"GRACEFUL_NUDGE_CLIENTS": "no"} if how == "environment" else {}
    if how == "option":
        options += ["--nudge-clients", "no"]
    code, output = run_bad(harness, options, env, 0)
    if code is not None:
        record(summary(code, output))
        raise AssertionError(f"'no' refused:\n{output}")
    server = harness.servers[-1]
    client = Client.connect(server.port)
    client.request("/", "before")
    assert client.response().status == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(ACCEPTING)
    client.request("/", "accepting")
    response = client.response()
    code = server.wait_exit(15)
    header = response.headers.get("connection", "(none)")
    record(
        f"accepted; response while accepting: {response.status}, Connection: {header}; exit {code}"
    )
    assert response.status == 200
    assert header != "close"
    assert code == 0
