"""The demo's load balancer: L4, round-robin, late to forget, never retrying.

Why it behaves this badly
-------------------------
It stands in for kube-proxy or an ingress during a rolling restart, and the point of the
demo is what those do to a terminating pod: the endpoint update reaches them a while
after the kubelet sent SIGTERM, so for that while they keep handing *new* connections to
the pod that was told to go.  The scenario plays that lag by removing the backend from
``Balancer.backends`` only after ``--propagation-delay``; the balancer itself just
round-robins over whatever the list holds when a connection arrives.

It works at L4 — bytes are piped, requests are never parsed — because that is what
kube-proxy does, and it is why nothing is retried: a balancer that does not know where a
request starts cannot replay it.  A backend that refuses the upstream connection leaves
the balancer holding a client connection it already accepted; it can only reset it, so
the client sees a reset where the truth is a refusal.  The balancer records each refusal
(``Balancer.refused``) so the scenario can name the failure correctly.

Stopping aborts every pipe instead of closing them politely: the load has stopped by
then, and a lingering pipe must not keep the scenario waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Protocol

__all__ = ("Balancer", "Upstream")


class Upstream(Protocol):
    """A backend as the balancer sees it: a name for the record, a loopback port."""

    @property
    def name(self) -> str: ...

    @property
    def port(self) -> int: ...


class Balancer:
    """Round-robins new connections over ``backends``; never retries.

    Args:
        t0: The scenario's start (``time.monotonic``); refusals are recorded in
            seconds from it.
    """

    def __init__(self, t0: float) -> None:
        self.backends: list[Upstream] = []
        self.refused: list[tuple[float, str]] = []  # (t, backend name)
        self.port = 0
        self._t0 = t0
        self._rr = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen on a free loopback port (then ``port``)."""
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and cut every connection still piped."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # the pipes see the reset and end
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        for task in list(self._tasks):  # one still connecting upstream after 5 s
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1)
        # Aborted transports close their sockets in the loop's next iterations: let them
        # (a loop closed first leaves the sockets to the garbage collector, unclosed).
        for _ in range(3):
            await asyncio.sleep(0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            backend = self.backends[next(self._rr) % len(self.backends)]
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend.port)
            except OSError:
                self.refused.append((time.monotonic() - self._t0, backend.name))
                writer.transport.abort()
                return
            self._writers.add(up_writer)
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                self._writers.discard(up_writer)
                up_writer.close()
        finally:
            self._writers.discard(writer)
            writer.close()
            self._tasks.discard(task)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except OSError:
        dst.transport.abort()
