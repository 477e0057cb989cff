"""``graceful run`` as a user runs it: bad input, start-up failures, and the ``--workers``
parent with real signals.  Processes are waited for through their output, their exit
or (for workers that are not our children) a pidfd, never through the clock."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from graceful._core.policy import POLICIES
from graceful._options import OPTIONS, Option
from tests.support import zygote
from tests.support.servers import ACCEPTING, ROOT, RawHTTP, ServerProcess, sigstop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")

#: One bad text per kind of value (an option's metavar).
BAD = {
    "SECONDS": "nan",
    "PORT": "99999999999999999999999",
    "N": "0",
    "COUNT": "-1",
    "PATH": "relative",
    "BOOL": "maybe",
    "HOST": "a..b",
}

#: An app that says when it is imported, can take long to import and can block its
#: event loop (``/block``); otherwise the example app.
APP = """\
import os, sys, time
sys.stdout.write("importing app\\n")
sys.stdout.flush()
time.sleep(float(os.environ.get("APP_IMPORT_DELAY", "0")))
if os.environ.get("APP_ATEXIT_HANG"):
    import atexit
    atexit.register(lambda: (print("atexit handler hangs", flush=True), time.sleep(60)))
from examples.asgi_app import app as example

async def app(scope, receive, send):
    if scope["type"] == "http" and scope["path"] == "/block":
        sys.stdout.write("blocking the event loop\\n")
        sys.stdout.flush()
        time.sleep(60)
    await example(scope, receive, send)
"""


def clean_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def graceful_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return zygote.run(
        [sys.executable, "-m", "graceful", "run", *args],
        cwd=ROOT,
        env=env or clean_environment(),
        timeout=30,
    )


def assert_usage_error(result: subprocess.CompletedProcess[str], *names: str) -> str:
    """Exit status 2 and one line on stderr naming ``names``."""
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("graceful run: error: ")
    assert "Traceback" not in result.stderr
    for name in names:
        assert name in lines[0]
    return lines[0]


def bad_text(opt: Option) -> str:
    return "nope" if opt.metavar.startswith("{") else BAD[opt.metavar]


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: o.flag)
def test_bad_option_exits_2_with_one_line(opt: Option) -> None:
    text = bad_text(opt)
    # A switch (--kubernetes / --no-kubernetes) takes no value on the command line.
    given = (f"{opt.flag}={text}",) if opt.switch else (opt.flag, text)
    assert_usage_error(graceful_run("examples.asgi_app:app", *given), opt.flag)
    env = clean_environment(**{opt.env: text})
    assert_usage_error(graceful_run("examples.asgi_app:app", env=env), opt.env)
    env = clean_environment(**{opt.env: ""})
    assert_usage_error(graceful_run("examples.asgi_app:app", env=env), opt.env, "empty")


BAD_COMBINATIONS = [
    (["--readiness-path", "/same", "--liveness-path", "/same"], ["--readiness-path"]),
    (["--liveness-path", "/x", "--prestop-path", "/x"], ["--liveness-path", "--prestop-path"]),
    (["--grace-period", "1", "--kill-margin", "1"], ["--grace-period", "--kill-margin"]),
    (["--grace-period", "0.5"], ["--grace-period", "--kill-margin"]),
    (["--idle", "1e999"], ["--idle"]),
    (["--drain-timeout", "1" + "0" * 400], ["--drain-timeout"]),
    (["--host", "nonexistent.invalid"], ["--host", "cannot resolve"]),
    (["--host", "192.0.2.1"], ["--host", "not an address of this machine"]),
    (["--host", "bad host"], ["--host"]),
    (["--policy", "refuse-immediately", "--max-wait", "3"], ["--max-wait"]),
    (["--unknown-option", "1"], ["--unknown-option"]),
    (["--work", "2"], ["--work"]),  # no abbreviations
]


@pytest.mark.parametrize(
    ("args", "names"), BAD_COMBINATIONS, ids=[" ".join(a)[:40] for a, _ in BAD_COMBINATIONS]
)
def test_bad_combination_exits_2_with_one_line(args: list[str], names: list[str]) -> None:
    assert_usage_error(graceful_run("examples.asgi_app:app", *args), *names)


def test_bad_host_from_the_environment_names_the_variable() -> None:
    env = clean_environment(GRACEFUL_HOST="nonexistent.invalid")
    assert_usage_error(graceful_run("examples.asgi_app:app", env=env), "GRACEFUL_HOST")


def test_port_in_use_names_the_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        message = assert_usage_error(graceful_run("examples.asgi_app:app", "--port", port))
    assert f"--port: port {port} on 127.0.0.1 is in use" in message


@pytest.mark.parametrize(("args", "name"), [(["no_colon"], "MODULE:APP"), ([], "required")])
def test_bad_app_exits_2(args: list[str], name: str) -> None:
    assert_usage_error(graceful_run(*args), name)


def test_help_shows_real_defaults() -> None:
    result = graceful_run("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--idle SECONDS accept-until-idle: the quiet period that ends accepting, s" in text
    assert "[default: 2 with accept-until-idle; env GRACEFUL_IDLE]" in text
    assert "SIGHUP with --workers: reload" in text
    assert "3 the app failed to start" in text


def graceful(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return zygote.run(
        [sys.executable, "-m", "graceful", *args],
        cwd=ROOT,
        env=clean_environment(**env),
        timeout=30,
    )


@pytest.mark.parametrize("args", [["--version"], ["run", "--version"]])
def test_version_names_graceful_the_servers_and_python(args: list[str]) -> None:
    from importlib import metadata

    import graceful as package

    result = graceful(*args)
    assert result.returncode == 0, result
    line = result.stdout.strip()
    assert line.startswith(f"Running graceful-drain {package.__version__} with "), line
    assert f"uvicorn {metadata.version('uvicorn')}" in line
    assert f"hypercorn {metadata.version('hypercorn')}" in line
    assert f"CPython {sys.version.split()[0]} on " in line or "PyPy" in line


def complete(words: str) -> list[str]:
    """What click's bash completion offers for ``words`` (the last one being typed)."""
    result = graceful(
        COMP_WORDS=words, COMP_CWORD=str(len(words.split(" ")) - 1),
        _GRACEFUL_COMPLETE="bash_complete",
    )  # fmt: skip
    assert result.returncode == 0, result
    return [line.split(",", 1)[1] for line in result.stdout.splitlines()]


