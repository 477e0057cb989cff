"""``graceful run MODULE:APP``: serve an ASGI app with graceful shutdown, no code changes.

Every option can also come from a ``GRACEFUL_*`` environment variable (the option's
name in upper case, dashes as underscores: ``--drain-timeout`` is
``GRACEFUL_DRAIN_TIMEOUT``); the command line wins.  Bad values exit with status 2 and a
message naming the option (or the variable) and what is allowed.

With ``--workers N`` the parent binds the socket, starts N worker processes that share
it, forwards every signal it receives to them (in Kubernetes only PID 1 gets SIGTERM) and
waits for them within the kill deadline.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._coordinator import GRACE_PERIOD_ENV, ShutdownCoordinator
from ._policy import POLICIES, Policy, policy_from_name

__all__ = ("build_parser", "main")

logger = logging.getLogger("graceful")

POLICY_HELP = {
    "accept-until-idle": "keep accepting until no new connection arrived for --idle seconds "
    "(at least --min-wait, at most --max-wait), then drain (default)",
    "serve-until-killed": "keep serving normally until killed (or --max-wait), then drain",
    "refuse-immediately": "stop accepting at once and drain in-flight requests",
}
assert set(POLICY_HELP) == set(POLICIES)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds >= 0, got {text!r}"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, got {text!r}")
    return value


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _path(text: str) -> str | None:
    if text.lower() in ("", "none", "off"):
        return None
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(
            f"must be a path starting with '/' or 'none', got {text!r}"
        )
    return text


def _policy_name(text: str) -> str:
    key = text.strip().lower().replace("_", "-")
    if key not in POLICIES:
        allowed = ", ".join(sorted(POLICIES))
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}; expected one of {allowed}")
    return key


def _choice(*allowed: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text.lower() not in allowed:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(allowed)}, got {text!r}")
        return text.lower()

    return check


@dataclass(frozen=True)
class _Option:
    flags: tuple[str, ...]
    dest: str
    type: Callable[[str], Any]
    default: Any
    help: str


OPTIONS: tuple[_Option, ...] = (
    _Option(("--server",), "server", _choice("uvicorn"), "uvicorn", "the server to run"),
    _Option(("--host",), "host", str, "127.0.0.1", "address to bind"),
    _Option(("--port",), "port", _port, 8000, "port to bind (0: any free port)"),
    _Option(("--workers",), "workers", _workers, 1, "worker processes sharing the socket"),
    _Option(("--policy",), "policy", _policy_name, "accept-until-idle", "shutdown policy"),
    _Option(("--idle",), "idle", _seconds, None, "accept-until-idle: quiet period, s"),
    _Option(("--min-wait",), "min_wait", _seconds, None, "accept at least this long, s"),
    _Option(("--max-wait",), "max_wait", _seconds, None, "accept at most this long, s"),
    _Option(("--drain-timeout",), "drain_timeout", _seconds, 30.0, "longest drain, s"),
    _Option(
        ("--grace-period",),
        "grace_period",
        _seconds,
        None,
        "seconds from SIGTERM to SIGKILL (terminationGracePeriodSeconds); "
        f"also read from {GRACE_PERIOD_ENV}",
    ),
    _Option(("--kill-margin",), "kill_margin", _seconds, 1.0, "stop this long before SIGKILL, s"),
    _Option(("--readiness-path",), "readiness_path", _path, "/readyz", "readiness endpoint"),
    _Option(("--liveness-path",), "liveness_path", _path, "/livez", "liveness endpoint"),
    _Option(
        ("--prestop-path",),
        "prestop_path",
        _path,
        None,
        "preStop endpoint (off by default: anyone reaching it can stop the server)",
    ),
    _Option(
        ("--websocket-close-grace",),
        "websocket_close_grace",
        _seconds,
        1.0,
        "seconds a websocket may stay open once draining before it is closed with 1001",
    ),
    _Option(
        ("--timeout-keep-alive",),
        "timeout_keep_alive",
        _seconds,
        5.0,
        "close idle keep-alive connections after this long, s (uvicorn's option)",
    ),
    _Option(("--http",), "http", _choice("auto", "h11", "httptools"), "auto", "HTTP parser"),
    _Option(("--loop",), "loop", _choice("auto", "asyncio", "uvloop"), "auto", "event loop"),
    _Option(
        ("--log-level",),
        "log_level",
        _choice("critical", "error", "warning", "info", "debug", "trace"),
        "info",
        "log level",
    ),
)


def _env_name(option: _Option) -> str:
    return "GRACEFUL_" + option.dest.upper()


def build_parser() -> argparse.ArgumentParser:
    """The ``graceful run`` argument parser."""
    policies = "\n".join(f"  {name}: {text}" for name, text in POLICY_HELP.items())
    parser = argparse.ArgumentParser(
        prog="graceful run",
        description="Serve an ASGI app; lose no request when it is restarted.",
        epilog=f"policies:\n{policies}\n\nEvery option can also be set with GRACEFUL_<OPTION>"
        " (e.g. GRACEFUL_DRAIN_TIMEOUT=20); the command line wins.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("app", metavar="MODULE:APP", help="the ASGI app, e.g. myapp:app")
    for option in OPTIONS:
        parser.add_argument(
            *option.flags,
            dest=option.dest,
            type=option.type,
            default=None,
            help=f"{option.help} [env {_env_name(option)}; default {option.default}]",
        )
    parser.add_argument("--worker-fd", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def _apply_environment(args: argparse.Namespace, fail: Callable[[str], object]) -> None:
    """Fill options not given on the command line from ``GRACEFUL_*``, else defaults."""
    for option in OPTIONS:
        if getattr(args, option.dest) is not None:
            continue
        env = _env_name(option)
        text = os.environ.get(env)
        if option.dest == "grace_period" and text is None:
            text = os.environ.get(GRACE_PERIOD_ENV)  # same name, documented for the core
        if text is None:
            setattr(args, option.dest, option.default)
            continue
        try:
            setattr(args, option.dest, option.type(text))
        except argparse.ArgumentTypeError as exc:
            fail(f"environment variable {env}: {exc}")


def coordinator_from_environment(**overrides: Any) -> ShutdownCoordinator:
    """A coordinator configured from ``GRACEFUL_*`` variables (for worker classes).

    Raises:
        ValueError: naming the variable and the allowed values.
    """

    def fail(message: str) -> None:
        raise ValueError(message)

    args = argparse.Namespace(**{option.dest: None for option in OPTIONS})
    _apply_environment(args, fail)
    policy = policy_from_name(
        args.policy, idle_s=args.idle, min_wait_s=args.min_wait, max_wait_s=args.max_wait
    )
    options: dict[str, Any] = {
        "policy": policy,
        "drain_timeout_s": args.drain_timeout,
        "grace_period_s": args.grace_period,
        "kill_margin_s": args.kill_margin,
    }
    options.update(overrides)
    return ShutdownCoordinator(**options)


def parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Policy]:
    """Parse arguments and environment; exit 2 with a clear message on bad values."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _apply_environment(args, parser.error)
    try:
        policy = policy_from_name(
            args.policy, idle_s=args.idle, min_wait_s=args.min_wait, max_wait_s=args.max_wait
        )
        ShutdownCoordinator(
            policy=policy,
            drain_timeout_s=args.drain_timeout,
            grace_period_s=args.grace_period,
            kill_margin_s=args.kill_margin,
        )
    except ValueError as exc:
        message = str(exc)
        for name, flag in (
            ("idle_s", "--idle"),
            ("min_wait_s", "--min-wait"),
            ("max_wait_s", "--max-wait"),
            ("kill_margin_s", "--kill-margin"),
            ("grace_period_s", "--grace-period"),
        ):
            message = message.replace(name, flag)
        parser.error(message)
    if ":" not in args.app:
        parser.error(f"MODULE:APP must look like 'package.module:app', got {args.app!r}")
    return args, policy


