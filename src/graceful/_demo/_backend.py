"""A demo backend: ``python -m graceful._demo._backend --server SERVER``.

``SERVER`` is ``uvicorn`` (the default), ``hypercorn``, ``aiohttp`` or ``granian``.

Why a launcher of its own
-------------------------
The demo draws when the terminating backend moved from phase to phase, so it must learn
those moments from another process.  Reading them out of the log would tie the demo to
the wording of a line written for people; ``graceful._core.events`` gives a contract
instead, and this launcher is how a backend gets it without ``graceful run`` growing an
option for the demo's sake.  It does for one process what ``graceful run`` does — a
coordinator that owns the process (a third shutdown request exits, a hard exit just
before SIGKILL), the server around the demo app, SIGTERM and SIGINT ignored until the
server installs its own handlers — with public constructors only, and subscribes
``graceful._core.events.json_event_writer`` to the pipe whose write end the demo passed
down (``--events-fd``).  The server is one of the adapters, through its public entry
point: ``graceful.uvicorn.Server``, ``graceful.hypercorn.run`` (asyncio),
``graceful.aiohttp.run_app`` (which serves ``graceful._demo.aiohttp_app``, the
same endpoints for aiohttp's handler interface) or ``graceful.granian.run`` (granian's
embedded server).  All of them share the coordinator, so the events are the same
whatever the server.

``--stock`` serves the same app with the server's own shutdown for comparison —
``hypercorn.asyncio.serve`` without a trigger (hypercorn's signal handlers) or
``aiohttp.web.run_app`` — and reports nothing: the demo marks their SIGTERM itself.
Stock uvicorn and granian backends run as plain ``python -m uvicorn`` and ``python -m
granian --interface asgi``.  Access logs are off everywhere, as with uvicorn's
``--log-level warning``: the demo measures shutdowns, not logging.

Why a pipe
----------
The demo reads each event the moment it is written, and the pipe reaches end-of-file
when the backend is gone, however it went (exit, SIGKILL): no polling, no file to clean
up.  A graceful backend leaves like ``graceful run`` does, without the interpreter's
teardown: the demo times the exit, and tens of milliseconds of module teardown are not
the policy's doing.  A stock one leaves the way its server does.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from .app import IMPORT_STRING

if TYPE_CHECKING:
    from hypercorn.config import Config

    from .. import ShutdownCoordinator

__all__ = ("SERVER_NAMES", "main")

#: The servers the launcher can run.
SERVER_NAMES = ("uvicorn", "hypercorn", "aiohttp", "granian")


def build_parser() -> argparse.ArgumentParser:
    """The launcher's few options; the rest is ``graceful run``'s defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m graceful._demo._backend",
        description="Serve the demo app with graceful shutdown, writing phase events.",
    )
    parser.add_argument("--port", type=int, required=True, help="loopback port to bind")
    parser.add_argument("--server", choices=SERVER_NAMES, default="uvicorn")
    parser.add_argument(
        "--stock",
        action="store_true",
        help="the server's own shutdown, no events (hypercorn, aiohttp)",
    )
    parser.add_argument("--policy", default="accept-until-idle", help="shutdown policy name")
    parser.add_argument("--idle", type=float, default=None, help="accept-until-idle: idle, s")
    parser.add_argument("--grace-period", type=float, default=None, help="SIGTERM to SIGKILL, s")
    parser.add_argument(
        "--events-fd", type=int, default=None, help="write phase events (JSON lines) here"
    )
    return parser


def serve(args: argparse.Namespace) -> int:
    """Serve until shut down; the exit status (3: the server never started)."""
    if args.stock:
        return _serve_stock(args)
    from .. import ShutdownCoordinator, policy_from_name
    from .._core.events import json_event_writer

    coordinator = ShutdownCoordinator(
        policy=policy_from_name(args.policy, idle_s=args.idle),
        grace_period_s=args.grace_period,
        exit_on_third_request=True,  # the process is ours
        hard_exit=True,
    )
    if args.events_fd is not None:
        events = os.fdopen(args.events_fd, "w", encoding="utf-8")
        coordinator.subscribe(json_event_writer(coordinator, events))
    # As in ``graceful run``: a late signal must not kill the exiting process with a
    # signal status once the server restored the handlers it found.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if args.server == "hypercorn":
        return _serve_hypercorn(args.port, coordinator)
    if args.server == "aiohttp":
        return _serve_aiohttp(args.port, coordinator)
    if args.server == "granian":
        return _serve_granian(args.port, coordinator)
    return _serve_uvicorn(args.port, coordinator)


def _serve_uvicorn(port: int, coordinator: ShutdownCoordinator) -> int:
    import uvicorn

    from ..uvicorn import Server

    config = uvicorn.Config(IMPORT_STRING, host="127.0.0.1", port=port, log_level="warning")
    server = Server(config, coordinator=coordinator)
    server.run()
    return 0 if server.started else 3


def _hypercorn_config(port: int) -> Config:
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    return config


def _serve_hypercorn(port: int, coordinator: ShutdownCoordinator) -> int:
    from ..hypercorn import run
    from .app import app

    run(app, _hypercorn_config(port), worker_class="asyncio", coordinator=coordinator)
    return 0


def _serve_aiohttp(port: int, coordinator: ShutdownCoordinator) -> int:
    from ..aiohttp import run_app
    from .aiohttp_app import make_app

    run_app(
        make_app(), host="127.0.0.1", port=port, coordinator=coordinator,
        access_log=None, print=None,
    )  # fmt: skip
    return 0


def _serve_granian(port: int, coordinator: ShutdownCoordinator) -> int:
    import importlib.util

    from ..granian import NotStarted, run
    from .app import app

    # uvloop where installed, as stock granian's ``--loop auto`` picks.
    uvloop = importlib.util.find_spec("uvloop") is not None
    try:
        run(
            app, port=port, loop="uvloop" if uvloop else "asyncio", coordinator=coordinator,
            granian_options={"log_level": "warning", "log_access": False},
        )  # fmt: skip
    except NotStarted:
        return 3
    return 0


def _serve_stock(args: argparse.Namespace) -> int:
    if args.server == "hypercorn":
        import asyncio

        from hypercorn.asyncio import serve as hypercorn_serve

        from .app import app

        asyncio.run(hypercorn_serve(cast(Any, app), _hypercorn_config(args.port)))  # typed loosely
        return 0
    if args.server == "aiohttp":
        from aiohttp import web

        from .aiohttp_app import make_app

        web.run_app(make_app(), host="127.0.0.1", port=args.port, access_log=None, print=None)
        return 0
    raise SystemExit(
        f"stock {args.server}: run `python -m uvicorn graceful._demo.app:app` or "
        "`python -m granian --interface asgi graceful._demo.app:app`"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Log like ``graceful run`` (phase changes at INFO on stderr) and serve."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve(args)


if __name__ == "__main__":
    import sys

    _args = sys.argv[1:]
    if "--stock" in _args:
        sys.exit(main(_args))  # a stock server leaves the way it does
    from ..__main__ import _exit

    _exit(main(_args))
