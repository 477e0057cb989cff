"""graceful.aiohttp.run_app: aiohttp's web.run_app with a shutdown policy.

python -m examples.aiohttp_run_app --port 8080
"""

from __future__ import annotations

import argparse

import graceful.aiohttp
from examples.aiohttp_app import make_app


def main(port: int) -> None:
    # --8<-- [start:run]
    app = make_app()  # a web.Application
    graceful.aiohttp.run_app(
        app,
        host="127.0.0.1",
        port=port,
        idle_s=2,  # graceful's options by their Python names: --idle 2
        grace_period_s=30,  # --grace-period 30
    )
    # --8<-- [end:run]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    main(parser.parse_args().port)
