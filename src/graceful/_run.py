"""``graceful run MODULE:APP``: serve an ASGI app with graceful shutdown, no code changes.

Options come from the command line, then ``GRACEFUL_*`` variables, then defaults, all
declared once in ``graceful._config``; a bad value is one line naming the option and
exit status 2, before anything starts.

Ours and uvicorn's
------------------
``graceful run`` also takes every option of ``uvicorn`` itself — not re-declared: the
command is built from uvicorn's own click command (``uvicorn.main.main.params``, the
same objects, so their types, defaults, help and ``UVICORN_*`` variables are uvicorn's,
and an option a new uvicorn adds appears by itself), and they reach
``uvicorn.Config`` as ``uvicorn.main.run`` passes them.  Where both declare an
option (``--host``, ``--port``, ``--workers``, ``--loop``, ``--http``, ``--log-level``,
``--timeout-keep-alive``) ours wins: it applies to every ``--server``, has a
``GRACEFUL_*`` variable and graceful's checks, and ``--workers`` is our own parent;
uvicorn's variable for it (``UVICORN_PORT``) is still read, after ``GRACEFUL_PORT``.
uvicorn's ``--timeout-graceful-shutdown`` is our ``--drain-timeout`` under another name.
``--server hypercorn`` and ``--server aiohttp`` take the uvicorn options that have a
counterpart there (``SERVER_OPTIONS``); any other given one is an error naming it
and the server.

Why ``--workers`` has a parent process, and what it promises
------------------------------------------------------------
With ``--workers N`` the parent binds the socket and starts N ``graceful run`` worker
processes that share it.  In a container only PID 1 — the parent — gets the kubelet's
SIGTERM, so the parent exists to relay signals and to keep the workers honest:

* **Workers never outlive the parent.**  Each worker asks the kernel (Linux
  ``PR_SET_PDEATHSIG``) to be told when its parent dies, right at start, then checks
  that the parent is still the one that started it (closing the race with a parent that
  died before the request).  The worker then gets one SIGTERM — not SIGKILL: an
  orphaned worker drains like any other, and it still exits by its deadline because a
  worker owns its process (``hard_exit``).  On other systems a SIGKILLed parent leaves
  its workers running until they are stopped themselves.
* **No signal is lost at start-up.**  The parent blocks the shutdown signals while it
  spawns a worker; the worker inherits the mask, records them
  (``graceful._signals.defer_signals``) and only then unblocks them, so a SIGTERM
  that arrives while the worker's interpreter starts or the app is imported begins the
  drain once the server is up, instead of killing the worker or being dropped.
* **SIGTERM, SIGINT and SIGQUIT are forwarded** to every worker (a repeat too, which
  escalates there); the parent then waits for the workers until the kill deadline
  (``--grace-period``, else Kubernetes' 30 s) and SIGKILLs what is left.
* **SIGHUP reloads**, as with gunicorn and ``uvicorn --workers``: N new workers start;
  once every one of them serves, the old ones get SIGTERM and drain by the policy while
  the new ones accept on the same socket.  A new worker that fails to start aborts the
  reload and the old workers keep serving.
* **A worker that dies while serving is replaced.**  One that fails to start — exit
  status 3, e.g. an import error — stops everything with status 3 if no worker ever
  started, or after three such failures in a row: a broken app must not be restarted
  forever.

A worker tells the parent it serves through a pipe (one byte at uvicorn's first tick),
and the parent learns of exits from one thread per worker that waits for it; both arrive
as callables on one queue, as do the signals (``catch_signals(…, schedule=tasks.put)``),
so the parent's main loop waits on that queue with the kill deadline as its timeout.  It
waits in ``select()`` on a socket that every ``put`` and every signal (the interpreter's
wakeup fd) writes to, not on a lock: whichever thread the kernel delivers a signal to,
the main thread wakes and runs the Python-level handler.  The parent also unblocks the
signals it handles at start-up, whatever mask it inherited.

Exit status: 0 after a graceful shutdown, 1 if a worker had to be killed or failed, 2 for
bad usage, 3 if the app could not start.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import errno
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import queue
import select
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import click
from click.core import ParameterSource
from click.shell_completion import CompletionItem

from . import _config, _logging
from ._config import OPTIONS, ConfigError, Values
from ._coordinator import ShutdownCoordinator
from ._deadlines import DEFAULT_GRACE_PERIOD_S
from ._signals import defer_signals, judge_terminal_by, signal_name

if TYPE_CHECKING:
    import hypercorn.config
    import uvicorn

__all__ = ("build_command", "help_text", "main", "parse")

logger = logging.getLogger("graceful")

#: Exit statuses of ``graceful run``.
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NOT_STARTED: Final = 3

#: Boot failures in a row (after a worker once served) that stop the parent.
MAX_BOOT_FAILURES: Final = 3

#: Signals the parent relays to its workers; SIGHUP it handles itself.
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
PARENT_SIGNALS: Final = (*FORWARDED_SIGNALS, signal.SIGHUP)
#: What the kernel sends a worker when its parent dies (Linux; see _die_with_parent).
PARENT_DEATH_SIGNAL: Final = getattr(signal, "SIGRTMIN", signal.SIGTERM)
_PR_SET_PDEATHSIG: Final = 1

POLICY_HELP: Final = {
    "accept-until-idle": "keep accepting until no new connection arrived for --idle "
    "seconds (at least --min-wait, at most --max-wait), then drain",
    "serve-until-killed": "keep serving normally until killed (or --max-wait), then drain",
    "refuse-immediately": "stop accepting at once and drain in-flight requests",
}

_POLICIES_HELP: Final = "\n".join(
    textwrap.fill(f"{name}: {text}", 86, initial_indent="  ", subsequent_indent="    ")
    for name, text in POLICY_HELP.items()
)
EPILOG: Final = f"""\
policies:
{_POLICIES_HELP}

