"""graceful.aiohttp.AppRunner: a program with its own runner and sites.

python -m examples.aiohttp_runner --port 8080
"""

from __future__ import annotations

import argparse

import anyio
from aiohttp import web

import graceful
import graceful.aiohttp
from examples.aiohttp_app import make_app

app = make_app()


# --8<-- [start:main]
async def main(port: int) -> None:
    coordinator = graceful.ShutdownCoordinator(grace_period_s=30)
    runner = graceful.aiohttp.AppRunner(app, coordinator=coordinator)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runner.adopt_sites()  # count connections from accept() right away
        async with anyio.create_task_group() as tg:
            await tg.start(coordinator.run)  # signal handlers are in place from here
            print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
            ...  # your other tasks; returns once the coordinator stopped
    finally:
        await runner.cleanup()  # quick: everything was done while stopping


# --8<-- [end:main]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    anyio.run(main, parser.parse_args().port)