def _serve_one(args: argparse.Namespace, policy: Policy) -> int:
    import uvicorn

    from .uvicorn import Server

    coordinator = ShutdownCoordinator(
        policy=policy,
        drain_timeout_s=args.drain_timeout,
        grace_period_s=args.grace_period,
        kill_margin_s=args.kill_margin,
        exit_on_third_request=True,  # the process is ours
        hard_exit=True,
    )
    sys.path.insert(0, os.getcwd())
    config = uvicorn.Config(
        args.app,
        host=args.host,
        port=args.port,
        http=args.http,
        loop=args.loop,
        timeout_keep_alive=args.timeout_keep_alive,
        log_level=args.log_level,
    )
    server = Server(
        config,
        coordinator=coordinator,
        readiness_path=args.readiness_path,
        liveness_path=args.liveness_path,
        prestop_path=args.prestop_path,
        websocket_close_grace_s=args.websocket_close_grace,
    )
    # The process is ours: once the server restored the handlers it found, a late signal
    # (the kubelet's SIGTERM after a preStop hook drained us) must not kill the exiting
    # process with a signal status.  The server installs its own handlers at once.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sockets = None
    if args.worker_fd is not None:
        sockets = [socket.socket(fileno=args.worker_fd)]
    server.run(sockets=sockets)
    if not server.started:
        return 3
    return 0


def _serve_workers(args: argparse.Namespace, argv: Sequence[str]) -> int:
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    sock.set_inheritable(True)
    host, port = sock.getsockname()[:2]
    command = [sys.executable, "-m", "graceful", "run", *argv, "--worker-fd", str(sock.fileno())]
    children = [
        subprocess.Popen(command, pass_fds=(sock.fileno(),), start_new_session=True)
        for _ in range(args.workers)
    ]
    # The children hold the socket now; the parent's copy would keep it open (and its
    # backlog unserved) after the last worker closed its listener.
    sock.close()
    logger.info(
        "graceful: listening on http://%s:%d with %d workers (pids %s)",
        host,
        port,
        args.workers,
        ", ".join(str(c.pid) for c in children),
    )
    print(f"graceful: listening on http://{host}:{port}", flush=True)
    return _supervise(children, args.grace_period)


def _supervise(children: list[subprocess.Popen[bytes]], grace_period_s: float | None) -> int:
    """Forward signals to the workers and wait for them, within the kill deadline."""
    first_signal: list[float] = []
    done = threading.Event()

    def forward(signum: int, frame: object) -> None:
        if not first_signal:
            first_signal.append(time.monotonic())
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {
        sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
    }
    try:
        while not done.is_set():
            if all(child.poll() is not None for child in children):
                break
            overdue = (
                first_signal
                and grace_period_s is not None
                and time.monotonic() > first_signal[0] + grace_period_s
            )
            for child in children if overdue else ():
                if child.poll() is None:
                    logger.error("worker %d outlived the grace period; killing it", child.pid)
                    child.kill()
            done.wait(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [child.wait() for child in children]
    return 0 if all(code == 0 for code in codes) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``graceful run``; returns the exit status."""
    argv = list(sys.argv[2:] if argv is None else argv)
    args, policy = parse(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.log_level in ("debug", "trace") else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.workers > 1 and args.worker_fd is None:
        return _serve_workers(args, argv)
    return _serve_one(args, policy)
