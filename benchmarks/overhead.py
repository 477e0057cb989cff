"""Middleware overhead: throughput and p99 latency of a hello-world ASGI app, side by side.

    python benchmarks/overhead.py [--duration 5] [--repeats 3] [--connections 32]

Three servers, each a real uvicorn process (httptools, asyncio loop, one worker), measured
alternately with the same client (``wrk``, Debian's package, one thread; the machine has
two cores: one for the server, one for the client):

* ``bare``: ``uvicorn benchmarks.apps:bare``
* ``middleware``: ``uvicorn benchmarks.apps:wrapped`` (GracefulMiddleware)
* ``graceful run``: ``graceful run benchmarks.apps:bare`` (middleware + graceful Server)

Ratios are against ``bare`` in the same repeat; min / median / max over repeats.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"server on port {port} did not start within {timeout_s} s")


SERVERS = {
    "bare": lambda port: [sys.executable, "-m", "uvicorn", "benchmarks.apps:bare"],
    "middleware": lambda port: [sys.executable, "-m", "uvicorn", "benchmarks.apps:wrapped"],
    "graceful run": lambda port: [sys.executable, "-m", "graceful", "run", "benchmarks.apps:bare"],
}
COMMON = [
    "--host",
    "127.0.0.1",
    "--http",
    "httptools",
    "--loop",
    "asyncio",
    "--log-level",
    "warning",
]


# One core each for the server and the client, so that they don't share one by chance.
PIN_SERVER = ["taskset", "-c", "0"] if shutil.which("taskset") else []
PIN_CLIENT = ["taskset", "-c", "1"] if shutil.which("taskset") else []


def run_wrk(port: int, duration_s: float, connections: int) -> tuple[float, float]:
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{int(duration_s)}s",
            "--latency",
            f"http://127.0.0.1:{port}/",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=duration_s + 30,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    assert p99 is not None, out
    value, unit = float(p99.group(1)), p99.group(2)
    p99_ms = value / 1000 if unit == "us" else value * 1000 if unit == "s" else value
    return rps, p99_ms


def measure(name: str, duration_s: float, connections: int) -> tuple[float, float]:
    port = free_port()
    cmd = [*SERVERS[name](port), *COMMON, "--port", str(port)]
    proc = subprocess.Popen(
        [*PIN_SERVER, *cmd], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_listening(port)
        run_wrk(port, 1, connections)  # warm up
        return run_wrk(port, duration_s, connections)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk (Debian package)")
    os.chdir(ROOT)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in SERVERS}
    for _ in range(args.repeats):
        for name in SERVERS:
            results[name].append(measure(name, args.duration, args.connections))
    print(
        f"overhead: wrk -t1 -c{args.connections} -d{args.duration:g}s, "
        f"{args.repeats} repeats, uvicorn httptools/asyncio"
    )
    print(
        f"{'server':>14} {'req/s median':>13} {'p99 ms median':>14} "
        f"{'ratio min':>10} {'median':>7} {'max':>6}"
    )
    for name, values in results.items():
        ratios = [v[0] / b[0] for v, b in zip(values, results["bare"], strict=True)]
        print(
            f"{name:>14} {statistics.median(v[0] for v in values):13.0f} "
            f"{statistics.median(v[1] for v in values):14.2f} "
            f"{min(ratios):10.3f} {statistics.median(ratios):7.3f} {max(ratios):6.3f}"
        )


if __name__ == "__main__":
    main()
