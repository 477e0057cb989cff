"""graceful.granian.run: granian's embedded server with a shutdown policy.

python -m examples.granian_run --port 8000
"""

from __future__ import annotations

import argparse

import graceful.granian


def main(port: int) -> None:
    # --8<-- [start:run]
    graceful.granian.run(
        "examples.asgi_app:app",
        port=port,
        loop="uvloop",  # or "asyncio" (the default)
        granian_options={"log_access": True},  # granian.server.embed.Server's own settings
        idle_s=2,  # graceful's options by their Python names: --idle 2
        grace_period_s=30,  # --grace-period 30
    )
    # --8<-- [end:run]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    main(parser.parse_args().port)
