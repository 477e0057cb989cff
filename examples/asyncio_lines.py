"""A line-protocol server on raw asyncio streams, drained by graceful-drain.

    python examples/asyncio_lines.py --port 8000 --policy accept-until-idle --idle 1

One command per line: ``PING`` answers ``PONG``; ``SLEEP 2`` answers ``SLEPT 2`` after
2 seconds; anything else is echoed back.  At SIGTERM a command in progress is finished,
an idle connection gets ``BYE draining`` and is closed, and the process exits 0 once
drained.  It prints ``listening on HOST:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import anyio

import graceful
import graceful.asyncio


def answer_to(line: str) -> str | float:
    """The answer to one command, or the seconds to sleep before ``SLEPT``."""
    command, _, argument = line.strip().partition(" ")
    if command.upper() == "PING":
        return "PONG"
    if command.upper() == "SLEEP":
        return float(argument)
    return line.strip()


# --8<-- [start:server]
async def serve(host: str, port: int, policy: graceful.Policy) -> None:
    coordinator = graceful.ShutdownCoordinator(policy=policy)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # Each message after the first is awaited only until draining begins.
            async for line in server.messages(reader.readline):
                if not line:  # the client closed
                    return
                with coordinator.track_request():  # in flight: the drain waits for it
                    answer = answer_to(line.decode())
                    if isinstance(answer, float):
                        print(f"sleeping {answer:g} s", flush=True)
                        await asyncio.sleep(answer)
                        answer = f"SLEPT {answer:g}"
                    writer.write(f"{answer}\n".encode())
                    await writer.drain()
            writer.write(b"BYE draining\n")  # draining began: say so, then close
            await writer.drain()
        except (ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    server = await graceful.asyncio.start_server(handle, host, port, coordinator=coordinator)
    async with server, anyio.create_task_group() as tasks:
        await tasks.start(coordinator.run)  # signal handlers installed; returns once drained
        print("listening on {}:{}".format(*server.sockets[0].getsockname()[:2]), flush=True)
        # --8<-- [end:server]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--policy", default="accept-until-idle")
    parser.add_argument("--idle", type=float, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    policy = graceful.policy_from_name(args.policy, idle_s=args.idle)
    asyncio.run(serve(args.host, args.port, policy))
