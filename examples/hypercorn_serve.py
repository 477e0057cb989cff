"""graceful.hypercorn.serve: hypercorn in an event loop the program already runs.

python -m examples.hypercorn_serve --port 8000
"""

from __future__ import annotations

import argparse
import asyncio

from hypercorn.config import Config

import graceful
import graceful.hypercorn
from examples.asgi_app import app


async def main(port: int) -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    coordinator = graceful.ShutdownCoordinator(policy=graceful.AcceptUntilIdle(idle_s=1))
    # --8<-- [start:serve]
    await graceful.hypercorn.serve(app, config, coordinator=coordinator)
    # --8<-- [end:serve]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    asyncio.run(main(parser.parse_args().port))
