"""Every ``graceful run`` option, declared once.

Why one table
-------------
The same settings reach graceful in three ways: ``graceful run --idle 2``,
``GRACEFUL_IDLE=2`` (for ``graceful run`` and for the gunicorn workers, which have no
command line of their own) and the defaults printed by ``--help``.  Written out three
times they drift: a variable the gunicorn worker forgot, a ``--help`` that says
"default None" where the policy really waits 2 s, a check that one path has and the
other lacks.  So each option is one ``Option`` in ``OPTIONS`` — its name (which
gives both the flag and the variable), a parser from text to value, the default, a line
of help and *where the value goes*: the policy, the coordinator, the middleware, uvicorn's
``Config`` or ``graceful run`` itself.  The argument parser, the environment reader, the
gunicorn workers, the help text and ``graceful.uvicorn.build_server`` are all generated from it, so
adding an option is adding one entry.

uvicorn's own options (``--reload``, ``--uds``, ``--ssl-*``, …) are not declared here:
``graceful run`` takes them from uvicorn's command line definition (see
``graceful._cli.command``).  An option declared here that uvicorn has too wins over uvicorn's.

Values are checked twice: each on its own by its parser (a wrong type, NaN, a negative or
absurdly large number, an empty string, an unknown choice), then together by
``check``, which builds the policy, the coordinator and the middleware once — so
whatever they validate is validated here, before a server or a worker starts — and adds
the checks between options (``--grace-period`` must exceed ``--kill-margin``, the health
endpoints need distinct paths).  Every failure is one ``ConfigError`` line that
names the option the way the user set it: ``--idle`` or ``GRACEFUL_IDLE``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from typing_extensions import final

from ._core.coordinator import ShutdownCoordinator
from ._core.deadlines import DEFAULT_GRACE_PERIOD_S
from ._core.policy import POLICIES, AcceptUntilIdle, Policy, policy_from_name

if TYPE_CHECKING:
    pass

__all__ = (
    "ENV_PREFIX",
    "MAX_SECONDS",
    "OPTIONS",
    "SERVERS",
    "SERVER_LOOPS",
    "ConfigError",
    "Option",
    "Values",
    "boolean",
    "build_coordinator",
    "check",
    "coordinator_kwargs",
    "from_environment",
    "gunicorn_values",
    "help_default",
    "metrics_workers_warning",
    "middleware_kwargs",
    "option",
    "policy_kwargs",
    "python_options",
    "python_setup",
    "resolve",
    "split_python",
    "unexpected_keyword",
    "unknown_variables",
    "uvicorn_kwargs",
)

#: Prefix of the environment variables: ``--drain-timeout`` is ``GRACEFUL_DRAIN_TIMEOUT``.
ENV_PREFIX: Final = "GRACEFUL_"
#: The largest number of seconds any option takes (a week): larger values are mistakes,
#: and some overflow the platform's timers.
MAX_SECONDS: Final = 7 * 24 * 3600.0

Target = Literal["run", "uvicorn", "policy", "coordinator", "middleware"]

#: The servers ``graceful run --server`` runs.
SERVERS: Final = ("uvicorn", "hypercorn", "aiohttp")
#: The ``--loop`` values of the servers other than uvicorn (which takes uvicorn's own).
SERVER_LOOPS: Final = {
    "hypercorn": ("auto", "asyncio", "uvloop", "trio"),
    "aiohttp": ("auto", "asyncio", "uvloop"),
}


class ConfigError(ValueError):
    """A bad option value; the message is one line naming the option."""


# ------------------------------------------------------------------------- parsers
#
# A parser turns the text of one option (from the command line or the environment,
# stripped) into its value, or raises ValueError with the reason: "must be …, got '…'".


def _shown(text: str) -> str:
    """``text`` quoted for a message, shortened so that the message stays one line."""
    if len(text) > 40:
        return repr(text[:20]) + f"… ({len(text)} characters)"
    return repr(text)


def seconds(text: str) -> float:
    """A finite number of seconds from 0 to ``MAX_SECONDS``."""
    reason = f"must be a number of seconds from 0 to {MAX_SECONDS:g}, got {_shown(text)}"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(reason) from None
    if not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        raise ValueError(reason)
    return value


def integer(low: int, high: int, what: str) -> Callable[[str], int]:
    """A parser for whole numbers from ``low`` to ``high``; ``what`` names them."""

    def parse(text: str) -> int:
        # Digits only: int() would also take "1_000", "+5" and non-ASCII digits.
        if re.fullmatch(r"[0-9]{1,9}", text) is None or not low <= int(text) <= high:
            raise ValueError(f"must be {what} from {low} to {high}, got {_shown(text)}")
        return int(text)

    parse.__name__ = "integer"
    return parse


def choice(*allowed: str) -> Callable[[str], str]:
    """A parser for one of ``allowed`` (case-insensitive)."""

    def parse(text: str) -> str:
        if text.lower() not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, got {_shown(text)}")
        return text.lower()

    parse.__name__ = "choice"
    parse.choices = lambda: allowed  # type: ignore[attr-defined]  # for shell completion
    return parse


#: uvicorn's import strings: ``package.module:attribute``.
_IMPORT_STRING: Final = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _uvicorn_names(table: str, fallback: tuple[str, ...]) -> tuple[str, ...]:
    """The names in ``uvicorn.config.<table>`` of the installed uvicorn (``fallback``
    without uvicorn): a choice a new uvicorn adds is taken as it is."""
    try:
        from uvicorn import config
    except ImportError:
        return fallback
    names = getattr(config, table, None)
    return tuple(names) if isinstance(names, dict) and names else fallback


def uvicorn_choice(table: str, fallback: tuple[str, ...], *extra: str) -> Callable[[str], str]:
    """A parser for one of uvicorn's names in ``uvicorn.config.<table>``
    (``HTTP_PROTOCOLS``, ``LOOP_FACTORIES``), one of ``extra``, or an import string
    ``module:attribute`` — what uvicorn's own ``--http`` and ``--loop`` take."""

    def parse(text: str) -> str:
        names = (*_uvicorn_names(table, fallback), *extra)
        if text.lower() in names:
            return text.lower()
        if _IMPORT_STRING.fullmatch(text):
            return text
        raise ValueError(
            f"must be one of {', '.join(names)} or an import string module:attribute, "
            f"got {_shown(text)}"
        )

    parse.__name__ = "choice"
    parse.choices = lambda: (*_uvicorn_names(table, fallback), *extra)  # type: ignore[attr-defined]
    return parse


