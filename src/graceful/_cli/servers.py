"""Serving in one process: ``graceful run`` with one ``--server`` — uvicorn, hypercorn or
aiohttp (granian: ``graceful._cli.granian``) — alone or as a worker of a ``--workers``
parent.

Each server's body turns the parsed command line (an ``Invocation``) into that server's
own configuration, serves through graceful's adapter for it and returns the exit status.
The servers are imported inside the functions: each is an optional extra.
"""

from __future__ import annotations

import copy
import functools
import inspect
import socket
import ssl
from typing import TYPE_CHECKING, Any, Final

from .. import _options as _config
from .._core import logging as _logging
from .._options import ConfigError, Values
from .command import _DRAIN_ALIAS, EXIT_NOT_STARTED, EXIT_OK, Invocation, _uvicorn_command
from .serving import (
    _coordinator,
    _for_parent,
    _loop,
    _not_started,
    _ready_notifier,
    _worker_socket,
)

if TYPE_CHECKING:
    import hypercorn.config
    import uvicorn

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


def _configure_logging(inv: Invocation) -> None:
    """graceful's lines in the server's format (see ``graceful._core.logging``): with
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


def _serve_one(inv: Invocation) -> int:
    if inv.server == "hypercorn":
        return _serve_hypercorn(inv)
    if inv.server == "aiohttp":
        return _serve_aiohttp(inv)
    if inv.server == "granian":
        from .granian import serve_granian

        return serve_granian(inv)
    return _serve_uvicorn(inv)


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
    from ..uvicorn import build_server

    server = build_server(inv.values, config, exit_on_third_request=True, hard_exit=True)
    _for_parent(inv, server.coordinator)
    sock = _worker_socket(inv)
    try:
        server.run(sockets=None if sock is None else [sock])
    except SystemExit:
        if server.started:
            raise
        # uvicorn exits 1 when it cannot import the app: that is our status 3.
    except Exception as exc:  # the app's module raised at import
        if server.started:
            raise
        return _not_started(inv, exc)
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
    from .._core.policy import RefuseImmediately

    # uvicorn configured its logging in this process (from the pickled config) already.
    _logging.through("uvicorn", _logging.level_of(str(values["log_level"])))
    from ..uvicorn import build_server

    server = build_server(
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


def _serve_hypercorn(inv: Invocation) -> int:
    from hypercorn.config import Sockets

    from ..hypercorn import run

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
        return _not_started(inv, exc)
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

    from ..aiohttp import load_app, run_app

    values = inv.values
    try:
        app = load_app(inv.app)
    except Exception as exc:  # a missing module or attribute, or one that raised
        return _not_started(inv, exc)
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
        return _not_started(inv, exc)
    return EXIT_OK if served else EXIT_NOT_STARTED
