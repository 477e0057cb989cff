"""graceful.uvicorn.run: uvicorn.run with a shutdown policy and a kill deadline.

python -m examples.uvicorn_run --port 8000
"""

from __future__ import annotations

import argparse

import graceful.uvicorn


def main(port: int) -> None:
    # --8<-- [start:run]
    graceful.uvicorn.run(
        "examples.asgi_app:app",
        host="127.0.0.1",
        port=port,
        # graceful's options, by their Python names (graceful run --idle 1 --max-wait 20
        # --grace-period 30); the rest are uvicorn.run's own
        idle_s=1,
        max_wait_s=20,
        grace_period_s=30,
    )
    # --8<-- [end:run]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    main(parser.parse_args().port)
