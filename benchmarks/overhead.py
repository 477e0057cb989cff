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
import statistics
import subprocess
import sys

from _common import ROOT, connect, free_port  # benchmarks/ is on sys.path when run as a script

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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wrk(port: int, duration_s: float, connections: int) -> tuple[float, float, int]:
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
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    return rps, p99_ms, requests


def measure(name: str, duration_s: float, connections: int) -> tuple[float, float, float]:
    """Throughput (req/s), p99 latency (ms) and server CPU per request (µs)."""
    port = free_port()
    cmd = [*SERVERS[name](port), *COMMON, "--port", str(port)]
    proc = subprocess.Popen(
        [*PIN_SERVER, *cmd], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        connect(port).close()
        run_wrk(port, 1, connections)  # warm up
        cpu_before = cpu_seconds(proc.pid)
        rps, p99_ms, requests = run_wrk(port, duration_s, connections)
        cpu_us = (cpu_seconds(proc.pid) - cpu_before) / requests * 1e6
        return rps, p99_ms, cpu_us
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
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in SERVERS}
    for _ in range(args.repeats):
        for name in SERVERS:
            results[name].append(measure(name, args.duration, args.connections))
    print(
        f"overhead: wrk -t1 -c{args.connections} -d{args.duration:g}s, "
        f"{args.repeats} repeats, uvicorn httptools/asyncio"
    )
    print(
        f"{'server':>14} {'req/s':>7} {'p99 ms':>7} {'CPU us/req':>11}   "
        f"{'throughput ratio min/median/max':>31}   {'CPU ratio median':>16}"
    )
    for name, values in results.items():
        ratios = [v[0] / b[0] for v, b in zip(values, results["bare"], strict=True)]
        cpu = statistics.median(v[2] for v in values)
        bare_cpu = statistics.median(v[2] for v in results["bare"])
        print(
            f"{name:>14} {statistics.median(v[0] for v in values):7.0f} "
            f"{statistics.median(v[1] for v in values):7.2f} {cpu:11.1f}   "
            f"{min(ratios):9.3f} / {statistics.median(ratios):5.3f} / {max(ratios):5.3f}   "
            f"{bare_cpu / cpu:16.3f}"
        )
    print(
        "medians over repeats; ratios against bare in the same repeat. CPU ratio = bare's "
        "server CPU per request / this one's (a throughput ratio that ignores CPU stolen "
        "by other processes on a shared machine)."
    )


if __name__ == "__main__":
    main()
