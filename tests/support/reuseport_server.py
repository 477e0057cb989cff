"""A ``graceful.asyncio`` server on a ``SO_REUSEPORT`` socket it binds itself, refusing
new connections at SIGTERM (``python tests/support/reuseport_server.py PORT``; 0: a
free one).  ``TCP_DEFER_ACCEPT`` keeps a client that sends nothing in SYN_RECV — a
handshake under way, for as long as the caller wants.  Run by
``test_listener_seal.py`` and ``benchmarks/seal_stall.py --reuseport``."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

import anyio

import graceful
import graceful.asyncio


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(1)
    writer.close()


async def main(port: int) -> None:
    coordinator = graceful.ShutdownCoordinator(
        policy=graceful.policy_from_name("refuse-immediately"), grace_period_s=10
    )
    server = await graceful.asyncio.start_server(
        handle, "127.0.0.1", port, coordinator=coordinator, reuse_port=True
    )
    for sock in server.sockets:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 30)
    async with server, anyio.create_task_group() as tg:
        await tg.start(coordinator.run)
        print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    asyncio.run(main(int(sys.argv[1])))
