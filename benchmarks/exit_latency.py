"""Exit latency: time from the last in-flight response to process exit, per server/policy.

    python benchmarks/exit_latency.py [--repeats 5]

Each run starts a real server process, sends one ``/slow?s=0.3`` request, sends SIGTERM
while it is in flight, and records (with ``time.monotonic`` in this process) when the
response's last byte arrived and when the process exited (``waitpid``). Stock uvicorn
polls its exit flag every 100 ms and sleeps another 100 ms in ``shutdown()``; graceful
servers wake at once.  Policies that end accepting at once (refuse-immediately) are
compared; accept-until-idle adds its idle window by design.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

from _common import ROOT, connect, free_port  # benchmarks/ is on sys.path when run as a script

APP = "examples.asgi_app:app"

SERVERS: dict[str, list[str]] = {
    "uvicorn (stock)": [sys.executable, "-m", "uvicorn", APP],
    "graceful run refuse-immediately": [
        sys.executable,
        "-m",
        "graceful",
        "run",
        APP,
        "--policy",
        "refuse-immediately",
    ],
    "graceful run accept-until-idle --idle 0": [
        sys.executable,
        "-m",
        "graceful",
        "run",
        APP,
        "--policy",
        "accept-until-idle",
        "--idle",
        "0",
    ],
    "asyncio example refuse-immediately": [
        sys.executable,
        "examples/asyncio_http.py",
        "--policy",
        "refuse-immediately",
    ],
}


def one_run(name: str) -> float:
    port = free_port()
    cmd = [*SERVERS[name], "--host", "127.0.0.1", "--port", str(port)]
    if "uvicorn" in name or "graceful run" in name:
        cmd += ["--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    exited_at: list[float] = []

    def wait_exit() -> None:
        os.waitpid(proc.pid, 0)
        exited_at.append(time.monotonic())

    try:
        sock = connect(port)
        sock.sendall(b"GET /slow?s=0.3 HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(0.1)  # let the request start: the scenario, not a wait for state
        watcher = threading.Thread(target=wait_exit)
        watcher.start()
        proc.send_signal(signal.SIGTERM)
        data = b""
        while b"slept" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        responded_at = time.monotonic()
        watcher.join(15)
        sock.close()
        if not exited_at:
            raise RuntimeError(f"{name}: did not exit")
        return (exited_at[0] - responded_at) * 1000
    finally:
        if proc.poll() is None and not exited_at:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.chdir(ROOT)
    results: dict[str, list[float]] = {name: [] for name in SERVERS}
    for _ in range(args.repeats):
        for name in SERVERS:
            results[name].append(one_run(name))
    print(f"exit latency after the last response, ms ({args.repeats} repeats)")
    print(f"{'server':>42} {'min':>7} {'median':>7} {'max':>7}")
    for name, values in results.items():
        print(f"{name:>42} {min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}")


if __name__ == "__main__":
    main()
