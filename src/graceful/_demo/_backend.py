"""A graceful demo backend that reports its phase changes: ``python -m graceful._demo._backend``.

Why a launcher of its own
-------------------------
The demo draws when the terminating backend moved from phase to phase, so it must learn
those moments from another process.  Reading them out of the log would tie the demo to
the wording of a line written for people; :mod:`graceful._events` gives a contract
instead, and this launcher is how a backend gets it without ``graceful run`` growing an
option for the demo's sake.  It does for one process what ``graceful run`` does — a
coordinator that owns the process (a third shutdown request exits, a hard exit just
before SIGKILL), a :class:`graceful.uvicorn.Server` around the demo app, SIGTERM and
SIGINT ignored until the server installs its own handlers — with public constructors
only, and subscribes :func:`~graceful._events.json_event_writer` to the pipe whose
write end the demo passed down (``--events-fd``).  Stock uvicorn backends run as plain
``python -m uvicorn`` and report nothing: the demo marks their SIGTERM itself.

Why a pipe
----------
The demo reads each event the moment it is written, and the pipe reaches end-of-file
when the backend is gone, however it went (exit, SIGKILL): no polling, no file to clean
up.  The process leaves like ``graceful run`` does, without the interpreter's teardown:
the demo times the exit, and tens of milliseconds of module teardown are not the
policy's doing.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Sequence

from .app import IMPORT_STRING

__all__ = ("main",)


def build_parser() -> argparse.ArgumentParser:
    """The launcher's few options; the rest is ``graceful run``'s defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m graceful._demo._backend",
        description="Serve the demo app with graceful shutdown, writing phase events.",
    )
    parser.add_argument("--port", type=int, required=True, help="loopback port to bind")
    parser.add_argument("--policy", default="accept-until-idle", help="shutdown policy name")
    parser.add_argument("--idle", type=float, default=None, help="accept-until-idle: idle, s")
    parser.add_argument("--grace-period", type=float, default=None, help="SIGTERM to SIGKILL, s")
    parser.add_argument(
        "--events-fd", type=int, default=None, help="write phase events (JSON lines) here"
    )
    return parser


def serve(args: argparse.Namespace) -> int:
    """Serve until shut down; the exit status (3: the server never started)."""
    import uvicorn

    from .. import ShutdownCoordinator, policy_from_name
    from .._events import json_event_writer
    from ..uvicorn import Server

    coordinator = ShutdownCoordinator(
        policy=policy_from_name(args.policy, idle_s=args.idle),
        grace_period_s=args.grace_period,
        exit_on_third_request=True,  # the process is ours
        hard_exit=True,
    )
    if args.events_fd is not None:
        events = os.fdopen(args.events_fd, "w", encoding="utf-8")
        coordinator.subscribe(json_event_writer(coordinator, events))
    config = uvicorn.Config(IMPORT_STRING, host="127.0.0.1", port=args.port, log_level="warning")
    server = Server(config, coordinator=coordinator)
    # As in ``graceful run``: a late signal must not kill the exiting process with a
    # signal status once the server restored the handlers it found.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    server.run()
    return 0 if server.started else 3


def main(argv: Sequence[str] | None = None) -> int:
    """Log like ``graceful run`` (phase changes at INFO on stderr) and serve."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve(args)


if __name__ == "__main__":
    from ..__main__ import _exit

    _exit(main())