environment:
  Every graceful option can also be set as GRACEFUL_<OPTION> (GRACEFUL_DRAIN_TIMEOUT=20),
  every uvicorn option as UVICORN_<OPTION> (UVICORN_ROOT_PATH=/api); the command line
  wins.  For the options both have (--host, --port, --loop, ...) graceful's wins, then
  UVICORN_<OPTION> is read.  Booleans: true/false, 1/0, yes/no, on/off.
  --timeout-graceful-shutdown is --drain-timeout; --env-file is read before GRACEFUL_*.

server options:
  uvicorn     every option above (--workers is graceful's parent; --reload runs
              uvicorn's reloader, restarting a graceful server that drains)
  hypercorn   --loop asyncio|uvloop|trio; --uds, --fd, --ssl-keyfile, --ssl-certfile,
              --ssl-keyfile-password, --ssl-ca-certs, --ssl-ciphers, --ssl-cert-reqs,
              --root-path, --[no-]access-log, --backlog, --limit-max-requests[-jitter],
              --ws-max-size, --ws-ping-interval, --h11-max-incomplete-event-size,
              --[no-]server-header, --[no-]date-header, --app-dir, --env-file, --factory
  aiohttp     APP is an aiohttp.web.Application or a factory returning one;
              --loop asyncio|uvloop; --uds, --fd, --ssl-* (as above), --[no-]access-log,
              --backlog, --app-dir, --env-file, --factory
  Any other uvicorn option, and --http, is an error with hypercorn and aiohttp.

signals:
  SIGTERM, SIGINT  start the shutdown policy; a second one stops at once
                   (in-flight requests are cut), a third exits at once
  SIGQUIT          stop at once
  SIGHUP           with --workers: reload (start new workers, then drain the old)

workers:
  With --workers N the parent binds the socket and forwards signals to the workers;
  a worker that dies is replaced; workers never outlive the parent (Linux).

exit status:
  0 graceful shutdown, 1 a worker was killed or failed, 2 bad usage,
  3 the app failed to start
"""


# ------------------------------------------------------------------ the command line
#
# One click command: our options (from graceful._config.OPTIONS, as raw text that
# _config parses, so that the command line and GRACEFUL_* are checked alike), then
# every option of uvicorn's own command (uvicorn.main.main.params, the same click
# objects: types, flags, defaults and UVICORN_* variables are uvicorn's), less those
# we own.  A new uvicorn option appears here by itself.

#: uvicorn's options that ``graceful run`` leaves out: ``--version`` prints uvicorn's.
_LEFT_OUT: Final = frozenset({"version"})
#: uvicorn's option that is our ``--drain-timeout`` under another name.
_DRAIN_ALIAS: Final = "timeout_graceful_shutdown"
#: The uvicorn options that the other servers take too (by uvicorn's name); any other
#: one given with ``--server hypercorn`` or ``aiohttp`` is an error naming both.
SERVER_OPTIONS: Final[dict[str, frozenset[str]]] = {
    "hypercorn": frozenset({
        "uds", "fd", "ssl_keyfile", "ssl_certfile", "ssl_keyfile_password", "ssl_ca_certs",
        "ssl_ciphers", "ssl_cert_reqs", "root_path", "access_log", "backlog", "app_dir",
        "env_file", "factory", "limit_max_requests", "limit_max_requests_jitter",
        "ws_max_size", "ws_ping_interval", "h11_max_incomplete_event_size", "server_header",
        "date_header", _DRAIN_ALIAS,
    }),
    "aiohttp": frozenset({
        "uds", "fd", "ssl_keyfile", "ssl_certfile", "ssl_keyfile_password", "ssl_ca_certs",
        "ssl_ciphers", "ssl_cert_reqs", "access_log", "backlog", "app_dir", "env_file",
        "factory", _DRAIN_ALIAS,
    }),
}  # fmt: skip
#: uvicorn's options and the hypercorn ``Config`` attributes they set (when given).
HYPERCORN_SETTINGS: Final = {
    "ssl_keyfile": "keyfile",
    "ssl_certfile": "certfile",
    "ssl_keyfile_password": "keyfile_password",
    "ssl_ca_certs": "ca_certs",
    "ssl_ciphers": "ciphers",
    "ssl_cert_reqs": "verify_mode",
    "root_path": "root_path",
    "backlog": "backlog",
    "limit_max_requests": "max_requests",
    "limit_max_requests_jitter": "max_requests_jitter",
    "ws_max_size": "websocket_max_message_size",
    "ws_ping_interval": "websocket_ping_interval",
    "h11_max_incomplete_event_size": "h11_max_incomplete_size",
    "server_header": "include_server_header",
    "date_header": "include_date_header",
}


#: The options of a ``--workers`` worker (see ``_our_params``).
_HIDDEN: Final = ("--worker-fd", "--ready-fd", "--parent-pid")


def _uvicorn_command() -> click.Command | None:
    """uvicorn's own command, or ``None`` if uvicorn is not installed."""
    try:
        from uvicorn.main import main as uvicorn_main
    except ImportError:
        return None
    return uvicorn_main


def _uvicorn_params() -> list[click.Parameter]:
    """uvicorn's own options, less those ``graceful run`` owns or leaves out."""
    command = _uvicorn_command()
    ours = {opt.name for opt in OPTIONS}
    return [
        p
        for p in (command.params if command is not None else [])
        if isinstance(p, click.Option) and p.name not in ours and p.name not in _LEFT_OUT
    ]


def shared_options() -> list[str]:
    """Our options that uvicorn's command has too: ours win (see the module docs)."""
    command = _uvicorn_command()
    theirs = {p.name for p in command.params} if command is not None else set()
    return [opt.name for opt in OPTIONS if opt.name in theirs]


def _our_params() -> list[click.Parameter]:
    params: list[click.Parameter] = [
        click.Argument(["app"], required=False, metavar="MODULE:APP"),
    ]
    for opt in OPTIONS:
        text = f"{opt.help} [default: {_config.help_default(opt)}; env {opt.env}]"
        if opt.switch:  # --kubernetes / --no-kubernetes; None when neither is given
            flags = f"{opt.flag}/--no-{opt.flag[2:]}"
            params.append(
                click.Option([flags, opt.name], default=None, help=text, allow_from_autoenv=False)
            )
            continue
        params.append(
            click.Option(
                [opt.flag, opt.name],
                type=str,
                default=None,
                metavar=opt.metavar,
                help=text,
                allow_from_autoenv=False,  # GRACEFUL_* is read by _config
                shell_complete=_completer(opt.choices),
            )
        )
    params.append(
        click.Option(
            ["--version"],
            is_flag=True,
            expose_value=False,
            is_eager=True,
            callback=_print_version,
            help="show graceful's, the servers' and Python's versions and exit",
        )
    )
    # A worker of a --workers parent: the listening socket, the pipe that says it
    # serves, the parent it must not outlive.
    for hidden in _HIDDEN:
        params.append(click.Option([hidden], type=int, hidden=True, allow_from_autoenv=False))
    return params


def _completer(
    choices: tuple[str, ...],
) -> Callable[[click.Context, click.Parameter, str], list[CompletionItem]]:
    def complete(
        ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        return [CompletionItem(c) for c in choices if c.startswith(incomplete)]

    return complete


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from .__main__ import version_text

        click.echo(version_text())
        ctx.exit()


def _write_options(
    formatter: click.HelpFormatter, title: str, records: list[tuple[str, str]]
) -> None:
    formatter.write(f"\n{title}\n")
    for flags, text in records:
        formatter.write(f"  {flags}\n")
        if text:
            formatter.write(
                textwrap.fill(
                    text,
                    88,
                    initial_indent="      ",
                    subsequent_indent="      ",
                    break_on_hyphens=False,
                )
                + "\n"
            )


class _Command(click.Command):
    """``graceful run``: our options, then uvicorn's, then the notes (unwrapped)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        ours = {opt.name for opt in OPTIONS} | {"help"}
        own: list[tuple[str, str]] = []
        theirs: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is None:
                continue
            if param.name == _DRAIN_ALIAS:
                record = (record[0], "graceful: the same as --drain-timeout")
            (own if param.name in ours else theirs).append(record)
        _write_options(formatter, "graceful options:", own)
        if theirs:
            _write_options(
                formatter,
                "uvicorn options (uvicorn's own; see 'server options' below):",
                theirs,
            )

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write("\n" + EPILOG)


def build_command() -> click.Command:
    """The ``graceful run`` command (values are parsed by ``graceful._config``)."""
    return _Command(
        "graceful run",
        params=[*_our_params(), *_uvicorn_params()],
        help="Serve an ASGI app (or an aiohttp app); lose no request when it is restarted.",
        add_help_option=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )


def help_text() -> str:
    """``graceful run --help``."""
    command = build_command()
    with click.Context(command, info_name="graceful run") as ctx:
        return command.get_help(ctx)


@dataclass(frozen=True)
class Invocation:
    """A parsed ``graceful run`` command line.

    Attributes:
        app: ``MODULE:APP``.
        values: Our options, checked.
        uvicorn: uvicorn's options by name (defaults included), as uvicorn's command
            parsed them.
        given: uvicorn's options that were set, with how: ``--reload`` or
            ``UVICORN_RELOAD``.
    """

    app: str
    values: Values
    uvicorn: dict[str, Any]
    given: dict[str, str]
    worker_fd: int | None = None
    ready_fd: int | None = None
    parent_pid: int | None = None

    @property
    def server(self) -> str:
        return str(self.values["server"])

    def option(self, name: str, default: Any = None) -> Any:
        """A uvicorn option's value (``default`` if uvicorn is not installed)."""
        return self.uvicorn.get(name, default)


class HelpShown(Exception):
    """``--help`` was printed; the exit status is 0."""


def _label(ctx: click.Context, param: click.Parameter) -> str:
    if ctx.get_parameter_source(param.name or "") is ParameterSource.ENVIRONMENT:
        envvar = param.envvar or f"{ctx.auto_envvar_prefix}_{(param.name or '').upper()}"
        return envvar if isinstance(envvar, str) else envvar[0]
    return param.opts[0]


def parse(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Invocation:
    """Parse the command line and the environment.

    Args:
        argv: The arguments after ``graceful run``.
        environ: Where ``GRACEFUL_*`` (and ``UVICORN_*`` for the options we share) are
            read (default: ``os.environ``); uvicorn's own options read ``UVICORN_*``
            from ``os.environ``, through click.

    Raises:
        ConfigError: one line naming the option.
        HelpShown: after printing ``--help``.
    """
    environ = os.environ if environ is None else environ
    command = build_command()
    try:
        ctx = command.make_context("graceful run", list(argv), auto_envvar_prefix="UVICORN")
    except click.exceptions.Exit as exc:
        if exc.exit_code == 0:
            raise HelpShown from None
        raise ConfigError(f"exit status {exc.exit_code}") from None
    except click.NoSuchOption as exc:
        shown = click.NoSuchOption(
            exc.option_name, possibilities=[p for p in exc.possibilities or () if p not in _HIDDEN]
        )
        raise ConfigError(" ".join(shown.format_message().split())) from None
    except click.BadParameter as exc:
        message = " ".join(exc.format_message().split())
        param = exc.param
        if isinstance(param, click.Option) and not set(param.opts) & set(argv):
            envvar = f"UVICORN_{(param.name or '').upper()}"
            if envvar in environ:  # click names the option, not the variable
                message = f"{envvar}: {message}"
        raise ConfigError(message) from None
    except click.ClickException as exc:
        raise ConfigError(" ".join(exc.format_message().split())) from None
    params = dict(ctx.params)
    app = params.pop("app")
    worker_fd, ready_fd, parent_pid = (
        params.pop(n) for n in ("worker_fd", "ready_fd", "parent_pid")
    )
    ours = {opt.name: params.pop(opt.name) for opt in OPTIONS}
    uvicorn_params = {p.name: p for p in command.params if p.name in params}
    given = {
        name: _label(ctx, param)
        for name, param in uvicorn_params.items()
        if ctx.get_parameter_source(name)
        in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    }
    if params.get("env_file"):
        _load_env_file(params["env_file"], given["env_file"])
    text = {
        name: str(value).lower() if isinstance(value, bool) else value
        for name, value in ours.items()
        if value is not None
    }
    given_as: dict[str, str] = {
        opt.name: f"--no-{opt.flag[2:]}"
        for opt in OPTIONS
        if opt.switch and ours[opt.name] is False
    }
    # uvicorn's variables for the options we share: after GRACEFUL_*, before the default.
    fallback = {name: f"UVICORN_{name.upper()}" for name in shared_options()}
    alias = given.get(_DRAIN_ALIAS)
    if alias is not None and params[_DRAIN_ALIAS] is not None:
        if not alias.startswith("--"):
            fallback["drain_timeout"] = alias
        elif "drain_timeout" in text:
            raise ConfigError(
                f"{alias} and --drain-timeout are the same setting (the longest drain); give one"
            )
        else:
            text["drain_timeout"] = str(params[_DRAIN_ALIAS])
            given_as["drain_timeout"] = alias
    values = _config.resolve(text, environ, given_as=given_as, fallback_env=fallback)
    if app is None:
        raise ConfigError("the argument MODULE:APP is required (e.g. myapp:app)")
    if ":" not in app:
        raise ConfigError(f"MODULE:APP must look like 'package.module:app', got {app!r}")
    invocation = Invocation(app, values, params, given, worker_fd, ready_fd, parent_pid)
    _check(invocation)
    return invocation


def _load_env_file(path: str, label: str) -> None:
    """Load ``--env-file`` before ``GRACEFUL_*`` is read (uvicorn loads it again, which
    changes nothing: variables already set are kept)."""
    try:
        from dotenv import load_dotenv
    except ImportError:
        raise ConfigError(f"{label} needs python-dotenv (pip install python-dotenv)") from None
    load_dotenv(path)


#: What each server and loop needs installed: (module, what to install).
NEEDS: Final = {
    "uvicorn": ("uvicorn", "pip install 'graceful-drain[uvicorn]'"),
    "hypercorn": ("hypercorn", "pip install 'graceful-drain[hypercorn]'"),
    "aiohttp": ("aiohttp", "pip install 'graceful-drain[aiohttp]'"),
    "trio": ("trio", "pip install 'graceful-drain[hypercorn,trio]'"),
    "uvloop": ("uvloop", "pip install uvloop"),
}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (it is imported: the server uses it next)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _check_installed(inv: Invocation) -> None:
    """One line naming the extra to install, instead of a traceback once serving starts."""
    server = inv.server
    module, how = NEEDS[server]
    if not installed(module):
        label = inv.values.label("server") if inv.values.given("server") else "the default --server"
        raise ConfigError(f"{label} {server} needs {module}, which is not installed: {how}")
    loop = inv.values["loop"]
    if loop in ("trio", "uvloop") and not installed(NEEDS[loop][0]):
        raise ConfigError(
            f"{inv.values.label('loop')} {loop} needs {loop}, which is not installed: "
            f"{NEEDS[loop][1]}"
        )


def _check(inv: Invocation) -> None:
    """The checks between uvicorn's options, ours and the server."""
    server = inv.server
    _check_installed(inv)
    if server != "uvicorn":
        for name, label in inv.given.items():
            if name not in SERVER_OPTIONS[server]:
                raise ConfigError(
                    f"{label} is not taken by {inv.values.label('server')} {server} "
                    "(a uvicorn option with no counterpart there)"
                )
    for header in inv.option("headers", ()):
        if ":" not in header:
            raise ConfigError(f"--header: must be NAME:VALUE, got {header!r}")
    if inv.option("reload") and inv.values["workers"] > 1:
        raise ConfigError(
            f"{inv.given.get('reload', '--reload')} and {inv.values.label('workers')} "
            f"{inv.values['workers']} cannot be combined (reload runs one worker)"
        )
    if inv.option("uds") is not None and inv.option("fd") is not None:
        raise ConfigError(f"{inv.given['uds']} and {inv.given['fd']}: give one")


# -------------------------------------------------------------------- one server


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``graceful run``; returns the exit status."""
    argv = list(sys.argv[2:] if argv is None else argv)
    # First, before anything slow: a SIGTERM from now on starts the drain once the
    # server is up (a --workers parent picks it up in its own loop).
    defer_signals()
    if "--parent-pid" in argv:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENT_SIGNALS)  # see _spawn
        parent = argv[argv.index("--parent-pid") + 1]
        judge_terminal_by(int(parent))  # a Ctrl-C at the parent's terminal drains at once
        if not _die_with_parent(int(parent)):
            print(f"graceful: parent {parent} is gone; not starting", file=sys.stderr)
            return EXIT_FAILED
    try:
        inv = parse(argv)
        _configure_logging(inv)
        if inv.worker_fd is None:  # once, not in every --workers worker
            _warn_about_settings(inv)
        sys.path.insert(0, inv.option("app_dir") or os.getcwd())
        if inv.worker_fd is not None:
            return _serve_one(inv)
        if inv.option("uds") is None and inv.option("fd") is None:
            _check_address(inv.values)
        if inv.values["workers"] > 1:
            return _serve_workers(inv, argv)
        try:
            return _serve_one(inv)
        finally:
            _remove_uds(inv)
    except HelpShown:
        return EXIT_OK
    except ConfigError as exc:
        print(f"graceful run: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE


def _configure_logging(inv: Invocation) -> None:
    """graceful's lines in the server's format (see ``graceful._logging``): with
    uvicorn, uvicorn's logging is set up now (as its ``Config`` will again), so that
    even the lines before the server starts read like uvicorn's."""
    level = _logging.level_of(str(inv.values["log_level"]))
    if inv.server != "uvicorn" or _uvicorn_command() is None:
        _logging.to_stderr(level)
        return
    import uvicorn

    uvicorn.Config(
        inv.app,
        log_config=_log_config(inv),
        log_level=inv.values["log_level"],
        use_colors=inv.option("use_colors"),
    )
    _logging.through("uvicorn", level)


def _log_config(inv: Invocation) -> Any:
    """``--log-config`` if given, else uvicorn's own, with the process id in each line
    of a ``--workers`` worker."""
    from uvicorn.config import LOGGING_CONFIG

    given = inv.option("log_config")
    if given is not None:
        return given
    if inv.worker_fd is None:
        return LOGGING_CONFIG
    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = formatter["fmt"].replace("%(levelprefix)s ", _logging.PID_PREFIX)
    return config


def _warn_about_settings(inv: Invocation) -> None:
    """Settings that work but not as meant: a misspelt ``GRACEFUL_*`` variable, metrics
    from one random worker per scrape."""
    for text in _config.unknown_variables():
        logger.warning(text)
    metrics = _config.metrics_workers_warning(inv.values, inv.values["workers"])
    if metrics is not None:
        logger.warning(metrics)


def _remove_uds(inv: Invocation) -> None:
    """As uvicorn: the process that bound ``--uds`` removes it at exit."""
    path = inv.option("uds")
    if path is not None and inv.worker_fd is None:
        with contextlib.suppress(OSError):
            os.remove(path)


def _serve_one(inv: Invocation) -> int:
    if inv.server == "hypercorn":
        return _serve_hypercorn(inv)
    if inv.server == "aiohttp":
        return _serve_aiohttp(inv)
    return _serve_uvicorn(inv)


def _ready_notifier(inv: Invocation) -> Callable[[], Awaitable[None]]:
    """Tell a ``--workers`` parent, once, that this worker serves."""
    ready_fd = inv.ready_fd

    async def notify_ready() -> None:
        nonlocal ready_fd
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, b"R")
                os.close(ready_fd)
            ready_fd = None

    return notify_ready


def _worker_socket(inv: Invocation) -> socket.socket | None:
    return None if inv.worker_fd is None else socket.socket(fileno=inv.worker_fd)


def _coordinator(inv: Invocation) -> ShutdownCoordinator:
    # The process is ours: a third signal exits at once, and a server that does not
    # stop by the kill deadline is ended just before it.
    return _config.build_coordinator(inv.values, exit_on_third_request=True, hard_exit=True)


def _not_started(exc: BaseException) -> int:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    print(f"graceful run: the app failed to start: {reason}", file=sys.stderr, flush=True)
    return EXIT_NOT_STARTED


# ------------------------------------------------------------------------ uvicorn


def uvicorn_config(inv: Invocation, **extra: Any) -> uvicorn.Config:
    """The ``uvicorn.Config`` of ``inv``: uvicorn's options as uvicorn's own
    command passes them (``uvicorn.main.main``), then ours, then ``extra``."""
    import uvicorn

    accepted = inspect.signature(uvicorn.Config).parameters
    kwargs: dict[str, Any] = {}
    for name, value in inv.uvicorn.items():
        if name not in accepted:
            continue  # handled here (app_dir) or not a setting of the server (reload_*…)
        kwargs[name] = list(value) or None if isinstance(value, tuple) else value
    if kwargs.get("headers"):
        kwargs["headers"] = [tuple(h.split(":", 1)) for h in kwargs["headers"]]
    if "log_config" in kwargs:
        kwargs["log_config"] = _log_config(inv)
    if _DRAIN_ALIAS in kwargs:
        kwargs[_DRAIN_ALIAS] = None  # our --drain-timeout (the coordinator) bounds it
    kwargs.update(_config.uvicorn_kwargs(inv.values), **extra)
    return uvicorn.Config(inv.app, **kwargs)


def _serve_uvicorn(inv: Invocation) -> int:
    extra: dict[str, Any] = {}
    if inv.ready_fd is not None:
        # uvicorn calls it at its first tick once it listens (and every timeout_notify
        # seconds after): the parent is told once.
        extra = {"callback_notify": _ready_notifier(inv), "timeout_notify": 3600}
    config = uvicorn_config(inv, **extra)
    if config.should_reload and inv.worker_fd is None:
        return _serve_reload(inv, config)
    server = _config.build_server(inv.values, config, exit_on_third_request=True, hard_exit=True)
    sock = _worker_socket(inv)
    try:
        server.run(sockets=None if sock is None else [sock])
    except SystemExit:
        if server.started:
            raise
        # uvicorn exits 1 when it cannot import the app: that is our status 3.
    return EXIT_OK if server.started else EXIT_NOT_STARTED


def _serve_reload(inv: Invocation, config: uvicorn.Config) -> int:
    """``--reload``: uvicorn's reloader (watchfiles, else polling) in this process, our
    server in the process it restarts; a restart drains the old one by the policy."""
    from uvicorn.supervisors import ChangeReload

    sock = config.bind_socket()
    # Listening from now on: a connection made while a server restarts waits in the
    # backlog for the next one instead of being refused.
    sock.listen(config.backlog)
    target = functools.partial(_serve_reloaded, inv.values, config)
    ChangeReload(config, target=target, sockets=[sock]).run()
    return EXIT_OK


def _serve_reloaded(values: Values, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
    """The target of the reloader's process (pickled: module level).

    Whatever the policy, a restart drains at once (refuse-immediately): the reloader
    keeps the socket listening, so a connection made meanwhile waits in the backlog for
    the next server instead of being refused — there is no balancer to wait for.
    """
    from ._policy import RefuseImmediately

    # uvicorn configured its logging in this process (from the pickled config) already.
    _logging.through("uvicorn", _logging.level_of(str(values["log_level"])))
    server = _config.build_server(
        values, config, policy=RefuseImmediately(), exit_on_third_request=True, hard_exit=True
    )
    server.run(sockets=sockets)


# ---------------------------------------------------------------------- hypercorn


def hypercorn_config(inv: Invocation) -> hypercorn.config.Config:
    """The hypercorn ``Config`` of ``inv``: our options and uvicorn's that apply."""
    from hypercorn.config import Config

    values = inv.values
    config = Config()
    if inv.option("uds") is not None:
        config.bind = [f"unix:{inv.option('uds')}"]
    elif inv.option("fd") is not None:
        config.bind = [f"fd://{inv.option('fd')}"]
    else:
        host = values["host"]
        config.bind = [f"[{host}]:{values['port']}" if ":" in host else f"{host}:{values['port']}"]
    config.keep_alive_timeout = values["timeout_keep_alive"]
    config.loglevel = values["log_level"].upper().replace("TRACE", "DEBUG")
    config.accesslog = "-" if inv.option("access_log", True) else None
    config.worker_class = _loop(values)
    for name, attribute in HYPERCORN_SETTINGS.items():
        if name in inv.given:
            setattr(config, attribute, inv.option(name))
    return config


def _loop(values: Values) -> str:
    """``auto`` is uvloop if it is installed, as with uvicorn."""
    loop = str(values["loop"])
    if loop != "auto":
        return loop
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def _serve_hypercorn(inv: Invocation) -> int:
    from hypercorn.config import Sockets

    from .hypercorn import run

    config = hypercorn_config(inv)
    coordinator = _coordinator(inv)
    served = False

    async def started() -> None:  # the coordinator runs once the listeners are up
        nonlocal served
        served = True
        await _ready_notifier(inv)()

    coordinator.start_background(started)
    sockets = None
    sock = _worker_socket(inv)
    if sock is not None:
        secure = config.ssl_enabled
        sockets = Sockets(
            secure_sockets=[sock] if secure else [],
            insecure_sockets=[] if secure else [sock],
            quic_sockets=[],
        )
    app = inv.app + "()" if inv.option("factory") else inv.app
    try:
        run(
            app,
            config,
            coordinator=coordinator,
            sockets=sockets,
            **_config.middleware_kwargs(inv.values),
        )
    except Exception as exc:
        if served:
            raise
        return _not_started(exc)
    return EXIT_OK if served else EXIT_NOT_STARTED


# ------------------------------------------------------------------------ aiohttp


def _ssl_context(inv: Invocation) -> ssl.SSLContext | None:
    """uvicorn's ``--ssl-*`` options as an ``ssl.SSLContext`` (aiohttp)."""
    certfile = inv.option("ssl_certfile")
    if certfile is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, inv.option("ssl_keyfile"), inv.option("ssl_keyfile_password"))
    context.verify_mode = ssl.VerifyMode(inv.option("ssl_cert_reqs", ssl.CERT_NONE))
    if inv.option("ssl_ca_certs"):
        context.load_verify_locations(inv.option("ssl_ca_certs"))
    if "ssl_ciphers" in inv.given:
        context.set_ciphers(inv.option("ssl_ciphers"))
    return context


def _serve_aiohttp(inv: Invocation) -> int:
    import asyncio

    from .aiohttp import load_app, run_app

    values = inv.values
    try:
        app = load_app(inv.app)
    except (ImportError, ValueError, TypeError) as exc:
        return _not_started(exc)
    try:
        ssl_context = _ssl_context(inv)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--ssl-certfile/--ssl-keyfile: {exc}") from None
    coordinator = _coordinator(inv)
    served = False

    async def started() -> None:  # the coordinator runs once the sites listen
        nonlocal served
        served = True
        await _ready_notifier(inv)()

    coordinator.start_background(started)
    where: dict[str, Any]
    sock = _worker_socket(inv)
    if sock is not None:
        where = {"sock": sock}
    elif inv.option("uds") is not None:
        where = {"path": inv.option("uds")}
    elif inv.option("fd") is not None:
        where = {"sock": socket.socket(fileno=inv.option("fd"))}
    else:
        where = {"host": values["host"], "port": values["port"]}
    options: dict[str, Any] = {"keepalive_timeout": values["timeout_keep_alive"]}
    if "backlog" in inv.given:
        options["backlog"] = inv.option("backlog")
    if not inv.option("access_log", True):
        options["access_log"] = None
    loop: asyncio.AbstractEventLoop
    if _loop(values) == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        run_app(
            app,
            coordinator=coordinator,
            ssl_context=ssl_context,
            loop=loop,
            print=None,  # the banner is our log line
            **where,
            **options,
            **_config.middleware_kwargs(values),
        )
    except Exception as exc:
        if served:
            raise
        return _not_started(exc)
    return EXIT_OK if served else EXIT_NOT_STARTED


def _die_with_parent(parent_pid: int) -> bool:
    """Have the kernel stop this worker with one SIGTERM when its parent dies (Linux).

    The kernel sends the "parent death" signal each time the worker is re-parented,
    and when the parent is killed it is re-parented once per thread the parent had:
    several SIGTERMs would escalate the drain into a cut.  So the kernel sends
    ``PARENT_DEATH_SIGNAL``, whose handler turns the first into one SIGTERM.

    Returns:
        ``False`` if the parent already died (before the request could cover it).
    """
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
        except (OSError, AttributeError):
            print("graceful: cannot ask to be stopped with the parent (prctl)", file=sys.stderr)
            return os.getppid() == parent_pid
        stopped = False

        def parent_died(signum: int, frame: object) -> None:
            nonlocal stopped
            prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
            if not stopped:
                stopped = True
                signal.raise_signal(signal.SIGTERM)

        signal.signal(PARENT_DEATH_SIGNAL, parent_died)
        if prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
            print("graceful: cannot ask to be stopped with the parent (prctl)", file=sys.stderr)
    return os.getppid() == parent_pid


# ------------------------------------------------------------------ the address


def _addresses(values: Values) -> list[tuple[Any, ...]]:
    host, port = values["host"], values["port"]
    try:
        return socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
        )
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"{values.label('host')}: cannot resolve {host!r}: {reason}") from None


