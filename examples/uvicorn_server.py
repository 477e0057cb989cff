"""graceful.uvicorn.Server: a uvicorn.Server that follows the coordinator's phases.

python -m examples.uvicorn_server --port 8000
"""

from __future__ import annotations

import argparse

import uvicorn

import graceful
import graceful.uvicorn


def main(port: int) -> None:
    # --8<-- [start:server]
    server = graceful.uvicorn.Server(
        uvicorn.Config("examples.asgi_app:app", host="127.0.0.1", port=port, http="httptools"),
        coordinator=graceful.ShutdownCoordinator(grace_period_s=30),
        prestop_path="/prestop",
    )
    server.run()
    # --8<-- [end:server]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    main(parser.parse_args().port)
