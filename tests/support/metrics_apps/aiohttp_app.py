"""The aiohttp test app served by ``graceful.aiohttp.run_app(metrics_path="/metrics")``.

python -m tests.support.metrics_apps.aiohttp_app --port 0
"""

from __future__ import annotations

import argparse
import logging
import sys

import graceful
import graceful.aiohttp
from tests.support.aiohttp_apps.app import make_app


def main() -> int:
    parser = argparse.ArgumentParser(prog="aiohttp metrics test app")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )
    coordinator = graceful.ShutdownCoordinator(
        policy=graceful.AcceptUntilIdle(idle_s=1, nudge_clients=False), grace_period_s=20
    )
    graceful.aiohttp.run_app(
        make_app(), coordinator=coordinator, host="127.0.0.1", port=args.port,
        metrics_path="/metrics",
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
