"""Server instructions per request: each server bare against graceful's version of it.

    python benchmarks/server_instructions.py
        [--server uvicorn|hypercorn|hypercorn-trio|aiohttp|granian] [--requests 4000]
        [--repeats 1] [--connections 8]

The whole server process — uvicorn, httptools, the event loop, the app and graceful — runs
under ``valgrind --tool=callgrind``, which counts the machine instructions it executes:
repeatable on a noisy, shared machine where a few percent of throughput are lost in the
noise.  Each server serves a short and a long run of keep-alive requests over
``--connections`` client connections, one request in flight on each (plain sockets in
this process); the difference of the two counts divided by the extra requests is the cost
per request, free of start-up, shutdown and per-connection work.  Both servers use
httptools and the asyncio loop, the same hello-world app (``benchmarks.apps:bare``), and
are measured alternately in the same run.

With several connections the server always has a request waiting (under callgrind it is
by far the slower side), so the event loop batches the same way in every run: what a
loaded server does.  With ``--connections 1`` (ping-pong) whether the loop finds the next
request already there or sleeps for it depends on timing, which moves the count by about
±1,000 instructions per request between runs of the *same* server.

``bare``: ``uvicorn.run``.  ``graceful``: ``graceful.uvicorn.run`` (what
``graceful run`` serves with), refuse-immediately so that SIGTERM ends it at once.
``--control`` adds ``graceful.uvicorn.run(wrap_app=False)``: graceful's server with no
per-request work of its own, which shows the measurement's own spread.

``--server hypercorn`` (``hypercorn-trio``): ``hypercorn.asyncio.serve`` (``hypercorn.trio
.serve``) against ``graceful.hypercorn.run``, h11; ``--server aiohttp``:
``aiohttp.web.run_app`` against ``graceful.aiohttp.run_app``; ``--server granian``:
granian's embedded server (``granian.server.embed.Server``) against
``graceful.granian.run``.  Same app, same clients.
``--server aiohttp-chain``: stock ``web.run_app`` against the same with the application set
up by ``graceful.aiohttp.setup`` (the middleware in its chain, as under aiohttp's own
runner or ``aiohttp.GunicornWebWorker``).
``--server aiohttp-dispatch`` and ``aiohttp-prepare`` measure aiohttp's seams on stock
aiohttp (see ``OTHER_SERVERS``): a ``request_handler`` dispatcher, and one no-op
``on_response_prepare`` receiver on top of it.
"""

from __future__ import annotations

import argparse
import os
import re
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, connect, free_port  # benchmarks/ is on sys.path when run as a script

