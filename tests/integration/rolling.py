"""A rolling restart in miniature, for tests: an L4 balancer and HTTP clients.

The balancer round-robins *new* connections over its backends and pipes bytes both ways.
Like kube-proxy in iptables mode, it does not retry: if the chosen backend refuses or
resets the connection, the client's connection is closed without a byte.  ``forget()``
stops routing new connections to a backend (what the EndpointSlice update does, after its
propagation delay); connections already open keep going.

Clients speak HTTP/1.1 over raw sockets and classify every outcome, so that a test can
assert on counts: a keep-alive client reconnects transparently when the server closed its
idle connection (as every HTTP client does), but a request that was sent and got no
complete response counts as a failure.
"""

from __future__ import annotations

import asyncio
import itertools
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress


class Balancer:
    """A TCP balancer on 127.0.0.1 running in its own thread and event loop."""

    def __init__(self, backends: list[int]) -> None:
        self._backends = list(backends)
        self._rr = itertools.count()
        self.routed: Counter[int] = Counter()
        self.refused = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=1024)
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.wait(pending, timeout=5))
        self._loop.run_until_complete(asyncio.sleep(0))  # let the aborts complete
        self._loop.close()

    def __enter__(self) -> Balancer:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("balancer did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def forget(self, backend: int) -> None:
        """Stop routing new connections to ``backend``."""
        self._loop.call_soon_threadsafe(self._backends.remove, backend)

    def add(self, backend: int) -> None:
        self._loop.call_soon_threadsafe(self._backends.append, backend)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await self._proxy(reader, writer)
        finally:
            self._writers.discard(writer)
            writer.close()  # flushes what is buffered; stop() aborts what is left

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backend = self._backends[next(self._rr) % len(self._backends)]
        self.routed[backend] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend)
        except OSError:
            self.refused += 1  # like a rejected DNAT: the client sees a reset
            return
        self._writers.add(up_writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                dst.transport.abort()
                return
            with suppress(OSError):
                dst.write_eof()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._writers.discard(up_writer)
            up_writer.close()


class HTTPClient:
    """A keep-alive (or fresh-connection) HTTP/1.1 client that classifies outcomes."""

    def __init__(self, port: int, *, keep_alive: bool, timeout_s: float = 10.0) -> None:
        self.port = port
        self.keep_alive = keep_alive
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buffer = b""

    def _connection(self) -> socket.socket:
        sock = self._sock
        if sock is not None:
            # The server may have closed the idle connection: reconnect, as clients do.
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                sock.close()
                sock = None
        if sock is None:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout_s)
            self._buffer = b""
        self._sock = sock
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def get(self, path: str) -> str:
        """Return ``"ok"`` or the failure kind: refused, reset, 5xx, timeout."""
        try:
            sock = self._connection()
        except ConnectionRefusedError:
            return "refused"
        except OSError:
            return "reset"
        connection = "keep-alive" if self.keep_alive else "close"
        try:
            sock.sendall(
                f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: {connection}\r\n\r\n".encode()
            )
            status, close = self._read_response(sock)
        except TimeoutError:
            self.close()
            return "timeout"
        except OSError:
            self.close()
            return "reset"
        if close or not self.keep_alive:
            self.close()
        if status >= 500:
            return "5xx"
        return "ok"

    def _read_response(self, sock: socket.socket) -> tuple[int, bool]:
        while b"\r\n\r\n" not in self._buffer:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("closed before a response")
            self._buffer += chunk
        head, _, rest = self._buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("closed mid-body")
            rest += chunk
        self._buffer = rest[length:]
        return status, headers.get("connection", "").lower() == "close"


class Load:
    """Client threads hitting the balancer until stopped; outcomes are counted."""

    def __init__(self, port: int, *, keep_alive: int = 4, fresh: int = 4) -> None:
        self.port = port
        self.outcomes: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(keep,), daemon=True)
            for keep in [True] * keep_alive + [False] * fresh
        ]

    def _client(self, keep_alive: bool) -> None:
        client = HTTPClient(self.port, keep_alive=keep_alive)
        deadline = time.monotonic() + 120  # hard bound, whatever the test does
        for _ in range(100_000):
            if self._stop.is_set() or time.monotonic() > deadline:
                break
            outcome = client.get("/")
            with self._lock:
                self.outcomes[outcome] += 1
            time.sleep(0.005)  # pacing: ~200 requests/s per client, not a wait for state
        client.close()

    def total(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())

    def failures(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in self.outcomes.items() if k != "ok"}

    def wait_for_requests(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.total() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.total()} of {n} requests in {timeout_s} s")
            time.sleep(0.01)

    @contextmanager
    def running(self) -> Iterator[Load]:
        for thread in self._threads:
            thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            for thread in self._threads:
                thread.join(15)
