"""The demo's load: HTTP and websocket clients that classify every request's outcome.

Why a hand-written HTTP client
------------------------------
The table the demo prints is only as honest as the classification behind it.  A
general-purpose client retries, pools and folds errors into a few exception types; this
one speaks HTTP/1.1 over plain asyncio streams so that each request ends in exactly one
of: ``ok``, ``5xx``, ``reset`` (the connection failed or ended before a complete
response) or ``timeout``.  ``refused`` is decided later, by the scenario, from what the
balancer saw (``graceful._demo._balancer`` explains why a client cannot tell).

What counts as a failure
------------------------
A request that was sent and got no complete response, whatever the reason.  What does
*not* count: finding an idle keep-alive connection closed by the server before sending
anything.  Every HTTP client notices that and reconnects, and so does this one — the
server was entitled to close it.  The race every real client loses now and then is kept
too: when the server closes the idle connection just *after* the client checked, the
request is sent into a closing socket and fails as a reset; a graceful server avoids it
by answering such a request once more, with ``Connection: close``.

Websockets follow the same rule: a round trip is a request; a close frame (1000, 1001
going away, 1012 service restart) is an orderly end after which the client reconnects
through the balancer; a connection lost without a close frame, or a failed connect, is a
failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

__all__ = ("FAILURE_KINDS", "HttpClient", "Tally", "http_client_loop", "websocket_client_loop")

#: How a request can fail, in the order the table shows them.
FAILURE_KINDS: Final = ("refused", "reset", "5xx", "timeout")


@dataclass
class Tally:
    """Every request's outcome; times in seconds from ``t0`` (``time.monotonic``)."""

    t0: float
    results: Counter[str] = field(default_factory=Counter)  # kind -> count
    served: list[tuple[float, str]] = field(default_factory=list)  # (t, backend)
    failures: list[tuple[float, str]] = field(default_factory=list)  # (t, kind)

    @property
    def requests(self) -> int:
        return sum(self.results.values())

    @property
    def failed(self) -> int:
        return sum(self.results[k] for k in FAILURE_KINDS)

    def elapsed(self) -> float:
        """Seconds since ``t0``."""
        return time.monotonic() - self.t0

    def record(self, kind: str, backend: str = "") -> None:
        """Count one request that ended as ``kind`` (``backend``: who served an ``ok``)."""
        now = self.elapsed()
        self.results[kind] += 1
        if kind == "ok":
            self.served.append((now, backend))
        else:
            self.failures.append((now, kind))

    def relabel(self, old: str, new: str, at_most: int) -> None:
        """Count up to ``at_most`` requests recorded as ``old`` as ``new`` instead."""
        moved = min(at_most, self.results[old])
        self.results[new] += moved
        self.results[old] -= moved


class HttpClient:
    """An HTTP/1.1 client over asyncio streams; one request at a time.

    Args:
        port: The balancer's loopback port.
        tally: Where each request's outcome is recorded.
        keep_alive: Reuse the connection (else one connection per request).
    """

    def __init__(self, port: int, tally: Tally, *, keep_alive: bool) -> None:
        self.port = port
        self.tally = tally
        self.keep_alive = keep_alive
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def close(self) -> None:
        if self._conn is not None:
            writer = self._conn[1]
            self._conn = None
            writer.close()
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)  # its socket closed

    async def get(self, path: str, timeout_s: float) -> None:
        """GET ``path`` and record how it ended."""
        kind, backend = await self._get(path, timeout_s)
        self.tally.record(kind, backend)

    async def _get(self, path: str, timeout_s: float) -> tuple[str, str]:
        if self._conn is not None and self._conn[0].at_eof():
            await self.close()  # the server closed our idle connection: reconnect
        try:
            if self._conn is None:
                self._conn = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.port), timeout_s
                )
            reader, writer = self._conn
            connection = b"keep-alive" if self.keep_alive else b"close"
            writer.write(b"GET %s HTTP/1.1\r\nhost: demo\r\nconnection: %s\r\n\r\n"
                         % (path.encode(), connection))  # fmt: skip
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:])
            }
            await asyncio.wait_for(
                reader.readexactly(int(headers.get("content-length", "0"))), timeout_s
            )
        except asyncio.TimeoutError:
            await self.close()
            return "timeout", ""
        except (OSError, asyncio.IncompleteReadError):
            await self.close()
            return "reset", ""
        if not self.keep_alive or headers.get("connection", "").lower() == "close":
            await self.close()
        status = int(lines[0].split()[1])
        return ("5xx" if status >= 500 else "ok"), headers.get("x-backend", "")


async def http_client_loop(
    client: HttpClient, path: str, stop: asyncio.Event, pause_s: float
) -> None:
    """GET ``path`` again and again, ``pause_s`` apart, until ``stop`` is set."""
    for _ in range(1_000_000):  # bounded; the scenario stops it
        if stop.is_set():
            break
        await client.get(path, timeout_s=30)
        if pause_s:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), pause_s)
    await client.close()


async def websocket_client_loop(port: int, tally: Tally, stop: asyncio.Event) -> None:
    """Echo a message every 20 ms until ``stop`` is set; reconnect after a close frame."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    for _ in range(100_000):  # bounded; the scenario stops it
        if stop.is_set():
            return
        try:
            ws = await asyncio.wait_for(connect(f"ws://127.0.0.1:{port}/ws"), 10)
        except (OSError, InvalidHandshake, asyncio.TimeoutError, ConnectionClosed):
            tally.record("reset")
            await asyncio.sleep(0.02)
            continue
        backend = ws.response.headers.get("x-backend", "") if ws.response else ""
        try:
            while not stop.is_set():
                await ws.send("ping")
                await asyncio.wait_for(ws.recv(), 10)
                tally.record("ok", backend)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.02)
        except ConnectionClosed as closed:
            if closed.rcvd is None:  # no close frame: the connection was cut
                tally.record("reset")
        except asyncio.TimeoutError:
            tally.record("timeout")
        finally:
            await ws.close()