SERVERS = {
    "bare": "import uvicorn; uvicorn.run({app!r}, **{kw!r})",
    "graceful": (
        "import graceful, graceful.uvicorn; "
        "graceful.uvicorn.run({app!r}, policy=graceful.RefuseImmediately(), **{kw!r})"
    ),
}
CONTROL = {"graceful, no middleware": SERVERS["graceful"].replace("(), ", "(), wrap_app=False, ")}
_HYPERCORN_CONFIG = (
    "import hypercorn.config; config = hypercorn.config.Config(); "
    "config.bind = ['127.0.0.1:{port}']; config.loglevel = 'WARNING'; config.accesslog = None; "
)
#: The other servers: bare and graceful, each a program serving the same app on {port}.
OTHER_SERVERS = {
    "hypercorn": {
        "bare": _HYPERCORN_CONFIG + "import asyncio, hypercorn.asyncio; "
        "from benchmarks.apps import bare; asyncio.run(hypercorn.asyncio.serve(bare, config))",
        "graceful": _HYPERCORN_CONFIG + "import graceful, graceful.hypercorn; "
        "from benchmarks.apps import bare; graceful.hypercorn.run(bare, config, "
        "worker_class='asyncio', policy=graceful.RefuseImmediately())",
    },
    "hypercorn-trio": {
        "bare": _HYPERCORN_CONFIG + "import functools, trio, hypercorn.trio; "
        "from benchmarks.apps import bare; "
        "trio.run(functools.partial(hypercorn.trio.serve, bare, config))",
        "graceful": _HYPERCORN_CONFIG + "import graceful, graceful.hypercorn; "
        "from benchmarks.apps import bare; graceful.hypercorn.run(bare, config, "
        "worker_class='trio', policy=graceful.RefuseImmediately())",
    },
    "aiohttp": {
        "bare": "import asyncio; from aiohttp import web; from benchmarks.apps import aiohttp_app; "
        "web.run_app(aiohttp_app(), host='127.0.0.1', port={port}, print=None, access_log=None, "
        "loop=asyncio.new_event_loop())",
        "graceful": "import asyncio, graceful, graceful.aiohttp; "
        "from benchmarks.apps import aiohttp_app; graceful.aiohttp.run_app(aiohttp_app(), "
        "host='127.0.0.1', port={port}, print=None, access_log=None, "
        "policy=graceful.RefuseImmediately(), loop=asyncio.new_event_loop())",
    },
}
# granian's embedded server: bare (its stop() on SIGTERM, as its own CLI) and graceful's.
OTHER_SERVERS["granian"] = {
    "bare": "import asyncio, signal\n"
    "from granian.constants import Interfaces\nfrom granian.server.embed import Server\n"
    "from benchmarks.apps import bare\n"
    "async def main():\n"
    "    server = Server(bare, address='127.0.0.1', port={port}, interface=Interfaces.ASGI, "
    "log_enabled=False)\n"
    "    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, server.stop)\n"
    "    await server.serve()\n"
    "asyncio.run(main())",
    "graceful": "import graceful, graceful.granian; from benchmarks.apps import bare; "
    "graceful.granian.run(bare, port={port}, granian_options={'log_enabled': False}, "
    "policy=graceful.RefuseImmediately())",
}
# aiohttp's seams, measured on stock aiohttp: what a request_handler dispatcher costs
# (``aiohttp-dispatch``: stock against stock with a dispatcher like graceful's hot path),
# and what one no-op on_response_prepare receiver adds to that (``aiohttp-prepare``).
_AIOHTTP_STOCK = (
    "import asyncio; from aiohttp import web; from benchmarks.apps import aiohttp_app; "
    "app = aiohttp_app(); loop = asyncio.new_event_loop()\n"
)
_AIOHTTP_DISPATCH = (
    "make_server = web.AppRunner._make_server\n"
    "async def with_dispatcher(self):\n"
    "    server = await make_server(self)\n"
    "    handle, started = server.request_handler, [0]\n"
    "    def dispatch(request):\n"
    "        started[0] += 1\n"
    "        return handle(request)\n"
    "    server.request_handler = dispatch\n"
    "    return server\n"
    "web.AppRunner._make_server = with_dispatcher\n"
)
_AIOHTTP_RECEIVER = (
    "async def receiver(request, response): pass\napp.on_response_prepare.append(receiver)\n"
)
_AIOHTTP_RUN = (
    "web.run_app(app, host='127.0.0.1', port={port}, print=None, access_log=None, loop=loop)"
)
OTHER_SERVERS["aiohttp-dispatch"] = {
    "bare": _AIOHTTP_STOCK + _AIOHTTP_RUN,
    "graceful": _AIOHTTP_STOCK + _AIOHTTP_DISPATCH + _AIOHTTP_RUN,
}
OTHER_SERVERS["aiohttp-prepare"] = {
    "bare": _AIOHTTP_STOCK + _AIOHTTP_DISPATCH + _AIOHTTP_RUN,
    "graceful": _AIOHTTP_STOCK + _AIOHTTP_DISPATCH + _AIOHTTP_RECEIVER + _AIOHTTP_RUN,
}
# graceful's middleware in the application's chain under aiohttp's own runner
# (``graceful.aiohttp.setup`` with ``web.run_app`` or ``aiohttp.GunicornWebWorker``).
_AIOHTTP_SETUP = (
    "import graceful, graceful.aiohttp\n"
    "graceful.aiohttp.setup(app, coordinator=graceful.ShutdownCoordinator("
    "policy=graceful.RefuseImmediately()))\n"
)
OTHER_SERVERS["aiohttp-chain"] = {
    "bare": _AIOHTTP_STOCK + _AIOHTTP_RUN,
    "graceful": _AIOHTTP_STOCK + _AIOHTTP_SETUP + _AIOHTTP_RUN,
}
REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"