def test_shell_completion_offers_commands_options_and_choices() -> None:
    assert sorted(complete("graceful ")) == ["demo", "run"]
    assert complete("graceful run --pol") == ["--policy"]
    assert "--reload" in complete("graceful run --rel")  # uvicorn's own options too
    assert complete("graceful run --policy ") == sorted(POLICIES)
    assert complete("graceful run --server h") == ["hypercorn"]
    assert "trio" in complete("graceful run --loop ")
    assert complete("graceful demo --sync") == ["--sync-period"]
    script = graceful(_GRACEFUL_COMPLETE="bash_source")
    assert "_graceful_completion" in script.stdout


#: ``python -c`` that makes the packages named in argv[1] not installed (a failed
#: import, as without them), then runs ``graceful`` with the rest of argv.
WITHOUT = """\
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from graceful.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("missing", "args", "names"),
    [
        ("click,uvicorn,hypercorn,aiohttp", [], ["no server is installed", "[uvicorn]"]),
        ("uvicorn", [], ["the default --server uvicorn needs uvicorn", "graceful-drain[uvicorn]"]),
        ("hypercorn", ["--server", "hypercorn"],
         ["--server hypercorn", "graceful-drain[hypercorn]"]),
        ("aiohttp", ["--server", "aiohttp"], ["--server aiohttp", "graceful-drain[aiohttp]"]),
        ("trio", ["--server", "hypercorn", "--loop", "trio"],
         ["--loop trio needs trio", "graceful-drain[hypercorn,trio]"]),
        ("uvloop", ["--loop", "uvloop"], ["--loop uvloop needs uvloop", "pip install uvloop"]),
    ],
    ids=["base-install", "no-uvicorn", "no-hypercorn", "no-aiohttp", "no-trio", "no-uvloop"],
)  # fmt: skip
def test_missing_extra_is_one_line_naming_it(
    missing: str, args: list[str], names: list[str]
) -> None:
    """Not a ModuleNotFoundError traceback, nor an app failure (3): exit 2, one line."""
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT, missing, "run", "examples.asgi_app:app", *args],
        cwd=ROOT, env=clean_environment(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert_usage_error(result, *names)


# ------------------------------------------------------------------- start-up


@pytest.fixture
def app_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "testapp.py").write_text(APP)
    return {"PYTHONPATH": str(tmp_path)}


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    """Servers to stop after the test, with their workers (even orphaned ones)."""
    servers: list[ServerProcess] = []
    yield servers
    RawHTTP.close_all()
    for server in servers:
        for pid in getattr(server, "worker_pids", []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.stop()


def start(
    started: list[ServerProcess], *args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    server = ServerProcess([sys.executable, "-m", "graceful", "run", *args], env=env)
    started.append(server)
    return server


def start_workers(
    started: list[ServerProcess], *args: str, env: dict[str, str] | None = None
) -> tuple[ServerProcess, list[int]]:
    """``graceful run --workers 2``, once both workers serve."""
    server = start(
        started, "examples.asgi_app:app", "--port", "0", "--workers", "2", *args, env=env
    )
    server.port = int(server.wait_for_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(r"worker \d+ serves", count=2)
    pids = workers(server)
    server.worker_pids = pids  # type: ignore[attr-defined]
    return server, pids


def workers(server: ServerProcess) -> list[int]:
    pids = sorted(server._descendants())
    assert len(pids) == 2, pids
    return pids


def wait_gone(pids: list[int], timeout_s: float = 15.0) -> None:
    """Wait until none of ``pids`` runs (they need not be our children): pidfds."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"process {pid} still runs after {timeout_s} s"
        finally:
            os.close(fd)