def _bind(values: Values, family: int, address: Any) -> socket.socket:
    """A socket bound to ``address``, set up like asyncio's ``create_server``; bind
    errors as one line naming ``--host`` or ``--port``."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        host, port = values["host"], values["port"]
        where = f"{values.label('host')} {host} {values.label('port')} {port}"
        if exc.errno == errno.EADDRNOTAVAIL:
            where = f"{values.label('host')}: {host!r} is not an address of this machine"
        elif exc.errno == errno.EADDRINUSE:
            where = f"{values.label('port')}: port {port} on {host} is in use"
        elif exc.errno == errno.EACCES:
            where = f"{values.label('port')}: no permission to bind port {port}"
        raise ConfigError(f"{where} ({exc.strerror or exc})") from None
    return sock


def _check_address(values: Values) -> None:
    """Refuse an address that cannot be bound, before the app is imported; uvicorn
    would only log the error after starting up."""
    for family, _, _, _, address in _addresses(values):
        _bind(values, family, address).close()
        if values["port"] == 0:
            break  # any free port: the first address is the one that matters


# ---------------------------------------------------------------------- workers


def _listener(inv: Invocation) -> socket.socket:
    """The socket the workers share: ``--uds``, ``--fd`` or ``--host``/``--port``."""
    values = inv.values
    path, fd = inv.option("uds"), inv.option("fd")
    if fd is not None:
        try:
            return socket.socket(fileno=fd)
        except OSError as exc:
            raise ConfigError(f"{inv.given['fd']}: {fd} is not a socket ({exc.strerror})") from None
    if path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o666)  # as uvicorn
        except OSError as exc:
            sock.close()
            raise ConfigError(
                f"{inv.given['uds']}: cannot bind {path!r} ({exc.strerror})"
            ) from None
    else:
        family, _, _, _, address = _addresses(values)[0]
        sock = _bind(values, family, address)
    sock.listen(inv.option("backlog", 2048))
    return sock


def _serve_workers(inv: Invocation, argv: Sequence[str]) -> int:
    sock = _listener(inv)
    command = [sys.executable, "-m", "graceful", "run", *argv]
    values = inv.values
    try:
        return _Supervisor(
            sock, command, values["workers"], values["grace_period"], values["kubernetes"]
        ).run()
    finally:
        _remove_uds(inv)


def _where(sock: socket.socket) -> str:
    address = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return f"unix socket {address}"
    host = f"[{address[0]}]" if sock.family == socket.AF_INET6 else address[0]
    return f"http://{host}:{address[1]}"


def _describe(status: int) -> str:
    return f"killed by {signal_name(-status)}" if status < 0 else f"exit status {status}"


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Block the parent's signals while a worker is spawned: the worker inherits the
    mask and unblocks it only once it records them (see ``main``)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Tasks:
    """The ``--workers`` parent's queue of callables, put from any thread (and from a
    signal handler), taken by the main thread.

    ``get`` waits in ``select()`` on a socket pair that each ``put`` writes a byte to, and
    that ``woken_by_signals`` makes the interpreter's wakeup fd: a signal wakes the main
    thread through it even when the kernel delivered the signal to another thread, and
    the main thread then runs the Python-level handler before it looks at the queue
    again.  (A blocking lock acquire is woken only by a signal delivered to the main
    thread itself, and not by one that arrives between the interpreter's last check and
    the start of the wait: the parent once ignored a SIGQUIT for good that way.)
    """

    def __init__(self) -> None:
        self._items: collections.deque[Callable[[], object]] = collections.deque()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)

    def put(self, task: Callable[[], object]) -> None:
        self._items.append(task)  # atomic: safe from a thread and from a signal handler
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            self._writer.send(b"\0")

    def get(self, timeout: float | None = None) -> Callable[[], object]:
        """The oldest task; waits at most ``timeout`` seconds (``None``: no limit).

        Raises:
            queue.Empty: ``timeout`` elapsed with nothing queued.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._items:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise queue.Empty
            select.select([self._reader], [], [], left)
            with contextlib.suppress(BlockingIOError):
                while self._reader.recv(4096):
                    pass
        return self._items.popleft()

    @contextlib.contextmanager
    def woken_by_signals(self) -> Iterator[None]:
        """Main thread only: make the socket the interpreter's signal wakeup fd."""
        previous = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous)

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    ready_fd: int
    ready: bool = False
    retiring: bool = False  # told to stop by a reload or an aborted one


