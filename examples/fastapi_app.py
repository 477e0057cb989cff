"""A FastAPI app with graceful-drain wired in by hand: middleware plus server.

    python -m examples.fastapi_app --port 8000 --idle 2

Routes: ``/`` answers ``{"hello": "world"}``; ``/slow?s=2`` answers after 2 seconds.
At SIGTERM the server keeps accepting until no new connection arrived for ``--idle``
seconds, finishes what is in flight and exits 0.  (Under ``graceful run`` or the gunicorn
workers, leave the middleware out: they add it.)
"""

from __future__ import annotations

import argparse

import anyio
import uvicorn
from fastapi import FastAPI

import graceful
import graceful.uvicorn
from graceful.asgi import GracefulMiddleware


# --8<-- [start:app]
def create_app(coordinator: graceful.ShutdownCoordinator) -> FastAPI:
    app = FastAPI()
    app.add_middleware(GracefulMiddleware, coordinator=coordinator)

    @app.get("/")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    @app.get("/slow")
    async def slow(s: float = 1.0) -> dict[str, float]:
        print(f"slow request started ({s:g} s)", flush=True)
        await anyio.sleep(s)
        return {"slept": s}

    return app


def main(host: str, port: int, idle_s: float) -> None:
    coordinator = graceful.ShutdownCoordinator(policy=graceful.AcceptUntilIdle(idle_s=idle_s))
    config = uvicorn.Config(create_app(coordinator), host=host, port=port)
    # wrap_app=False: the app has the middleware already, with the same coordinator.
    server = graceful.uvicorn.Server(config, coordinator=coordinator, wrap_app=False)
    server.run()  # returns once drained
    # --8<-- [end:app]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--idle", type=float, default=2.0, help="the quiet period, s")
    args = parser.parse_args()
    main(args.host, args.port, args.idle)
