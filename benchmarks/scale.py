"""Scale: 10,000 idle keep-alive connections — memory per connection and time to close all.

    python benchmarks/scale.py [--connections 10000] [--repeats 3]

For stock uvicorn and ``graceful run`` (refuse-immediately, so draining starts at once),
side by side: open N keep-alive connections, each completing one request (so they sit
idle in keep-alive), read the server's RSS before and after (``/proc/PID/status``), then
send SIGTERM and time, from this process, how long until every connection was closed by
the server. The RSS difference per connection includes uvicorn's own protocol objects;
graceful's tracking cost is the difference between the two rows. ``ulimit -n`` is raised
for this process and the servers it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, free_port  # benchmarks/ is on sys.path when run as a script

APP = "benchmarks.apps:bare"
SERVERS = {
    "uvicorn (stock)": [sys.executable, "-m", "uvicorn", APP],
    "graceful run": [
        sys.executable,
        "-m",
        "graceful",
        "run",
        APP,
        "--policy",
        "refuse-immediately",
    ],
}


def raise_nofile(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, n))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < n:
        sys.exit(f"cannot raise the open-files limit to {n} (hard limit {hard})")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def open_idle(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    conns = []
    sem = asyncio.Semaphore(200)

    async def one() -> None:
        async with sem:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            await reader.readuntil(b"hello\n")
            conns.append((reader, writer))

    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n))), 120)
    return conns


async def wait_all_closed(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    async def closed(reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            await reader.read()

    await asyncio.wait_for(asyncio.gather(*(closed(r) for r, _ in conns)), 60)


async def one_run(name: str, n: int) -> tuple[float, float]:
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before any client
        [
            *SERVERS[name],
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--timeout-keep-alive",
            "300",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        before = rss_kib(proc.pid)
        conns = await open_idle(port, n)
        await asyncio.sleep(0.5)  # let the server settle before reading its RSS
        after = rss_kib(proc.pid)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await wait_all_closed(conns)
        closed_s = time.monotonic() - began
        for _, writer in conns:
            writer.close()
        return (after - before) * 1024 / n, closed_s
    finally:
        if proc.poll() is None:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    raise_nofile(args.connections + 1000)  # each process holds one end of each connection
    os.chdir(ROOT)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in SERVERS}
    for _ in range(args.repeats):
        for name in SERVERS:
            results[name].append(asyncio.run(one_run(name, args.connections)))
    print(f"scale: {args.connections:,} idle keep-alive connections, {args.repeats} repeats")
    print(
        f"{'server':>16} {'bytes/conn median':>18} {'SIGTERM -> all closed, s':>25}"
        f" {'min':>6} {'max':>6}"
    )
    for name, values in results.items():
        closes = [v[1] for v in values]
        print(
            f"{name:>16} {statistics.median(v[0] for v in values):18.0f} "
            f"{statistics.median(closes):25.3f} {min(closes):6.3f} {max(closes):6.3f}"
        )
    stock = statistics.median(v[0] for v in results["uvicorn (stock)"])
    graceful = statistics.median(v[0] for v in results["graceful run"])
    print(
        f"graceful tracking, bytes per connection (difference of medians): {graceful - stock:.0f}"
    )


if __name__ == "__main__":
    main()