_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


def boolean(text: str) -> bool:
    """``true/false``, ``1/0``, ``yes/no`` or ``on/off``, in any case; nothing else."""
    key = text.lower()
    if key in _TRUE:
        return True
    if key in _FALSE:
        return False
    raise ValueError(f"must be true or false (also 1/0, yes/no, on/off), got {_shown(text)}")


def policy_name(text: str) -> str:
    """A policy name (``accept_until_idle`` and any case are accepted)."""
    key = text.lower().replace("_", "-")
    if key not in POLICIES:
        allowed = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown policy {_shown(text)}; expected one of {allowed}")
    return key


policy_name.choices = lambda: tuple(sorted(POLICIES))  # type: ignore[attr-defined]


def endpoint_path(text: str) -> str | None:
    """An HTTP path for an endpoint, or ``none``/``off`` for no endpoint."""
    if text.lower() in ("none", "off"):
        return None
    if not text.startswith("/") or re.search(r"[\s?#]", text) or not text.isprintable():
        raise ValueError(
            "must be a path starting with '/' (no spaces, '?' or '#') or 'none', "
            f"got {_shown(text)}"
        )
    return text


_LABEL: Final = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host(text: str) -> str:
    """An IP address or a host name (whether it resolves is checked by the caller)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        pass
    else:
        return text
    name = text[:-1] if text.endswith(".") else text
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"must be an IP address or a host name, got {_shown(text)}")
    return text


# ------------------------------------------------------------------------- options


@final
@dataclass(frozen=True, slots=True)
class Option:
    """One setting of ``graceful run`` and of the gunicorn workers.

    Attributes:
        name: The option's name with underscores; it gives the flag (``--drain-timeout``)
            and the environment variable (``GRACEFUL_DRAIN_TIMEOUT``).
        parse: Text to value; raises ``ValueError`` with the reason.
        default: The value when the option is not set.  For policy options ``None``
            means "the chosen policy's own default".
        to: Where the value goes and as which keyword argument: ``"policy"``
            (``graceful.policy_from_name``), ``"coordinator"``
            (``graceful.ShutdownCoordinator``), ``"middleware"``
            (``graceful.asgi.GracefulMiddleware``), ``"uvicorn"``
            (``uvicorn.Config``) or ``"run"`` (read by graceful itself: ``graceful
            run``'s own settings, the Kubernetes integration).
        metavar: The kind of value, for ``--help`` (and the tests' bad examples).
        help: One line for ``--help``.
        default_text: How ``--help`` shows the default, if not the value itself.
        gunicorn: For settings gunicorn owns, what to use instead under gunicorn
            (``GRACEFUL_*`` for them is ignored there, with a warning).
        servers: The servers of ``graceful run --server`` that take the option; given
            with another one it is an error naming both.
        switch: A yes/no option: on the command line a flag and its ``--no-`` twin
            (``--kubernetes``, ``--no-kubernetes``), in the environment a boolean.
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    _: KW_ONLY
    to: tuple[Target, str]
    metavar: str
    help: str
    default_text: str | None = None
    gunicorn: str | None = None
    servers: tuple[str, ...] = SERVERS
    switch: bool = False

    @property
    def target(self) -> Target:
        """Where the value goes (see ``to``)."""
        return self.to[0]

    @property
    def keyword(self) -> str:
        """The keyword argument of the target (see ``to``)."""
        return self.to[1]

    @property
    def choices(self) -> tuple[str, ...]:
        """The values a shell may complete (none for free-form options)."""
        choices = getattr(self.parse, "choices", None)
        return tuple(choices()) if choices is not None else ()

    @property
    def python(self) -> str:
        """The option's keyword in graceful's Python API, ``drain_timeout_s``: the
        keyword argument of its target (``policy`` for ``--policy``, whose target
        keyword is the policy's name)."""
        return self.name if self.keyword == "name" else self.keyword

    @property
    def flag(self) -> str:
        """The command-line flag, ``--drain-timeout``."""
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """The environment variable, ``GRACEFUL_DRAIN_TIMEOUT``."""
        return ENV_PREFIX + self.name.upper()


OPTIONS: Final[tuple[Option, ...]] = (
    Option(
        "server", choice(*SERVERS), "uvicorn", to=("run", "server"),
        metavar="{" + ",".join(SERVERS) + "}", help="the server to run",
        gunicorn="-k graceful.gunicorn.UvicornWorker",
    ),
    Option(
        "host", host, "127.0.0.1", to=("uvicorn", "host"), metavar="HOST",
        help="address to bind",
        gunicorn="--bind",
    ),
    Option(
        "port", integer(0, 65535, "a port number"), 8000, to=("uvicorn", "port"),
        metavar="PORT", help="port to bind (0: any free port)",
        gunicorn="--bind",
    ),
    Option(
        "workers", integer(1, 1024, "a number of processes"), 1, to=("run", "workers"),
        metavar="N", help="worker processes sharing the socket (see 'workers' below)",
        gunicorn="--workers",
    ),
    Option(
        "policy", policy_name, "accept-until-idle", to=("policy", "name"),
        metavar="{" + ",".join(sorted(POLICIES)) + "}",
        help="shutdown policy (see 'policies' below)",
    ),
    Option(
        "idle", seconds, None, to=("policy", "idle_s"), metavar="SECONDS",
        help="accept-until-idle: the quiet period that ends accepting, s",
    ),
    Option(
        "min_wait", seconds, None, to=("policy", "min_wait_s"), metavar="SECONDS",
        help="accept at least this long after SIGTERM, s",
    ),
    Option(
        "max_wait", seconds, None, to=("policy", "max_wait_s"), metavar="SECONDS",
        help="accept at most this long after SIGTERM, s",
    ),
    Option(
        "nudge_clients", boolean, None, to=("policy", "nudge_clients"), metavar="BOOL",
        help="send 'Connection: close' while still accepting, so keep-alive clients reconnect",
    ),
    Option(
        "drain_timeout", seconds, 30.0, to=("coordinator", "drain_timeout_s"),
        metavar="SECONDS", help="the longest drain before what is left is cut, s",
    ),
    Option(
        "grace_period", seconds, None, to=("coordinator", "grace_period_s"), metavar="SECONDS",
        help="seconds from SIGTERM to SIGKILL (the pod's terminationGracePeriodSeconds)",
        default_text=f"unset: Kubernetes' {DEFAULT_GRACE_PERIOD_S:g} s is assumed, with a warning",
        gunicorn="--graceful-timeout",
    ),
    Option(
        "kill_margin", seconds, 1.0, to=("coordinator", "kill_margin_s"), metavar="SECONDS",
        help="be out this long before SIGKILL, whatever the app does; stopping (cutting, "
        "lifespan shutdown, hooks) begins this long before that",
    ),
    Option(
        "kubernetes", boolean, False, to=("run", "kubernetes"), metavar="BOOL",
        switch=True,
        help="read the kill deadline (the pod's deletionTimestamp) and, for "
        "accept-until-idle, the pod's EndpointSlice state from the Kubernetes API "
        "(needs the kubernetes extra)",
    ),
    Option(
        "wait_for_endpoints", boolean, True, to=("run", "wait_for_endpoints"),
        metavar="BOOL", switch=True,
        help="with --kubernetes and accept-until-idle: start the idle window only once "
        "no EndpointSlice routes to the pod (--no-wait-for-endpoints: the deadline only)",
    ),
    Option(
        "readiness_on_shutdown", choice("fail", "keep"), "fail",
        to=("middleware", "readiness_on_shutdown"), metavar="{fail,keep}",
        help="readiness from the shutdown request: fail (503 at once) or keep (200 while "
        "accepting: kube-proxy's terminating-endpoint fallback still routes here)",
    ),
    Option(
        "readiness_path", endpoint_path, "/readyz", to=("middleware", "readiness_path"),
        metavar="PATH", help="readiness endpoint ('none': none)",
    ),
    Option(
        "liveness_path", endpoint_path, "/livez", to=("middleware", "liveness_path"),
        metavar="PATH", help="liveness endpoint ('none': none)",
    ),
    Option(
        "prestop_path", endpoint_path, None, to=("middleware", "prestop_path"), metavar="PATH",
        help="preStop endpoint (off by default: anyone reaching it can stop the server)",
    ),
    Option(
        "metrics_path", endpoint_path, None, to=("middleware", "metrics_path"), metavar="PATH",
        help="Prometheus metrics endpoint (off by default; needs the metrics extra)",
    ),
    Option(
        "websocket_close_grace", seconds, 1.0, to=("middleware", "websocket_close_grace_s"),
        metavar="SECONDS",
        help="how long a websocket may stay open once draining before it is closed with 1001, s",
    ),
    Option(
        "timeout_keep_alive", seconds, 5.0, to=("uvicorn", "timeout_keep_alive"),
        metavar="SECONDS",
        help="close idle keep-alive connections after this long, s (uvicorn's option)",
        gunicorn="--keep-alive",
    ),
    Option(
        "http", uvicorn_choice("HTTP_PROTOCOLS", ("auto", "h11", "httptools")), "auto",
        to=("uvicorn", "http"), metavar="{auto,h11,httptools,...}",
        help="HTTP protocol: any of uvicorn's (zttp for --http2) or module:class",
        gunicorn="-k graceful.gunicorn.UvicornH11Worker for h11", servers=("uvicorn",),
    ),
    Option(
        "loop", uvicorn_choice("LOOP_FACTORIES", ("auto", "asyncio", "uvloop"), "trio"),
        "auto", to=("uvicorn", "loop"), metavar="{auto,asyncio,uvloop,trio,...}",
        help="event loop: any of uvicorn's or module:factory with uvicorn (auto: uvloop if "
        "installed); auto, asyncio, uvloop or trio with hypercorn; auto, asyncio or uvloop "
        "with aiohttp",
        gunicorn="-k graceful.gunicorn.UvicornH11Worker for asyncio",
    ),
    Option(
        "log_level", choice("critical", "error", "warning", "info", "debug", "trace"), "info",
        to=("uvicorn", "log_level"), metavar="{critical,error,warning,info,debug,trace}",
        help="log level",
        gunicorn="--log-level",
    ),
)  # fmt: skip

_BY_NAME: Final = {o.name: o for o in OPTIONS}
assert len(_BY_NAME) == len(OPTIONS), "duplicate option names"


def option(name: str) -> Option:
    """The option called ``name`` (``"drain_timeout"``)."""
    return _BY_NAME[name]


def _show(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _policy_defaults(keyword: str) -> str:
    """``"2 with accept-until-idle"``: the defaults of the policies that take ``keyword``."""
    shown = []
    for name, cls in sorted(POLICIES.items()):
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # every policy is one
        field = next((f for f in fields if f.name == keyword), None)
        if field is None:
            continue
        try:  # only the policies that accept the option from the command line
            policy_from_name(name, **{keyword: field.default})  # type: ignore[arg-type]
        except ValueError:
            continue
        shown.append(f"{_show(field.default)} with {name}")
    return ", ".join(shown)


def help_default(opt: Option) -> str:
    """The default as ``--help`` shows it: the real one, also for policy options."""
    if opt.default_text is not None:
        return opt.default_text
    if opt.target == "policy" and opt.default is None:
        return _policy_defaults(opt.keyword)
    return _show(opt.default)


# -------------------------------------------------------------------------- values


@final
class Values(Mapping[str, Any]):
    """Checked option values by name, and how each was set (for messages).

    ``values["idle"]``; ``label`` is ``"--idle"`` or ``"GRACEFUL_IDLE"``.
    """

    __slots__ = ("_labels", "_unset_labels", "_values")

    def __init__(
        self,
        values: Mapping[str, Any],
        labels: Mapping[str, str],
        unset_labels: Mapping[str, str] | None = None,
    ) -> None:
        self._values = dict(values)
        self._labels = dict(labels)
        self._unset_labels = dict(unset_labels or {})

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Values({self._values!r})"

    def label(self, name: str) -> str:
        """How the option was set: its flag, its variable or what the host passed; for
        an option not set, how it would be (its flag, or its Python name)."""
        label = self._labels.get(name) or self._unset_labels.get(name)
        return label if label is not None else _BY_NAME[name].flag

    def given(self, name: str) -> bool:
        """Whether the option was set (not left at its default)."""
        return name in self._labels


#: ``GRACEFUL_*`` variables that are not options: graceful's own (the demo's process
#: names, click's shell completion) and the test suite's.
OTHER_VARIABLES: Final = frozenset({
    "GRACEFUL_DEMO_NAME", "_GRACEFUL_COMPLETE", "GRACEFUL_REQUIRE_KUBERNETES",
    "GRACEFUL_ROLLOUT_RESULTS",
})  # fmt: skip


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``GRACEFUL_*`` variable that is no option, naming the closest
    option's variable when there is one (``GRACEFUL_IDEL``: ``GRACEFUL_IDLE``)."""
    import difflib

    environ = os.environ if environ is None else environ
    known = {o.env for o in OPTIONS}
    suffixes = [o.name.upper() for o in OPTIONS]  # compared without the common prefix
    warnings = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name in OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(name[len(ENV_PREFIX) :], suffixes, n=1, cutoff=0.6)
        hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else " (see graceful run --help)"
        warnings.append(f"{name} is not a graceful option and is ignored{hint}")
    return warnings


def metrics_workers_warning(
    values: Values, workers: int, environ: Mapping[str, str] | None = None
) -> str | None:
    """The warning for a metrics endpoint served by several processes without
    ``prometheus_client``'s multiprocess mode: each scrape reaches one of them."""
    environ = os.environ if environ is None else environ
    if values["metrics_path"] is None or workers < 2 or environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    return (
        f"{values.label('metrics_path')} with {workers} workers and no PROMETHEUS_MULTIPROC_DIR: "
        "each scrape answers with one worker's numbers; set PROMETHEUS_MULTIPROC_DIR to an "
        "empty directory for all of them (see the metrics docs)"
    )


def resolve(
    given: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    overrides: Mapping[str, tuple[object, str]] | None = None,
    ignore: Collection[str] = (),
    given_as: Mapping[str, str] | None = None,
    fallback_env: Mapping[str, str] | None = None,
    unset_labels: Mapping[str, str] | None = None,
) -> Values:
    """Parse and check every option: command line first, then environment, then default.

    Args:
        given: Option name to text, from the command line.
        environ: The environment (default: ``os.environ``).
        overrides: Option name to ``(value, label)`` set by the host, winning over both
            (gunicorn's ``--graceful-timeout`` is the grace period).
        ignore: Options not read from the environment (settings the host owns).
        given_as: Option name to the label of a given option that was set under another
            name (uvicorn's ``--timeout-graceful-shutdown`` for ``--drain-timeout``).
        fallback_env: Option name to a variable read when ``GRACEFUL_*`` is not set
            (``UVICORN_PORT`` for ``graceful run``).
        unset_labels: Option name to how messages name it when it was not set (the
            Python API's names; default: the flag).

    Raises:
        ConfigError: one line, naming the option as it was set.
    """
    given = given or {}
    given_as = given_as or {}
    fallback_env = fallback_env or {}
    environ = os.environ if environ is None else environ
    overrides = overrides or {}
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for opt in OPTIONS:
        fallback = fallback_env.get(opt.name)
        if opt.name in overrides:
            values[opt.name], labels[opt.name] = overrides[opt.name]
            continue
        if opt.name in given:
            text, label = given[opt.name], given_as.get(opt.name, opt.flag)
        elif opt.env in environ and opt.name not in ignore:
            text, label = environ[opt.env], opt.env
        elif fallback is not None and fallback in environ and opt.name not in ignore:
            text, label = environ[fallback], fallback
        else:
            values[opt.name] = opt.default
            continue
        text = text.strip()
        if not text:
            raise ConfigError(f"{label}: must not be empty (default: {help_default(opt)})")
        try:
            values[opt.name] = opt.parse(text)
        except ValueError as exc:
            raise ConfigError(f"{label}: {exc}") from None
        labels[opt.name] = label
    result = Values(values, labels, unset_labels)
    check(result)
    return result


def from_environment(environ: Mapping[str, str] | None = None, **overrides: object) -> Values:
    """Checked values from ``GRACEFUL_*`` variables; ``overrides`` (by option name) win.

    Raises:
        ConfigError: naming the variable and what is allowed.
    """
    return resolve(
        environ=environ, overrides={k: (v, f"{k}={_show(v)}") for k, v in overrides.items()}
    )


# ------------------------------------------------------------ the Python API's options
#
# The servers' run functions (``graceful.uvicorn.run``, ``graceful.hypercorn.run``,
# ``graceful.aiohttp.run_app``) take graceful's options as keyword arguments, by their
# Python names (``Option.python``: ``grace_period_s`` for ``--grace-period``), and check
# them with the command line's parsers and ``check``.  The server's own settings (host,
# port, log level, …) keep the server's names and go to the server.

#: The targets whose options the run functions take by their Python names; of the
#: ``run`` target only ``PYTHON_RUN_OPTIONS`` (the others are ``graceful run``'s own).
PYTHON_TARGETS: Final = ("policy", "coordinator", "middleware")
PYTHON_RUN_OPTIONS: Final = ("kubernetes", "wait_for_endpoints")


def python_options() -> tuple[Option, ...]:
    """The options the run functions take, by ``Option.python``."""
    return tuple(o for o in OPTIONS if o.target in PYTHON_TARGETS or o.name in PYTHON_RUN_OPTIONS)


def split_python(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` as graceful's options (by Python name) and the rest (the server's)."""
    names = {o.python for o in python_options()}
    ours = {k: v for k, v in kwargs.items() if k in names}
    return ours, {k: v for k, v in kwargs.items() if k not in names}


def unexpected_keyword(caller: str, name: str, known: Collection[str]) -> TypeError:
    """The error for an unknown keyword argument of ``caller``, with the closest
    known one (an option's command-line name, ``grace_period``, points at its Python
    name, ``grace_period_s``)."""
    import difflib

    aliases = {o.name: o.python for o in python_options() if o.name != o.python}
    hint = aliases.get(name.replace("-", "_"))
    if hint is None:
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        hint = close[0] if close else None
    return TypeError(
        f"{caller}() got an unexpected keyword argument {name!r}"
        + (f" (did you mean {hint}?)" if hint else "")
    )


def _python_value(opt: Option, value: object) -> object:
    """``value`` of ``opt`` given in Python, checked by the option's own parser."""
    name = opt.python
    if opt.parse is boolean:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
        return value
    if opt.parse is seconds or opt.parse.__name__ == "integer":
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if opt.parse is not seconds and not isinstance(value, int):
            number = False
        text = repr(value) if number else "\x00"  # a text no parser accepts: the reason
        try:
            parsed = opt.parse(text)
        except ValueError as exc:
            reason = re.sub(r", got .*$", "", " ".join(str(exc).split()))
            error = ValueError if number else TypeError
            raise error(f"{name} {reason}, got {type(value).__name__} {value!r}") from None
        return parsed
    if value is None and opt.parse is endpoint_path:
        return None
    if not isinstance(value, str):
        what = "a str or None" if opt.parse is endpoint_path else "a str"
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    try:
        return opt.parse(value.strip())
    except ValueError as exc:
        reason = " ".join(str(exc).split())
        raise ValueError(
            f"{name} {reason}" if reason.startswith("must ") else f"{name}: {reason}"
        ) from None


def python_setup(
    caller: str,
    options: Mapping[str, Any],
    *,
    coordinator: object = None,
    policy: object = None,
    **coordinator_overrides: Any,
) -> tuple[ShutdownCoordinator, dict[str, Any]]:
    """The coordinator and the middleware's keyword arguments of a run function, from
    graceful's options given by their Python names (``options``, see ``split_python``),
    checked as the command line's are.

    Args:
        caller: The function, for messages (``"graceful.uvicorn.run"``).
        options: graceful's options by Python name.
        coordinator: The caller's coordinator, if given (then options that would
            configure a new one are an error).
        policy: A ``Policy``, or a policy's name (``--policy``'s values), or ``None``.
        coordinator_overrides: Coordinator arguments that are not options.

    Raises:
        TypeError: a value of the wrong type, naming the keyword, the value and what is
            allowed.
        ValueError: a bad value or combination (a ``ConfigError``), likewise.
    """
    from ._core.coordinator import _check_coordinator

    by_python = {o.python: o for o in python_options()}
    # None is "not set" for the options whose default is None (a policy's own default,
    # no grace period); for an endpoint it is "no endpoint", a value.
    options = {
        k: v
        for k, v in options.items()
        if v is not None or by_python[k].default is not None or by_python[k].parse is endpoint_path
    }
    instance: Policy | None = None
    if coordinator is not None:
        _check_coordinator(coordinator)
        if policy is not None:
            raise ValueError(f"{caller}: pass either coordinator= or policy=, not both")
    if isinstance(policy, Policy):
        instance = policy
    elif isinstance(policy, str):
        options["policy"] = policy
    elif policy is not None:
        raise TypeError(
            "policy must be a graceful Policy instance (graceful.AcceptUntilIdle(), …), a "
            f"policy's name ({', '.join(sorted(POLICIES))}) or None, got "
            f"{type(policy).__name__} {policy!r}"
        )
    for name, value in options.items():
        opt = by_python[name]
        if coordinator is not None and opt.target != "middleware":
            raise ValueError(
                f"{caller}: {name}={value!r} configures the coordinator {caller} would "
                f"create; with coordinator= given, set it on that coordinator "
                "(graceful.ShutdownCoordinator, graceful.policy_from_name)"
            )
        if instance is not None and opt.target == "policy":
            raise ValueError(
                f"{caller}: {name}={value!r} applies to a policy given by name "
                f"(policy={instance.name!r}); with a Policy instance, set it on the policy"
            )
    overrides = {
        by_python[name].name: (_python_value(by_python[name], value), name)
        for name, value in options.items()
    }
    values = resolve(
        environ={}, overrides=overrides, unset_labels={o.name: o.python for o in OPTIONS}
    )
    middleware = {
        o.keyword: values[o.name]
        for o in OPTIONS
        if o.target == "middleware" and o.name in overrides
    }
    if isinstance(coordinator, ShutdownCoordinator):
        return coordinator, middleware
    if instance is not None:
        coordinator_overrides["policy"] = instance
    return build_coordinator(values, **coordinator_overrides), middleware


# --------------------------------------------------------------------- the targets


def _kwargs(values: Values, target: Target) -> dict[str, Any]:
    return {o.keyword: values[o.name] for o in OPTIONS if o.target == target}


def policy_kwargs(values: Values) -> dict[str, Any]:
    """Keyword arguments of ``graceful.policy_from_name``, unset ones left out."""
    kwargs = _kwargs(values, "policy")
    return {k: v for k, v in kwargs.items() if v is not None}


def _policy(values: Values) -> Policy:
    kwargs = policy_kwargs(values)
    if _waits_for_endpoints(values):
        kwargs["wait_for_endpoint_removal"] = True
    return policy_from_name(**kwargs)


def _waits_for_endpoints(values: Values) -> bool:
    """``--kubernetes`` with accept-until-idle waits for endpoint removal unless told not to."""
    return bool(
        values["kubernetes"]
        and values["wait_for_endpoints"]
        and values["policy"] == AcceptUntilIdle.name
    )


def coordinator_kwargs(values: Values, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of ``graceful.ShutdownCoordinator``, policy included."""
    return {"policy": _policy(values), **_kwargs(values, "coordinator"), **overrides}


def build_coordinator(values: Values, **overrides: Any) -> ShutdownCoordinator:
    """The coordinator of ``values``, with the Kubernetes integration attached when
    ``--kubernetes`` is on; ``overrides`` are coordinator arguments that are not options
    (``hard_exit``, …).

    Raises:
        ConfigError: as ``check`` (for values that were not checked).
    """
    with _named(values):
        coordinator = ShutdownCoordinator(**coordinator_kwargs(values, **overrides))
    if values["kubernetes"]:
        from .kubernetes import Kubernetes

        Kubernetes().attach(coordinator)
    return coordinator


def middleware_kwargs(values: Values) -> dict[str, Any]:
    """Keyword arguments of ``graceful.asgi.GracefulMiddleware`` (and so of
    ``graceful.uvicorn.Server``)."""
    return _kwargs(values, "middleware")


def uvicorn_kwargs(values: Values) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config``."""
    return _kwargs(values, "uvicorn")


# ------------------------------------------------------------------------- checking


@contextlib.contextmanager
def _named(values: Values) -> Iterator[None]:
    """Turn a constructor's ValueError or TypeError into a ``ConfigError`` whose
    message names options (``--idle``, ``GRACEFUL_IDLE``) instead of keyword arguments
    (``idle_s``)."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        message = " ".join(str(exc).split())
        for opt in sorted(OPTIONS, key=lambda o: -len(o.keyword)):
            if opt.target in ("policy", "coordinator", "middleware") and "_" in opt.keyword:
                label = values.label(opt.name)
                message = re.sub(rf"\b{re.escape(opt.keyword)}\b", label, message)
        raise ConfigError(message) from None


def check(values: Values) -> None:
    """Check the options together: build the policy, the coordinator and the middleware
    once (so that whatever they check is checked now) and compare options.

    Raises:
        ConfigError: naming the options involved.
    """
    label = values.label
    grace, margin = values["grace_period"], values["kill_margin"]
    if grace is not None and not grace > 2 * margin:
        raise ConfigError(
            f"{label('grace_period')} ({_show(grace)} s) must be greater than twice "
            f"{label('kill_margin')} ({_show(margin)} s): the process is out the kill margin "
            "before SIGKILL, and stopping begins the kill margin before that"
        )
    server = values["server"]
    for opt in OPTIONS:
        if values.given(opt.name) and server not in opt.servers:
            raise ConfigError(
                f"{label(opt.name)} is not taken by {label('server')} {server} "
                f"(only by {', '.join(opt.servers)})"
            )
    loop = values["loop"]
    if loop == "trio" and server != "hypercorn":
        raise ConfigError(
            f"{label('loop')} trio needs --server hypercorn ({label('server')} {server} "
            "runs on asyncio or uvloop)"
        )
    if server != "uvicorn" and loop not in SERVER_LOOPS[server]:
        raise ConfigError(
            f"{label('loop')} {loop} is not taken by {label('server')} {server} "
            f"(it takes {', '.join(SERVER_LOOPS[server])})"
        )
    paths: dict[str, str] = {}
    for opt in OPTIONS:
        if opt.parse is endpoint_path and values[opt.name] is not None:
            other = paths.setdefault(values[opt.name], opt.name)
            if other != opt.name:
                raise ConfigError(
                    f"{label(other)} and {label(opt.name)} are both {values[opt.name]!r}: "
                    "each endpoint needs its own path"
                )
    from .asgi import GracefulMiddleware

    async def no_app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
        pass

    if values["kubernetes"]:
        try:
            import lightkube  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"{label('kubernetes')} needs lightkube: pip install 'graceful-drain[kubernetes]'"
            ) from None
    elif values.given("wait_for_endpoints"):
        on = label("kubernetes")
        raise ConfigError(
            f"{label('wait_for_endpoints')} applies only with "
            + (f"{on} (or {option('kubernetes').env}=1)" if on.startswith("--") else f"{on}=True")
        )
    if values["metrics_path"] is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"{label('metrics_path')} needs prometheus-client: "
                "pip install 'graceful-drain[metrics]'"
            ) from None
    with _named(values):
        coordinator = ShutdownCoordinator(**coordinator_kwargs(values))
        # Without the metrics endpoint: it would register this throwaway coordinator's
        # metrics in the process's default registry.
        options = {**middleware_kwargs(values), "metrics_path": None}
        GracefulMiddleware(no_app, coordinator=coordinator, **options)


#: Settings gunicorn owns: their GRACEFUL_* variables are ignored under gunicorn.
_GUNICORN_OWNS = frozenset(o.name for o in OPTIONS if o.gunicorn is not None)


#: Under gunicorn the default kill margin is at most this fraction of
#: ``--graceful-timeout`` (0.2 s of 2 s).
SHORT_TIMEOUT_MARGIN_DIVISOR: Final = 10


def gunicorn_values(
    graceful_timeout: float,
    environ: Mapping[str, str] | None = None,
    warn: Callable[[str], object] | None = None,
    workers: int | None = None,
) -> Values:
    """The options of a gunicorn worker (uvicorn, hypercorn, aiohttp): ``GRACEFUL_*``,
    with gunicorn's ``graceful_timeout`` as the grace period; the default kill margin is
    at most a tenth of it (with a warning when the timeout is not above twice it); the
    variables of settings gunicorn owns are ignored, with a warning, as are unknown
    ``GRACEFUL_*`` variables; with ``workers`` (gunicorn's ``--workers``) a metrics
    endpoint without multiprocess mode is warned of.

    Raises:
        ConfigError: one line naming the variable or ``--graceful-timeout``.
    """
    environ = os.environ if environ is None else environ
    grace = float(graceful_timeout)
    if grace <= 0:
        raise ConfigError(
            f"--graceful-timeout {graceful_timeout} leaves no time to drain; "
            "graceful workers need a positive one"
        )
    overrides: dict[str, tuple[object, str]] = {"grace_period": (grace, "--graceful-timeout")}
    margin = option("kill_margin")
    # The margin scales with a short timeout: at most a tenth of it (stock gunicorn
    # serves a request until the SIGKILL; a fixed second would cut what it completes).
    short = grace / SHORT_TIMEOUT_MARGIN_DIVISOR
    if margin.env not in environ and short < margin.default:
        overrides["kill_margin"] = (short, "the kill margin")
        if warn is not None and grace <= 2 * margin.default:
            warn(
                f"graceful: --graceful-timeout {grace:g} leaves no room for the default kill "
                f"margin ({margin.default:g} s): the kill margin is {short:g} s (set "
                f"{margin.env} to choose)"
            )
    if warn is not None:
        for opt in OPTIONS:
            if opt.name in _GUNICORN_OWNS and opt.env in environ:
                warn(f"graceful: {opt.env} is ignored under gunicorn (use {opt.gunicorn})")
        for text in unknown_variables(environ):
            warn(f"graceful: {text}")
    values = resolve(environ=environ, overrides=overrides, ignore=_GUNICORN_OWNS)
    if warn is not None and workers is not None:
        metrics = metrics_workers_warning(values, workers, environ)
        if metrics is not None:
            warn(f"graceful: {metrics}")
    return values
