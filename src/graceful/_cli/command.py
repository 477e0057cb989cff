"""The ``graceful run`` command: its options, ours and uvicorn's, and its ``--help``.

Built once here for the parser (``graceful._cli.run``), the help and the shell completion
(``graceful.__main__``); what a parse yields is an ``Invocation``, which the servers
(``graceful._cli.servers``) and the ``--workers`` parent (``graceful._cli.workers``)
read.  Exit statuses live here too: the help lists them.

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
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import click
from click.shell_completion import CompletionItem

from .. import _options as _config
from .._options import OPTIONS, Values

#: Exit statuses of ``graceful run``.
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NOT_STARTED: Final = 3

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
  granian     ASGI only (granian's embedded server); --loop asyncio|uvloop; --uds,
              --fd, --ssl-keyfile, --ssl-certfile, --ssl-keyfile-password,
              --ssl-ca-certs, --[no-]access-log, --backlog, --app-dir, --env-file,
              --factory
  Any other uvicorn option, and --http, is an error with hypercorn, aiohttp and granian.

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
# One click command: our options (from graceful._options.OPTIONS, as raw text that
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
    "granian": frozenset({
        "uds", "fd", "ssl_keyfile", "ssl_certfile", "ssl_keyfile_password", "ssl_ca_certs",
        "access_log", "backlog", "app_dir", "env_file", "factory", _DRAIN_ALIAS,
    }),
}  # fmt: skip


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
        from .version import version_text

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
    """The ``graceful run`` command (values are parsed by ``graceful._options``)."""
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
    #: A ``--workers`` worker whose parent serves every worker's metrics (from
    #: ``PROMETHEUS_MULTIPROC_DIR``): it writes its own there.
    parent_metrics: bool = False
    #: A ``--workers`` worker whose parent answers the health checks (its management
    #: port): accept-until-idle waits for the parent's word that they let go.
    parent_checks: bool = False

    @property
    def server(self) -> str:
        return str(self.values["server"])

    def option(self, name: str, default: Any = None) -> Any:
        """A uvicorn option's value (``default`` if uvicorn is not installed)."""
        return self.uvicorn.get(name, default)
