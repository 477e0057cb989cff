"""A raw ASGI app whose lifespan startup leaves a task running that takes a second to
end when it is cancelled — after the coordinator stopped, while the event loop is torn
down: a window for a late signal.  Run by the library entry points:

    python -m tests.support.stock_apps.linger_app uvicorn|hypercorn

with the refuse-immediately policy and a preStop endpoint at ``/prestop``."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import graceful
import graceful.hypercorn
import graceful.uvicorn
from tests.support.lingering import linger


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


_tasks: set[asyncio.Task[None]] = set()


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                _tasks.add(asyncio.get_running_loop().create_task(linger(say)))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b"hello"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def main(server: str) -> None:
    policy = graceful.RefuseImmediately()
    if server == "uvicorn":
        say("serving with graceful.uvicorn.run")
        graceful.uvicorn.run(app, port=0, policy=policy, prestop_path="/prestop")
    else:
        import hypercorn.config

        config = hypercorn.config.Config()
        config.bind = ["127.0.0.1:0"]
        graceful.hypercorn.run(app, config, policy=policy, prestop_path="/prestop")


if __name__ == "__main__":
    main(sys.argv[1])