@dataclass(eq=False)
class _Supervisor:
    """The ``--workers`` parent (see the module docs)."""

    sock: socket.socket
    command: list[str]
    count: int
    grace_period_s: float | None
    kubernetes: bool = False
    workers: list[_Worker] = field(default_factory=list)
    tasks: _Tasks = field(default_factory=lambda: _Tasks())
    stopping: bool = False
    deadline: float | None = None
    status: int = EXIT_OK
    ever_ready: bool = False
    boot_failures: int = 0
    reload: list[_Worker] | None = None  # the new workers of a reload in progress

    def run(self) -> int:
        from ._signals import catch_signals

        # A mask inherited from whoever started us (a thread of a program that blocks
        # them) would leave these signals pending for ever: they are ours now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENT_SIGNALS)
        with (
            self.tasks.woken_by_signals(),
            catch_signals(PARENT_SIGNALS, self._on_signal, schedule=self.tasks.put),
        ):
            for _ in range(self.count):
                self._spawn()
            where = _where(self.sock)
            logger.info(
                "listening on %s with %d workers (pids %s)",
                where,
                self.count,
                ", ".join(str(w.proc.pid) for w in self.workers),
            )
            while self.workers:
                timeout = None
                if self.deadline is not None:
                    timeout = max(0.0, self.deadline - time.monotonic())
                try:
                    task = self.tasks.get(timeout=timeout)
                except queue.Empty:
                    self._kill_all()
                    continue
                task()
        self.tasks.close()
        self.sock.close()
        return self.status

    # ------------------------------------------------------------ the workers

    def _spawn(self) -> _Worker:
        ready_r, ready_w = os.pipe()
        listening = self.sock.fileno()
        command = [
            *self.command,
            *("--worker-fd", str(listening), "--ready-fd", str(ready_w)),
            *("--parent-pid", str(os.getpid())),
        ]
        try:
            with _signals_blocked():
                proc = subprocess.Popen(
                    command, pass_fds=(listening, ready_w), start_new_session=True
                )
        finally:
            os.close(ready_w)
        worker = _Worker(proc, ready_r)
        self.workers.append(worker)
        # The watcher inherits the blocked mask: a process-directed signal must reach the
        # main thread, which waits on the queue, not a watcher (it would not wake main).
        with _signals_blocked():
            threading.Thread(
                target=self._watch, args=(worker,), name=f"graceful-worker-{proc.pid}", daemon=True
            ).start()
        return worker

    def _watch(self, worker: _Worker) -> None:
        """Report, through the queue, that the worker serves and when it exits."""
        try:
            if os.read(worker.ready_fd, 1):
                self.tasks.put(lambda: self._on_ready(worker))
        except OSError:
            pass
        finally:
            os.close(worker.ready_fd)
        worker.proc.wait()
        self.tasks.put(lambda: self._on_exit(worker))

    def _signal(self, worker: _Worker, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            worker.proc.send_signal(signum)

    def _kill_all(self) -> None:
        """The kill deadline passed."""
        self.deadline = None
        for worker in self.workers:
            logger.error("worker %d outlived the kill deadline; killing it", worker.proc.pid)
            self._signal(worker, signal.SIGKILL)
        self.status = EXIT_FAILED

    # ------------------------------------------------------------------ events

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            self._start_reload()
            return
        if not self.stopping:
            logger.info(
                "%s: stopping %d workers (pids %s)",
                signal_name(signum),
                len(self.workers),
                ", ".join(str(w.proc.pid) for w in self.workers),
            )
            self._stop()
        for worker in self.workers:
            self._signal(worker, signum)

    def _stop(self, status: int | None = None) -> None:
        """No more restarts; SIGKILL what is left at the kill deadline."""
        self.stopping = True
        self.reload = None
        # No worker will be started any more; our copy of the socket would keep it
        # open (and its backlog unserved) once the last worker closed its listener.
        self.sock.close()
        if status is not None:
            self.status = status
        grace = DEFAULT_GRACE_PERIOD_S if self.grace_period_s is None else self.grace_period_s
        self.deadline = time.monotonic() + grace
        if self.kubernetes and status is None:
            # The workers plan against the pod's own deadline: so must our SIGKILL.
            threading.Thread(
                target=self._read_pod_deadline, args=(time.time(),), daemon=True
            ).start()

    def _read_pod_deadline(self, requested_at_s: float) -> None:
        from .kubernetes import read_kill_deadline

        found = read_kill_deadline(
            requested_at_s, grace_period_known=self.grace_period_s is not None
        )
        if found is not None:
            at, why = found
            self.tasks.put(lambda: self._set_deadline(at, why))

    def _set_deadline(self, wall_clock_s: float, why: str) -> None:
        if self.deadline is None:  # already past it
            return
        self.deadline = time.monotonic() + (wall_clock_s - time.time())
        logger.info(
            "kill deadline from %s: workers left then are killed in %.1f s",
            why,
            self.deadline - time.monotonic(),
        )

    def _start_reload(self) -> None:
        if self.stopping:
            logger.info("SIGHUP: ignored while stopping")
            return
        if self.reload is not None:
            logger.info("SIGHUP: ignored, a reload is in progress")
            return
        self.reload = [self._spawn() for _ in range(self.count)]
        logger.info(
            "SIGHUP: reloading: started workers %s; the old ones stop once they serve",
            ", ".join(str(w.proc.pid) for w in self.reload),
        )

    def _retire(self, workers: list[_Worker]) -> None:
        for worker in workers:
            worker.retiring = True
            self._signal(worker, signal.SIGTERM)

    def _on_ready(self, worker: _Worker) -> None:
        logger.info("worker %d serves", worker.proc.pid)
        worker.ready = True
        self.ever_ready = True
        self.boot_failures = 0
        if self.reload is not None and all(w.ready for w in self.reload):
            old = [w for w in self.workers if w not in self.reload and not w.retiring]
            logger.info(
                "reload: new workers serve; stopping the old ones (pids %s)",
                ", ".join(str(w.proc.pid) for w in old),
            )
            self.reload = None
            self._retire(old)

    def _on_exit(self, worker: _Worker) -> None:
        self.workers.remove(worker)
        pid, status = worker.proc.pid, worker.proc.returncode
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # A worker that was killed left its live gauges behind (graceful.metrics).
            try:
                from . import metrics

                metrics.mark_process_dead(pid)
            except Exception:  # no prometheus-client, or a broken directory: not ours
                logger.debug("could not mark worker %d dead for the metrics", pid, exc_info=True)
        if self.stopping:
            log = logger.info if status == 0 else logger.error
            log("worker %d exited (%s)", pid, _describe(status))
            if status != 0 and self.status == EXIT_OK:
                self.status = EXIT_FAILED
            return
        if worker.retiring:
            logger.info("retired worker %d exited (%s)", pid, _describe(status))
            return
        if worker.ready:
            if status == 0:  # stopped by a signal of its own, say
                logger.warning("worker %d stopped; starting a new one", pid)
            else:
                logger.error("worker %d died (%s); starting a new one", pid, _describe(status))
            self._spawn()
            return
        # It never served: the app (or its configuration) is broken, perhaps for good.
        self.boot_failures += 1
        if self.reload is not None and worker in self.reload:
            logger.error(
                "reload failed: new worker %d did not start (%s); the old workers keep serving",
                pid,
                _describe(status),
            )
            self._retire([w for w in self.reload if w is not worker])
            self.reload = None
            return
        if not self.ever_ready or self.boot_failures >= MAX_BOOT_FAILURES:
            times = "" if self.boot_failures == 1 else f" ({self.boot_failures} times in a row)"
            logger.error(
                "worker %d failed to start (%s)%s; stopping", pid, _describe(status), times
            )
            self._stop(EXIT_NOT_STARTED)
            for other in self.workers:
                self._signal(other, signal.SIGTERM)
            return
        logger.error("worker %d failed to start (%s); trying again", pid, _describe(status))
        self._spawn()
