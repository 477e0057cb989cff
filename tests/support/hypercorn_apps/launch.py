"""Start hypercorn for the integration tests: ``python tests/support/hypercorn_apps/launch.py``.

Graceful (default): :func:`graceful.hypercorn.run` with a coordinator that owns the
process, like ``graceful run`` builds it; ``--stock``: hypercorn's own ``serve`` on the
same app, for comparison.  hypercorn logs ``Running on http://127.0.0.1:PORT`` once it
listens; the tests wait for that line.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--app", default="examples.asgi_app:app")
    parser.add_argument("--worker", choices=("asyncio", "uvloop", "trio"), default="asyncio")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--stock", action="store_true", help="stock hypercorn, for comparison")
    parser.add_argument("--policy", default="accept-until-idle")
    parser.add_argument("--idle", type=float, default=None)
    parser.add_argument("--max-wait", type=float, default=None)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--grace-period", type=float, default=None)
    parser.add_argument("--websocket-close-grace", type=float, default=1.0)
    parser.add_argument("--prestop-path", default=None)
    parser.add_argument("--backlog", type=int, default=None)
    parser.add_argument("--access-log", action="store_true")
    args = parser.parse_args()

    sys.path.insert(0, os.getcwd())
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{args.port}"]
    config.errorlog = logging.getLogger("hypercorn.error")  # through basicConfig's handler
    if args.access_log:
        config.accesslog = "-"
    if args.backlog is not None:
        config.backlog = args.backlog

    if args.stock:
        import importlib

        import anyio
        from hypercorn.asyncio import serve as asyncio_serve
        from hypercorn.trio import serve as trio_serve

        module, _, name = args.app.partition(":")
        app = getattr(importlib.import_module(module), name)
        if args.worker == "trio":
            anyio.run(trio_serve, app, config, backend="trio")
        else:
            anyio.run(
                asyncio_serve,
                app,
                config,
                backend="asyncio",
                backend_options={"use_uvloop": args.worker == "uvloop"},
            )
        return

    import graceful.hypercorn
    from graceful import ShutdownCoordinator, policy_from_name

    coordinator = ShutdownCoordinator(
        policy=policy_from_name(args.policy, idle_s=args.idle, max_wait_s=args.max_wait),
        drain_timeout_s=args.drain_timeout,
        grace_period_s=args.grace_period,
        exit_on_third_request=True,  # the process is ours
        hard_exit=True,
    )
    # The process is ours: a late signal after the handlers were restored must not kill
    # the exiting process with a signal status (as ``graceful run`` does).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    graceful.hypercorn.run(
        args.app,
        config,
        worker_class=args.worker,
        coordinator=coordinator,
        websocket_close_grace_s=args.websocket_close_grace,
        prestop_path=args.prestop_path,
    )


if __name__ == "__main__":
    main()
