"""The example app with graceful's metrics at ``/metrics``, for test_metrics.py.

    python -m tests.support.metrics_apps.app --port 0     # graceful.uvicorn.Server
    gunicorn tests.support.metrics_apps.app:app -k graceful.gunicorn.UvicornWorker

Until ``GracefulMiddleware(metrics_path=…)`` serves the endpoint itself, a small router
sends ``/metrics`` to :func:`graceful.metrics.asgi_app`.  Run by ``main`` it is given the
coordinator; under gunicorn the worker creates the coordinator, so the router finds it in
the request's scope (the middleware's drain signal) at the first scrape.  Responses say
which process answered (``x-worker-pid``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import graceful
import graceful.asgi
import graceful.metrics
from examples.asgi_app import app as example_app


class Router:
    def __init__(self, coordinator: graceful.ShutdownCoordinator | None = None) -> None:
        self.coordinator = coordinator
        self.metrics: Any = None if coordinator is None else graceful.metrics.asgi_app(coordinator)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/metrics":
            await example_app(scope, receive, send)
            return
        if self.metrics is None:
            signal = graceful.asgi.drain_signal(scope)
            assert signal is not None, "not behind GracefulMiddleware"
            self.metrics = graceful.metrics.asgi_app(signal.coordinator)

        async def send_with_pid(message: Any) -> None:
            if message["type"] == "http.response.start":
                pid = str(os.getpid()).encode()
                message = {**message, "headers": [*message["headers"], (b"x-worker-pid", pid)]}
            await send(message)

        await self.metrics(scope, receive, send_with_pid)


app = Router()  # for gunicorn


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    import graceful.uvicorn

    parser = argparse.ArgumentParser(prog="metrics test app")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--idle", type=float, default=1.0)
    parser.add_argument("--grace-period", type=float, default=20.0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )
    coordinator = graceful.ShutdownCoordinator(
        # No nudge while accepting: the scraping client keeps its connection.
        policy=graceful.AcceptUntilIdle(idle_s=args.idle, nudge_clients=False),
        grace_period_s=args.grace_period,
    )
    config = uvicorn.Config(Router(coordinator), host="127.0.0.1", port=args.port)
    # A long idle grace: connections opened while accepting can still scrape when draining.
    graceful.uvicorn.Server(config, coordinator=coordinator, idle_grace_s=10).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