def test_app_that_fails_to_import_exits_3() -> None:
    result = graceful_run("no_such_module:app", "--port", "0")
    assert result.returncode == 3, result
    assert "Traceback" not in result.stdout + result.stderr


#: An app whose module raises while it is imported.
RAISES_AT_IMPORT = 'import os\nraise RuntimeError("no DATABASE_URL")\n'


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn", "aiohttp"])
def test_app_that_raises_at_import_exits_3_with_two_lines(tmp_path: Path, server: str) -> None:
    """Not a traceback: the app, the exception and its line, and what status 3 means."""
    (tmp_path / "broken_app.py").write_text(RAISES_AT_IMPORT)
    env = clean_environment(PYTHONPATH=str(tmp_path))
    result = graceful_run("broken_app:app", "--port", "0", "--server", server, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    lines = output.strip().splitlines()
    assert len(lines) == 2, output
    assert lines[0] == (
        "graceful run: broken_app:app failed to start: RuntimeError: no DATABASE_URL "
        f"({tmp_path / 'broken_app.py'}, line 2)"
    ), output
    assert lines[1].startswith("graceful run: exit status 3"), output
    assert "--log-level debug" in lines[1], output


def test_with_log_level_debug_a_failed_import_shows_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "broken_app.py").write_text(RAISES_AT_IMPORT)
    env = clean_environment(PYTHONPATH=str(tmp_path))
    result = graceful_run("broken_app:app", "--port", "0", "--log-level", "debug", env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "Traceback (most recent call last)" in output, output
    assert 'raise RuntimeError("no DATABASE_URL")' in output, output
    assert output.count("broken_app:app failed to start: RuntimeError") == 1, output


def test_workers_that_fail_to_start_stop_the_parent(started: list[ServerProcess]) -> None:
    server = start(started, "no_such_module:app", "--port", "0", "--workers", "2")
    assert server.wait_exit() == 3
    output = server.output()
    assert len([line for line in output.splitlines() if "failed to start" in line]) == 1, output
    assert output.count('Could not import module "no_such_module"') <= 2  # no respawn
    assert "Traceback" not in output


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_while_the_app_is_imported_is_not_lost(
    started: list[ServerProcess], app_env: dict[str, str], workers: str
) -> None:
    server = start(
        started,
        "testapp:app",
        "--port",
        "0",
        "--workers",
        workers,
        "--policy",
        "refuse-immediately",
        env={**app_env, "APP_IMPORT_DELAY": "1.5"},
    )
    server.wait_for_line(r"importing app", count=int(workers))
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    output = server.output()
    assert output.count("serving -> accepting: SIGTERM") == int(workers), output
    assert output.count("stopping -> stopped") == int(workers)


# --------------------------------------------------------------------- workers


def test_sigterm_to_the_parent_drains_both_workers(started: list[ServerProcess]) -> None:
    server, (first, second) = start_workers(started, "--policy", "refuse-immediately")
    clients = []
    # One slow request on each worker: the other one is stopped while it connects.
    for stopped in (second, first):
        sigstop(stopped)
        try:
            client = RawHTTP(server.port)
            client.send("/slow?s=1.5")
            server.wait_for_line(r"slow request started", count=len(clients) + 1)
            clients.append(client)
        finally:
            os.kill(stopped, signal.SIGCONT)
    server.signal(signal.SIGTERM)
    lines = [server.wait_for_line(ACCEPTING + r" \((\d+) connections?, (\d+) requests?", count=n)
             for n in (1, 2)]  # fmt: skip
    assert [line.group(2) for line in lines] == ["1", "1"]
    assert [client.response()[0] for client in clients] == [200, 200]
    assert server.wait_exit() == 0
    assert server.output().count("stopping -> stopped") == 2
    wait_gone([first, second], timeout_s=0)


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP], ids=lambda s: s.name
)
def test_parent_started_with_its_signals_blocked_still_acts_on_them(
    started: list[ServerProcess], sig: signal.Signals
) -> None:
    """A program that starts ``graceful run --workers`` from a thread that blocks these
    signals passes its mask on: before, the parent left them pending for ever."""
    blocked = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        server, pids = start_workers(started, "--policy", "refuse-immediately")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    server.signal(sig)
    if sig is signal.SIGHUP:  # a reload: the old workers go, new ones serve
        server.wait_for_line(r"reload: new workers serve")
        wait_gone(pids)
        server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    wait_gone(pids, timeout_s=0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT])
