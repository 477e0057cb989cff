"""``graceful run MODULE:APP``: serve an ASGI app with graceful shutdown, no code changes.

Options come from the command line, then ``GRACEFUL_*`` variables, then defaults, all
declared once in ``graceful._options``; a bad value is one line naming the option and
exit status 2, before anything starts.

Each part of ``graceful run`` is one module: this one parses the command line, checks
it and starts what it asks for (``main``); ``command`` builds the click command from
our options and uvicorn's, and its ``--help``; ``servers`` serves in one process, with
uvicorn, hypercorn, aiohttp or granian; ``address`` checks and binds the address;
``workers`` is the ``--workers`` parent, and ``tasks`` the queue its main thread
waits on.

Exit status: 0 after a graceful shutdown, 1 if a worker had to be killed or failed, 2 for
bad usage, 3 if the app could not start.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Final

import click
from click.core import ParameterSource

from .. import _options as _config
from .._core.signals import defer_signals, judge_terminal_by
from .._options import OPTIONS, ConfigError
from .address import _check_address, _remove_uds
from .command import (
    _DRAIN_ALIAS,
    _HIDDEN,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    SERVER_OPTIONS,
    Invocation,
    build_command,
    help_text,
    shared_options,
)
from .command import POLICY_HELP as POLICY_HELP
from .servers import _configure_logging, _serve_one
from .servers import hypercorn_config as hypercorn_config
from .servers import uvicorn_config as uvicorn_config
from .workers import PARENT_SIGNALS, _die_with_parent, _serve_workers

__all__ = ("build_command", "help_text", "main", "parse")

logger = logging.getLogger("graceful")


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
    parent_metrics = parent_checks = False
    if worker_fd is not None and values["management_port"] is not None:
        parent_metrics = values["metrics_path"] is not None
        parent_checks = values["readiness_path"] is not None
        values = _config.answered_by_parent(values)  # the parent's listener answers
    invocation = Invocation(
        app, values, params, given, worker_fd, ready_fd, parent_pid, parent_metrics,
        parent_checks,
    )  # fmt: skip
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
    "granian": ("granian", "pip install 'graceful-drain[granian]'"),
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


# --------------------------------------------------------------------- starting


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``graceful run``; returns the exit status."""
    argv = list(sys.argv[2:] if argv is None else argv)
    # First, before anything slow: a SIGTERM from now on starts the drain once the
    # server is up (a --workers parent picks it up in its own loop).
    defer_signals()
    if "--parent-pid" in argv:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENT_SIGNALS)  # see _Supervisor._spawn
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


def _warn_about_settings(inv: Invocation) -> None:
    """Settings that work but not as meant: a misspelt ``GRACEFUL_*`` variable, metrics
    from one random worker per scrape, a preStop endpoint anyone can reach."""
    for text in _config.unknown_variables():
        logger.warning(text)
    for warning in (
        _config.metrics_workers_warning(inv.values, inv.values["workers"]),
        _config.public_prestop_warning(inv.values),
    ):
        if warning is not None:
            logger.warning(warning)
