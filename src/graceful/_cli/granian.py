"""``graceful run --server granian``: granian's embedded server, through
``graceful.granian`` (imported inside the functions: granian is an optional extra)."""

from __future__ import annotations

from typing import Any

from .. import _options as _config
from .command import EXIT_NOT_STARTED, EXIT_OK, Invocation
from .serving import _coordinator, _loop, _not_started, _ready_notifier, _worker_socket

__all__ = ("granian_options", "serve_granian")


def granian_options(inv: Invocation) -> dict[str, Any]:
    """granian's embedded-server settings of ``inv``: uvicorn's options that apply."""
    from pathlib import Path

    level = str(inv.values["log_level"]).replace("trace", "debug")
    options: dict[str, Any] = {
        "log_level": level,
        "log_access": bool(inv.option("access_log", True)),
        "factory": bool(inv.option("factory")),
    }
    if "backlog" in inv.given:
        options["backlog"] = inv.option("backlog")
    if inv.option("ssl_certfile") is not None:
        options["ssl_cert"] = Path(inv.option("ssl_certfile"))
        options["ssl_key"] = Path(inv.option("ssl_keyfile"))
        options["ssl_key_password"] = inv.option("ssl_keyfile_password")
        if inv.option("ssl_ca_certs"):
            options["ssl_ca"] = Path(inv.option("ssl_ca_certs"))
    return options


def serve_granian(inv: Invocation) -> int:
    from ..granian import NotStarted, load_app, run
    from .address import _listener

    try:
        app = load_app(inv.app)
    except Exception as exc:  # a missing module or attribute, or one that raised
        return _not_started(inv, exc)
    options = granian_options(inv)
    if options.pop("factory"):
        try:
            app = app()
        except Exception as exc:
            return _not_started(inv, exc)
    coordinator = _coordinator(inv)
    served = False

    async def started() -> None:  # the coordinator runs once granian serves
        nonlocal served
        served = True
        await _ready_notifier(inv)()

    coordinator.start_background(started)
    sock = _worker_socket(inv)
    if sock is None:
        sock = _listener(inv)  # --uds, --fd or --host/--port, as a --workers parent binds
    try:
        run(
            app,
            sock=sock,
            granian_options=options,
            loop="uvloop" if _loop(inv.values) == "uvloop" else "asyncio",
            coordinator=coordinator,
            **_config.middleware_kwargs(inv.values),
        )
    except NotStarted as exc:
        return _not_started(inv, exc)
    except Exception as exc:
        if served:
            raise
        return _not_started(inv, exc)
    return EXIT_OK if served else EXIT_NOT_STARTED