def test_no_worker_outlives_a_signalled_parent(
    started: list[ServerProcess], sig: signal.Signals
) -> None:
    server, pids = start_workers(started, "--policy", "refuse-immediately")
    server.signal(sig)
    assert server.wait_exit() == 0
    wait_gone(pids, timeout_s=0)  # the parent waited for them


def test_no_worker_outlives_a_killed_parent(started: list[ServerProcess]) -> None:
    server, pids = start_workers(started, "--policy", "refuse-immediately")
    client = RawHTTP(server.port)
    client.send("/slow?s=1")
    server.wait_for_line(r"slow request started")
    server.proc.kill()
    # Each worker gets one SIGTERM from the kernel and drains: the request completes.
    assert client.response()[0] == 200
    wait_gone(pids)
    server.wait_for_line(r"stopping -> stopped", count=2)
    output = server.output()
    assert output.count("serving -> accepting: SIGTERM") == 2, output
    assert "escalated" not in output


def test_sighup_reloads_the_workers(started: list[ServerProcess]) -> None:
    server, old = start_workers(started, "--policy", "refuse-immediately")
    client = RawHTTP(server.port)
    client.send("/slow?s=1.5")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGHUP)
    server.wait_for_line(r"reload: new workers serve")
    assert client.response()[0] == 200  # the old worker drained
    server.wait_for_line(r"retired worker \d+ exited \(exit status 0\)", count=2)
    wait_gone(old, timeout_s=0)
    new = workers(server)
    assert not set(new) & set(old)
    assert RawHTTP(server.port).get("/")[0] == 200
    server.worker_pids = new  # type: ignore[attr-defined]
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    wait_gone(new, timeout_s=0)


def test_a_killed_worker_is_replaced(started: list[ServerProcess]) -> None:
    server, (first, second) = start_workers(started)
    os.kill(first, signal.SIGKILL)
    server.wait_for_line(rf"worker {first} died \(killed by SIGKILL\); starting a new one")
    server.wait_for_line(r"worker \d+ serves", count=3)
    replaced = workers(server)
    assert second in replaced
    assert first not in replaced
    server.worker_pids = replaced  # type: ignore[attr-defined]
    assert RawHTTP(server.port).get("/")[0] == 200
    server.signal(signal.SIGTERM)
    assert server.wait_exit() == 0


def test_an_exit_that_hangs_after_a_complete_shutdown_is_a_warning_and_status_0(
    started: list[ServerProcess], app_env: dict[str, str]
) -> None:
    """The drain is complete and nothing is left, but an ``atexit`` handler hangs: the
    process still leaves at the last moment before SIGKILL, with status 0 and a warning
    (nothing was lost: not an error).  Stock uvicorn re-raises SIGTERM once shut down and
    dies of it (143) without running ``atexit`` handlers at all."""
    server = start(
        started,
        "testapp:app",
        *("--port", "0", "--policy", "refuse-immediately", "--grace-period", "2"),
        *("--kill-margin", "0.5"),
        env={**app_env, "APP_ATEXIT_HANG": "1"},
    )
    server.port = int(server.wait_for_line(r"running on http://127\.0\.0\.1:(\d+)").group(1))
    assert RawHTTP.get_once(server.port, "/")[0] == 200
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"atexit handler hangs")
    assert server.wait_exit(timeout_s=10) == 0
    line = server.wait_for_line(r".*still alive at the last moment before SIGKILL.*").group(0)
    assert "WARNING" in line, line
    assert "(phase stopped); exiting, abandoning 0 connections, 0 requests, 0 sessions" in line
    assert not server.has_line(r"ERROR|Traceback"), server.output()


def test_worker_that_does_not_stop_in_time_makes_the_parent_exit_1(
    started: list[ServerProcess], app_env: dict[str, str]
) -> None:
    server = start(
        started,
        "testapp:app",
        *("--port", "0", "--workers", "2", "--policy", "refuse-immediately"),
        *("--grace-period", "2", "--kill-margin", "0.5"),
        env=app_env,
    )
    server.port = int(server.wait_for_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
    server.wait_for_line(r"worker \d+ serves", count=2)
    server.worker_pids = workers(server)  # type: ignore[attr-defined]
    RawHTTP(server.port).send("/block")
    server.wait_for_line(r"blocking the event loop")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(timeout_s=10) == 1
    assert server.has_line(r"still alive at the last moment before SIGKILL|outlived the kill")