def _response_end(buffer: bytes) -> int:
    """The length of the first complete response in ``buffer``, or 0."""
    head, sep, rest = buffer.partition(b"\r\n\r\n")
    if not sep:
        return 0
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
    return len(head) + len(sep) + length if len(rest) >= length else 0


def drive(socks: list[socket.socket], requests: int) -> None:
    """Send ``requests`` keep-alive requests over ``socks``, one in flight on each.

    Each connection sends its next request as soon as its response is complete; with
    several connections the server always has a request waiting (under callgrind it is
    the slow side by far), so the event loop batches them the same way in every run.
    """
    buffers = {sock: b"" for sock in socks}
    left = {
        sock: requests // len(socks) + (i < requests % len(socks)) for i, sock in enumerate(socks)
    }
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            if left[sock]:
                sock.sendall(REQUEST)
                selector.register(sock, selectors.EVENT_READ)
        while selector.get_map():
            ready = selector.select(timeout=60)
            if not ready:
                raise TimeoutError("no response within 60 s")
            for key, _ in ready:
                sock = key.fileobj  # type: ignore[assignment]
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("the server closed the connection")
                buffers[sock] += chunk
                while end := _response_end(buffers[sock]):
                    buffers[sock] = buffers[sock][end:]
                    left[sock] -= 1
                    if left[sock]:
                        sock.sendall(REQUEST)
                    else:
                        selector.unregister(sock)


def instructions(server: str, requests: int, connections: int, kind: str = "uvicorn") -> int:
    """The instructions a server runs to start, serve ``requests`` and stop."""
    port = free_port()
    kw = {
        "host": "127.0.0.1",
        "port": port,
        "http": "httptools",
        "loop": "asyncio",
        "log_level": "warning",
        "access_log": False,
    }
    if kind == "uvicorn":
        code = {**SERVERS, **CONTROL}[server].format(app="benchmarks.apps:bare", kw=kw)
    else:
        code = OTHER_SERVERS[kind][server].replace("{port}", str(port))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-c",
                code,
            ],
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
                "PYTHONHASHSEED": "0",
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            socks = [connect(port, timeout_s=120)]
            socks += [connect(port) for _ in range(connections - 1)]
            try:
                drive(socks, requests)
            finally:
                for sock in socks:
                    sock.close()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    match = re.search(r"Collected : (\d+)", err)
    assert match, err
    return int(match.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--server", choices=["uvicorn", *OTHER_SERVERS], default="uvicorn",
        help="the server measured bare and with graceful",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--control", action="store_true", help="also measure graceful's server without its app"
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=8,
        help="keep-alive connections, one request in flight on each (1: ping-pong, where "
        "how the loop batches events depends on timing)",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind not found; install it (Debian: apt install valgrind)")
        return 1
    short, long = args.requests // 4, args.requests
    names = [*SERVERS, *(CONTROL if args.control and args.server == "uvicorn" else ())]
    per: dict[str, list[float]] = {name: [] for name in names}
    started = time.monotonic()
    for _ in range(args.repeats):
        for name in names:  # alternately, in one run
            a = instructions(name, short, args.connections, args.server)
            b = instructions(name, long, args.connections, args.server)
            per[name].append((b - a) / (long - short))
    print(
        f"{args.server} instructions per request ({short:,} and {long:,} requests over "
        f"{args.connections} connection(s)), {args.repeats} repeat(s)"
    )
    print(f"{'':>22} {'min':>9} {'median':>9} {'max':>9}")
    for name, values in per.items():
        print(f"{name:>22} {min(values):9.0f} {statistics.median(values):9.0f} {max(values):9.0f}")
    for how, pick in (("min", min), ("median", statistics.median)):
        bare, graceful = pick(per["bare"]), pick(per["graceful"])
        print(
            f"{how:>6}: overhead {graceful - bare:6.0f} instructions per request, "
            f"ratio {bare / graceful:.4f} (bare / graceful: the expected throughput ratio)"
        )
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
