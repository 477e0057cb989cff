"""Clients arriving while the drain starts: slow senders and 500 concurrent clients.

Clients run in one event loop in the test process (raw non-blocking sockets).  Every
request ends ``ok``, ``refused`` (the connect was refused: nothing sent, retry-safe) or
``lost`` (sent, no response: a reset, an EOF or no answer in time); losses must be 0.
Every loop is bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest

from tests.support.harness import (
    AsyncClients,
    Harness,
    handled,
    request_bytes,
    summarize,
)


def test_connect_wait_send_across_the_drain(
    harness: Harness, record: Callable[[str], None]
) -> None:
    """refuse-immediately: 80 clients connect 4 ms apart, each waits 50-200 ms before
    sending; SIGTERM after the 20th connect: each is refused or answered, never reset"""
    server = harness.graceful("--policy", "refuse-immediately", "--grace-period", "10")
    clients = AsyncClients(server.port)
    connected = 0
    signalled = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal connected
        await asyncio.sleep(i * 0.004)
        sock = await clients.connect(f"c{i}")
        if sock is None:
            return
        try:
            connected += 1
            if connected == 20:
                os.kill(server.proc.pid, signal.SIGTERM)
                signalled.set()
            await asyncio.sleep(0.05 + (i * 37 % 151) / 1000)  # the scenario: 50-200 ms
            await clients.exchange(sock, request_bytes("/", f"c{i}"), f"c{i}", 10, [b""])
        finally:
            sock.close()

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(80))), 30)

    asyncio.run(main())
    code = server.wait_exit(15)
    results = clients.results
    record(f"{summarize(results)}; exit {code}")
    assert signalled.is_set()
    assert [r for r in results if r.kind == "lost"] == []
    assert all(r.status == 200 for r in results if r.kind == "ok")
    assert set(handled(server)) == {r.rid for r in results if r.kind == "ok"}
    assert code == 0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_500_concurrent_clients_at_sigterm(
    harness: Harness, record: Callable[[str], None], loop: str
) -> None:
    """500 clients (250 keep-alive, 250 fresh-connection) running at SIGTERM,
    accept-until-idle: no loss; clients stop when refused, at 15 requests or 8 s"""
    server = harness.graceful(
        "--policy", "accept-until-idle", "--idle", "0.3", "--max-wait", "1",
        "--grace-period", "10", "--loop", loop,
        "--timeout-keep-alive", "30",  # no idle timeout while 500 clients start up
    )  # fmt: skip
    clients = AsyncClients(server.port)
    per_client = 15
    first_done = 0
    everyone_started = asyncio.Event()
    stop_at = time.monotonic() + 30

    def started_one() -> None:
        nonlocal first_done
        first_done += 1
        if first_done == 500:
            everyone_started.set()

    async def keep_alive(i: int) -> None:
        sock: object = None
        buffer = [b""]
        try:
            for n in range(per_client):
                if time.monotonic() > stop_at:
                    return
                if sock is None:
                    sock = await clients.connect(f"k{i}.{n}")
                    buffer = [b""]
                    if sock is None:
                        return
                rid = f"k{i}.{n}"
                response = await clients.exchange(sock, request_bytes("/", rid), rid, 10, buffer)  # type: ignore[arg-type]
                if n == 0:
                    started_one()
                    await everyone_started.wait()
                if response is None:
                    return
                if response.headers.get("connection", "").lower() == "close":
                    sock.close()  # type: ignore[attr-defined]
                    sock = None
        finally:
            if sock is not None:
                sock.close()  # type: ignore[attr-defined]

    async def fresh(i: int) -> None:
        for n in range(per_client):
            if time.monotonic() > stop_at:
                return
            rid = f"f{i}.{n}"
            sock = await clients.connect(rid)
            if sock is None:
                return
            try:
                response = await clients.exchange(sock, request_bytes("/", rid), rid, 10, [b""])
            finally:
                sock.close()
            if n == 0:
                started_one()
                await everyone_started.wait()
            if response is None:
                return

    async def main() -> None:
        nonlocal stop_at
        tasks = [asyncio.ensure_future(keep_alive(i)) for i in range(250)]
        tasks += [asyncio.ensure_future(fresh(i)) for i in range(250)]
        try:
            await asyncio.wait_for(everyone_started.wait(), 30)
            stop_at = time.monotonic() + 8
            os.kill(server.proc.pid, signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*tasks), 20)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    began = time.monotonic()
    asyncio.run(main())
    code = server.wait_exit(15)
    took = time.monotonic() - began
    results = clients.results
    record(f"{len(results)} requests: {summarize(results)}; exit {code}, {took:.1f} s in all")
    assert [r for r in results if r.kind == "lost"] == []
    assert all(r.status == 200 for r in results if r.kind == "ok")
    assert set(handled(server)) == {r.rid for r in results if r.kind == "ok"}
    assert code == 0
