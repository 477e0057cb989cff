"""graceful.asyncio on real sockets (127.0.0.1, in-process, asyncio only).

* ``unless_draining`` cancels its inner read with the handler, so no stray read eats the
  connection's next bytes;
* ``messages()`` ends between messages once draining began, but always reads the first;
* a connection upgraded with ``StreamWriter.start_tls()`` is still counted closed;
* the accept race: connections the loop accepts in the same iteration as the shutdown
  request are all answered (asyncio's hand-over task used to find its server closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib
import ipaddress
import selectors
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from graceful import Phase, RefuseImmediately, ShutdownCoordinator
from graceful.asyncio import GracefulServer, start_server

pytestmark = pytest.mark.anyio

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
def anyio_backend() -> str:
    """graceful.asyncio is for asyncio only."""
    return "asyncio"


async def never() -> None:
    await anyio.sleep_forever()


def port_of(server: GracefulServer) -> int:
    return int(server.sockets[0].getsockname()[1])


@asynccontextmanager
async def connect(
    server: GracefulServer,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A client connection, closed whatever happens (a failed test leaves no socket)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(server))
    try:
        yield reader, writer
    finally:
        await close(writer)


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        await writer.wait_closed()


# ----------------------------------------------------------------- unless_draining


@pytest.mark.parametrize(
    "checkpoint_first",
    [
        pytest.param(True, id="checkpoint-then-read"),
        pytest.param(False, id="read-at-once"),
    ],
)
async def test_cancelled_handler_leaves_no_stray_read_behind(checkpoint_first: bool) -> None:
    c = ShutdownCoordinator()
    handler: list[asyncio.Task[object]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handler.append(task)
        writer.write(b"waiting\n")
        try:
            await server.unless_draining(reader.readline())
        except asyncio.CancelledError:
            # An idle timeout, say: the handler goes on with the connection.
            if checkpoint_first:
                await asyncio.sleep(0)
            writer.write(b"cancelled\n")
            try:
                line = await reader.readline()
            except RuntimeError as exc:
                line = f"{exc}\n".encode()
            writer.write(b"after cancel: " + line)
        await close(writer)

    server = await start_server(handle, "127.0.0.1", 0, coordinator=c)
    async with server:
        with anyio.fail_after(10):
            async with connect(server) as (reader, writer):
                assert await reader.readline() == b"waiting\n"
                handler[0].cancel()
                assert await reader.readline() == b"cancelled\n"
                writer.write(b"second\n")
                assert await reader.readline() == b"after cancel: second\n"


async def test_unless_draining_returns_none_once_draining() -> None:
    c = ShutdownCoordinator()
    results: list[bytes | None] = []
    greeted = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        greeted.set()
        results.append(await server.unless_draining(reader.readline()))
        results.append(await server.unless_draining(reader.readline()))  # already draining
        await close(writer)

    server = await start_server(handle, "127.0.0.1", 0, coordinator=c)
    async with server:
        with anyio.fail_after(10):
            async with connect(server) as (reader, _):
                await greeted.wait()
                await anyio.wait_all_tasks_blocked()
                c.request_shutdown("test", drain_now=True)
                assert await reader.read() == b""
    assert results == [None, None]


# ------------------------------------------------------------------------- messages


async def test_messages_end_between_messages_but_the_first_is_always_read() -> None:
    c = ShutdownCoordinator()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello\n")
        async for line in server.messages(reader.readline):
            writer.write(b"echo " + line)
        writer.write(b"bye\n")
        await close(writer)

    server = await start_server(handle, "127.0.0.1", 0, coordinator=c)
    async with server:
        with anyio.fail_after(10):
            async with (
                connect(server) as (busy_reader, busy),
                connect(server) as (
                    quiet_reader,
                    quiet,
                ),
            ):
                assert await busy_reader.readline() == b"hello\n"
                busy.write(b"a\n")
                assert await busy_reader.readline() == b"echo a\n"
                assert await quiet_reader.readline() == b"hello\n"  # no message sent yet

                c.request_shutdown("test", drain_now=True)
                assert server.is_draining
                # between two messages: the iteration ends
                assert await busy_reader.readline() == b"bye\n"
                assert await busy_reader.read() == b""
                # its first message comes after draining began: still read and answered
                quiet.write(b"first\n")
                assert await quiet_reader.readline() == b"echo first\n"
                assert await quiet_reader.readline() == b"bye\n"
            assert await c.wait_drained(timeout_s=10)


async def test_messages_end_at_end_of_stream() -> None:
    c = ShutdownCoordinator()
    seen: list[bytes] = []
    ended = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for line in server.messages(reader.readline):
            seen.append(line)
        ended.set()
        await close(writer)

    server = await start_server(handle, "127.0.0.1", 0, coordinator=c)
    async with server:
        with anyio.fail_after(10):
            async with connect(server) as (_, writer):
                writer.write(b"one\ntwo\n")
                writer.write_eof()
                await ended.wait()
    assert seen == [b"one\n", b"two\n"]


# ------------------------------------------------------------------------- start_tls


def make_certificate(directory: Path) -> tuple[Path, Path, Path]:
    """A certificate for localhost/127.0.0.1: (the server's chain, its key, what the
    client trusts) — the same file twice when it is self-signed."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    # Optional test helpers, typed loosely: the test must not depend on their stubs.
    try:
        x509: Any = importlib.import_module("cryptography.x509")
        hashes: Any = importlib.import_module("cryptography.hazmat.primitives.hashes")
        serialization: Any = importlib.import_module("cryptography.hazmat.primitives.serialization")
        ec: Any = importlib.import_module("cryptography.hazmat.primitives.asymmetric.ec")
    except ImportError:
        pass
    else:
        private = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "localhost")])
        now = datetime.datetime.now(datetime.timezone.utc)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(private.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(private, hashes.SHA256())
        )
        cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key.write_bytes(
            private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert, key, cert
    try:
        trustme: Any = importlib.import_module("trustme")
    except ImportError:
        pass
    else:
        ca = trustme.CA()
        issued = ca.issue_cert("localhost", "127.0.0.1")
        issued.private_key_pem.write_to_path(str(key))
        cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
        ca.cert_pem.write_to_path(str(directory / "ca.pem"))
        return cert, key, directory / "ca.pem"
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs cryptography, trustme or the openssl command to make a certificate")
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key, cert


async def test_connection_upgraded_with_start_tls_is_counted_closed(tmp_path: Path) -> None:
    if sys.version_info < (3, 11):
        pytest.skip("StreamWriter.start_tls() is new in 3.11")
    chain, key, trusted = make_certificate(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(chain, key)
    client_context = ssl.create_default_context(cafile=str(trusted))
    c = ShutdownCoordinator()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.readline() == b"STARTTLS\n"
        writer.write(b"go ahead\n")
        await writer.drain()
        await writer.start_tls(server_context)
        line = await reader.readline()
        writer.write(b"secure " + line)
        await writer.drain()
        await close(writer)

    server = await start_server(handle, "127.0.0.1", 0, coordinator=c)
    async with server:
        with anyio.fail_after(20):
            async with connect(server) as (reader, writer):
                writer.write(b"STARTTLS\n")
                assert await reader.readline() == b"go ahead\n"
                await writer.start_tls(client_context, server_hostname="localhost")
                writer.write(b"ping\n")
                assert await reader.readline() == b"secure ping\n"
                assert c.statistics().connections == 1
            assert await c.wait_drained(timeout_s=10)
    assert c.statistics().connections == 0
    assert server.connection_count == 0


# ---------------------------------------------------------------------- accept race


def read_answers(socks: list[socket.socket], *, within_s: float) -> list[bytes | str]:
    """One line from each socket, read concurrently; what went wrong instead, as text."""
    answers: list[bytes | str] = [b""] * len(socks)
    with selectors.DefaultSelector() as selector:
        for i, sock in enumerate(socks):
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, i)
        deadline = time.monotonic() + within_s
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                i, ready = key.data, key.fileobj
                assert isinstance(ready, socket.socket)
                try:
                    chunk = ready.recv(1024)
                except OSError as exc:
                    answers[i] = repr(exc)
                    selector.unregister(ready)
                    continue
                data = answers[i]
                assert isinstance(data, bytes)
                if not chunk:
                    answers[i] = f"closed without an answer after {data!r}"
                    selector.unregister(ready)
                elif (data := data + chunk).endswith(b"\n"):
                    answers[i] = data
                    selector.unregister(ready)
                else:
                    answers[i] = data
        for key in list(selector.get_map().values()):
            answers[key.data] = f"no answer within {within_s} s"
    return answers


async def test_connections_accepted_with_the_shutdown_request_are_all_answered() -> None:
    """The loop is blocked while N clients connect and send a request, then the shutdown
    request is queued: the loop accepts all N in the iteration that closes the
    listener.  Every client must get its answer."""
    n = 50
    c = ShutdownCoordinator(policy=RefuseImmediately(), grace_period_s=30)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await server.unless_draining(reader.readline(), first=True)
        writer.write(b"answer " + (line or b"?\n"))
        await writer.drain()
        await close(writer)

    server = await start_server(handle, "127.0.0.1", 0, coordinator=c, backlog=2 * n)
    port = port_of(server)
    loop = asyncio.get_running_loop()
    requested = threading.Event()
    done = asyncio.Event()
    answers: list[bytes | str] = []

    def clients() -> None:
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                sock = socket.create_connection(("127.0.0.1", port), timeout=20)
                socks.append(sock)
                sock.sendall(b"%d\n" % i)
            loop.call_soon_threadsafe(c.request_shutdown, "test")
            requested.set()
            answers.extend(read_answers(socks, within_s=20))
        finally:
            requested.set()
            for sock in socks:
                sock.close()
            with contextlib.suppress(RuntimeError):  # the loop is gone: the test failed
                loop.call_soon_threadsafe(done.set)

    thread = threading.Thread(target=clients, daemon=True)
    try:
        async with server, anyio.create_task_group() as tg:
            await tg.start(
                lambda task_status: c.run(shutdown_trigger=never, task_status=task_status)
            )
            thread.start()
            # Block the loop: the connections and the request pile up behind it.
            assert requested.wait(30)
            with anyio.fail_after(30):
                await done.wait()
                assert await c.wait_for_phase(Phase.STOPPED)
    finally:
        thread.join(30)
    assert answers == [b"answer %d\n" % i for i in range(n)]
    assert c.statistics().connections == 0
    assert c.statistics().connections_total == n
