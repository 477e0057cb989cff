"""A small HTTP/1.1 server on raw asyncio streams, drained by graceful-drain.

    python examples/asyncio_http.py --port 8000 --policy accept-until-idle --idle 1

Routes: ``/`` answers ``hello``; ``/slow?s=2`` answers after 2 seconds.  Keep-alive is
supported; responses carry ``Connection: close`` while the coordinator nudges clients
away.  It prints ``listening on HOST:PORT`` once it accepts connections, logs each phase
change, and exits 0 once drained.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import time
from urllib.parse import parse_qs, urlsplit

import anyio

import graceful
import graceful.asyncio

MAX_HEADER_LINES = 100


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]] | None:
    """Read the request head after its first line; ``None`` on EOF."""
    first = await reader.readline()
    if not first.strip():
        return None
    method, target, _version = first.decode("latin-1").split(" ", 2)
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    if length:
        await reader.readexactly(length)
    return method, target, headers


def make_handler(server_ref: list[graceful.asyncio.GracefulServer]):  # type: ignore[no-untyped-def]
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server = server_ref[0]
        coordinator = server.coordinator
        try:
            # Wait for the next request only while not draining: an idle keep-alive
            # connection closes when draining begins; a new connection's first request
            # (it may come from the accept backlog, after draining began) is served.
            async for request in server.messages(lambda: read_request(reader)):
                _method, target, headers = request
                with coordinator.track_request():
                    url = urlsplit(target)
                    print(f"request started: {url.path}", flush=True)
                    if url.path == "/slow":
                        seconds = float(parse_qs(url.query).get("s", ["1"])[0])
                        await asyncio.sleep(seconds)
                        body = f"slept {seconds:g}\n".encode()
                    else:
                        body = b"hello\n"
                    close = coordinator.nudging or headers.get("connection") == "close"
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                        b"content-length: %d\r\nconnection: %s\r\n\r\n%s"
                        % (len(body), b"close" if close else b"keep-alive", body)
                    )
                    await writer.drain()
                if close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    return handle


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, graceful.Policy]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--policy", default="accept-until-idle")
    parser.add_argument("--idle", type=float, default=None)
    parser.add_argument("--min-wait", type=float, default=None)
    parser.add_argument("--max-wait", type=float, default=None)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--grace-period", type=float, default=None)
    parser.add_argument(
        "--backlog-pause",
        type=float,
        default=0.0,
        help="for tests: stop the event loop for this long right after start-up, so that "
        "connections pile up in the kernel's accept backlog (a busy server, simulated)",
    )
    parser.add_argument(
        "--defer-accept",
        type=int,
        default=0,
        help="TCP_DEFER_ACCEPT (Linux, seconds): the kernel hands a connection over only "
        "once its client sent data; until then its handshake counts as under way",
    )
    args = parser.parse_args(argv)
    try:
        policy = graceful.policy_from_name(
            args.policy, idle_s=args.idle, min_wait_s=args.min_wait, max_wait_s=args.max_wait
        )
    except ValueError as exc:
        parser.error(str(exc))
    return args, policy


async def main(args: argparse.Namespace, policy: graceful.Policy) -> None:
    coordinator = graceful.ShutdownCoordinator(
        policy=policy, drain_timeout_s=args.drain_timeout, grace_period_s=args.grace_period
    )
    server_ref: list[graceful.asyncio.GracefulServer] = []
    server = await graceful.asyncio.start_server(
        make_handler(server_ref), args.host, args.port, coordinator=coordinator
    )
    server_ref.append(server)
    if args.defer_accept:
        for sock in server.sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, args.defer_accept)
    async with server, anyio.create_task_group() as tg:
        await tg.start(coordinator.run)  # returns once the signal handlers are installed
        host, port = server.sockets[0].getsockname()[:2]
        print(f"listening on {host}:{port}", flush=True)
        if args.backlog_pause:
            print("accept loop paused", flush=True)
            time.sleep(args.backlog_pause)  # noqa: ASYNC251 - blocks the loop on purpose


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    arguments, chosen = parse_args()
    try:
        asyncio.run(main(arguments, chosen))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
