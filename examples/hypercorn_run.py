"""graceful.hypercorn.run: hypercorn on trio with a shutdown policy.

python -m examples.hypercorn_run --port 8000
"""

from __future__ import annotations

import argparse

from hypercorn.config import Config

import graceful.hypercorn


def main(port: int) -> None:
    # --8<-- [start:run]
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    graceful.hypercorn.run(
        "examples.asgi_app:app",
        config,
        worker_class="trio",  # or "asyncio" (default: config.worker_class), "uvloop"
        idle_s=2,  # graceful's options by their Python names: --idle 2
        grace_period_s=30,  # --grace-period 30
    )
    # --8<-- [end:run]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    main(parser.parse_args().port)
