"""graceful.uvicorn.run: uvicorn.run with a shutdown policy.

python -m examples.uvicorn_run --port 8000
"""

from __future__ import annotations

import argparse

import graceful
import graceful.uvicorn


def main(port: int) -> None:
    # --8<-- [start:run]
    graceful.uvicorn.run(
        "examples.asgi_app:app",
        host="127.0.0.1",
        port=port,
        policy=graceful.AcceptUntilIdle(idle_s=1, max_wait_s=20),
    )
    # --8<-- [end:run]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    main(parser.parse_args().port)
