"""Server instructions per request: bare uvicorn against graceful's uvicorn server.

    python benchmarks/server_instructions.py [--requests 4000] [--repeats 1]

The whole server process — uvicorn, httptools, the event loop, the app and graceful — runs
under ``valgrind --tool=callgrind``, which counts the machine instructions it executes:
repeatable on a noisy, shared machine where a few percent of throughput are lost in the
noise.  Each server serves a short and a long run of keep-alive requests from one client
connection (a plain socket in this process); the difference of the two counts divided by
the extra requests is the cost per request, free of start-up and shutdown.  Both servers
use httptools and the asyncio loop, the same hello-world app (``benchmarks.apps:bare``),
and are measured alternately in the same run.

``bare``: :func:`uvicorn.run`.  ``graceful``: :func:`graceful.uvicorn.run` (what
``graceful run`` serves with), refuse-immediately so that SIGTERM ends it at once.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
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
REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"


def drive(sock: socket.socket, requests: int) -> None:
    """Send ``requests`` keep-alive requests one after the other, reading each response."""
    buffer = b""
    for _ in range(requests):
        sock.sendall(REQUEST)
        while True:
            head, sep, rest = buffer.partition(b"\r\n\r\n")
            if sep:
                length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
                if len(rest) >= length:
                    buffer = rest[length:]
                    break
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            buffer += chunk


def instructions(server: str, requests: int) -> int:
    port = free_port()
    kw = {
        "host": "127.0.0.1",
        "port": port,
        "http": "httptools",
        "loop": "asyncio",
        "log_level": "warning",
        "access_log": False,
    }
    code = SERVERS[server].format(app="benchmarks.apps:bare", kw=kw)
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
            with connect(port, timeout_s=120) as sock:
                sock.settimeout(60)
                drive(sock, requests)
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
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind not found; install it (Debian: apt install valgrind)")
        return 1
    short, long = args.requests // 4, args.requests
    per: dict[str, list[float]] = {name: [] for name in SERVERS}
    started = time.monotonic()
    for _ in range(args.repeats):
        for name in SERVERS:  # alternately, in one run
            a, b = instructions(name, short), instructions(name, long)
            per[name].append((b - a) / (long - short))
    print(f"server instructions per request ({short:,} and {long:,} requests, httptools)")
    for name, values in per.items():
        print(f"{name:>10} {min(values):10.0f} (min of {len(values)})")
    bare, graceful = min(per["bare"]), min(per["graceful"])
    print(f"{'overhead':>10} {graceful - bare:10.0f} instructions per request")
    print(f"{'ratio':>10} {bare / graceful:10.4f} (bare / graceful: the expected throughput ratio)")
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
