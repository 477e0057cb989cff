"""The table: every ``graceful run`` option, declared once as an ``Option`` in ``OPTIONS``.

An entry says everything the rest of graceful needs about a setting: its name (which
gives both the flag and the variable), its parser (``_parse``), its default, a line of
help and *where the value goes* (``to``): the policy, the coordinator, the middleware,
uvicorn's ``Config`` or ``graceful run`` itself.  The argument parser, the environment
reader, the gunicorn workers, the Python API's keyword arguments, ``--help`` and
``docs/configuration.md`` (``tools/gen_configuration.py``) are all derived from it, so
adding an option is adding one entry here.

``help_default`` is the default as ``--help`` and the configuration page show it.  For a
policy option the table's default is ``None`` ("the chosen policy's own"), which would
print as "none" where the policy really waits 2 s; so the real defaults are read from the
policies' own dataclass fields, and only from the policies that accept the option from
the command line (``policy_from_name`` refuses the others).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Final, Literal

from typing_extensions import final

from .._core.deadlines import DEFAULT_GRACE_PERIOD_S
from .._core.policy import POLICIES, policy_from_name
from ._parse import (
    boolean,
    choice,
    endpoint_path,
    host,
    integer,
    policy_name,
    seconds,
    uvicorn_choice,
)

__all__ = (
    "ENV_PREFIX",
    "OPTIONS",
    "SERVERS",
    "SERVER_LOOPS",
    "Option",
    "Target",
    "help_default",
    "option",
)

#: Prefix of the environment variables: ``--drain-timeout`` is ``GRACEFUL_DRAIN_TIMEOUT``.
ENV_PREFIX: Final = "GRACEFUL_"

Target = Literal["run", "uvicorn", "policy", "coordinator", "middleware"]

#: The servers ``graceful run --server`` runs.
SERVERS: Final = ("uvicorn", "hypercorn", "aiohttp", "granian")
#: The ``--loop`` values of the servers other than uvicorn (which takes uvicorn's own).
SERVER_LOOPS: Final = {
    "hypercorn": ("auto", "asyncio", "uvloop", "trio"),
    "aiohttp": ("auto", "asyncio", "uvloop"),
    "granian": ("auto", "asyncio", "uvloop"),
}


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
        "readiness_failures", integer(0, 1000, "a number of failed health checks"), None,
        to=("policy", "readiness_failures"), metavar="COUNT",
        help="accept-until-idle: start the idle window only once each health checker that "
        "probed readiness before SIGTERM has been answered COUNT 503s (what it needs to mark "
        "the process down: HAProxy's fall, a cloud balancer's unhealthy threshold) or "
        "has gone quiet; with --kubernetes the pod's readinessProbe says it for the "
        "kubelet; 0: do not wait for health checkers",
        default_text="3",
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
        "management_port", integer(0, 65535, "a port number"), None,
        to=("middleware", "management_port"), metavar="PORT",
        help="serve readiness, liveness, preStop and metrics on this port, not the app's "
        "(a port the Service and the ingress do not expose; 0: any free port)",
        servers=("uvicorn", "hypercorn", "aiohttp", "granian"),
    ),
    Option(
        "management_host", host, None, to=("middleware", "management_host"), metavar="HOST",
        help="the management listener's address (default: --host)",
        servers=("uvicorn", "hypercorn", "aiohttp", "granian"),
    ),
    Option(
        "health_on_app_port", boolean, False, to=("middleware", "health_on_app_port"),
        metavar="BOOL", switch=True,
        help="with --management-port: answer the health and metrics paths on the app's port "
        "too (by default they are the app's own routes there)",
        servers=("uvicorn", "hypercorn", "aiohttp", "granian"),
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
        gunicorn="--keep-alive", servers=("uvicorn", "hypercorn", "aiohttp"),
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
        "with aiohttp and granian",
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
