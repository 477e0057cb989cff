"""Quickstart: a FastAPI app served by graceful.uvicorn.run, uvicorn.run's drop-in.

    PORT=8000 python examples/quickstart.py

At SIGTERM it keeps accepting until no new connection has arrived for 2 s, finishes
what is in flight and exits 0; /readyz answers 503 from the SIGTERM on.
"""

import os

from fastapi import FastAPI

import graceful
import graceful.uvicorn

app = FastAPI()


@app.get("/")
async def hello() -> dict[str, str]:
    return {"hello": "world"}


if __name__ == "__main__":
    graceful.uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(os.environ.get("PORT", "8000")),
        policy=graceful.AcceptUntilIdle(idle_s=2),
    )
