"""How long closing a listener at draining blocks the event loop, with many fds and sockets.

    sudo python benchmarks/seal_stall.py [--fds 20000] [--connections 9000] [--repeats 3]
                                         [--src OLD/src ...]

Closing a listener at draining (``graceful._core.listeners.close_keeping_backlog``) seals it
and waits for the handshakes under way on its port.  Here one client completed its
handshake but sends nothing on a ``TCP_DEFER_ACCEPT`` listener, so the kernel keeps it in
SYN_RECV: the wait runs its whole second, polling.  A crowd process holds ``--fds``
descriptors (``/dev/null``) and another ``--connections`` loopback connections (twice as
many sockets: both ends).  A task of the measured loop sleeps 1 ms at a time and records
how late it wakes: the longest stall (the loop blocked, in one go) and the share of the
wait the loop was blocked.

Run as root it runs in its own PID and network namespaces (``unshare``), so ``/proc``
holds exactly these processes and their connections; otherwise on the machine as it is.
Each ``--src`` (a source tree with ``graceful/``, e.g. a checkout of an older version)
is measured the same way, side by side with the installed one.

    python benchmarks/seal_stall.py --reuseport [--repeats 3] [--src OLD/src ...]

measures instead SO_REUSEPORT siblings: an old and a new server (graceful.asyncio, each
binding its own reuseport socket) share a port, one handshake on it stays under way
(``TCP_DEFER_ACCEPT``); the old one gets SIGTERM and, as it starts draining, 40 clients
connect 5 ms apart; how many of them took 0.5 s or more to connect (a dropped SYN is
retransmitted after a second).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from _common import ROOT  # benchmarks/ is on sys.path when run as a script

#: The measured process: prints one JSON line.
MEASURE = textwrap.dedent(
    """
    import asyncio, json, socket, sys, time
    try:
        from graceful._core import listeners as _listeners
    except ImportError:  # --src of a tree from before the wings (issue 30)
        from graceful import _listeners

    class Count:
        def connection_opened(self): pass
        def connection_closed(self): pass

    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        sock = server.sockets[0]
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 30)
        idle = socket.socket()
        idle.connect(sock.getsockname())  # sends nothing: in SYN_RECV for 30 s
        stalls = []
        done = False

        async def watch():
            while not done:
                before = time.perf_counter()
                await asyncio.sleep(0.001)
                stalls.append(time.perf_counter() - before - 0.001)

        watcher = asyncio.ensure_future(watch())
        await asyncio.sleep(1.0)  # the loop doing nothing else: the baseline
        idle_share = sum(s for s in stalls if s > 0) / 1.0
        idle_longest = max(stalls)
        stalls.clear()
        began = time.perf_counter()
        closing = _listeners.close_keeping_backlog(
            [server], asyncio.Protocol, loop, _listeners.Handovers(Count())
        )
        called = time.perf_counter() - began
        await closing
        waited = time.perf_counter() - began
        done = True
        await watcher
        print(json.dumps({
            "call_ms": called * 1000,
            "longest_ms": max(stalls) * 1000,
            "blocked": sum(s for s in stalls if s > 0) / waited,
            "waited_s": waited,
            "idle_longest_ms": idle_longest * 1000,
            "idle_blocked": idle_share,
        }), flush=True)
        idle.close()

    asyncio.run(main())
    """
)

#: Holds ``n`` descriptors until its stdin closes.
FDS = textwrap.dedent(
    """
    import os, resource, sys
    n = int(sys.argv[1])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(n)]
    print("ready", flush=True)
    sys.stdin.read()
    """
)

#: Holds ``n`` loopback connections (both ends) until its stdin closes.
CONNECTIONS = textwrap.dedent(
    """
    import resource, socket, sys
    n = int(sys.argv[1])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    held = []
    for _ in range(n):
        client = socket.create_connection(listener.getsockname())
        held += [client, listener.accept()[0]]
    print("ready", flush=True)
    sys.stdin.read()
    """
)


#: A graceful.asyncio server on its own SO_REUSEPORT socket, refusing at SIGTERM (the
#: one the seal's tests run).
REUSEPORT_SERVER = str(ROOT / "tests" / "support" / "reuseport_server.py")


def _server(src: str | None, port: int) -> tuple[subprocess.Popen[str], int]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if src is not None:
        env["PYTHONPATH"] = src
    proc = subprocess.Popen(
        [sys.executable, REUSEPORT_SERVER, str(port)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("listening on"):
            return proc, int(line.split()[-1])
    raise SystemExit("the server did not start")


def _delayed(src: str | None, clients: int = 40) -> int:
    """How many of ``clients`` connects took >= 0.5 s while the old server drained."""
    old, port = _server(src, 0)
    new, _ = _server(src, port)
    socks: list[socket.socket] = []
    try:
        stuck = socket.create_connection(("127.0.0.1", port))  # sends nothing: SYN_RECV
        socks.append(stuck)
        old.send_signal(signal.SIGTERM)
        assert old.stdout is not None
        for line in old.stdout:
            if "accepting -> draining" in line:
                break
        started: dict[socket.socket, float] = {}
        took: list[float] = []
        for _ in range(clients):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            started[sock] = time.monotonic()
            socks.append(sock)
            time.sleep(0.005)
        deadline = time.monotonic() + 10
        while started and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(started), [], 0.05)
            for sock in writable:
                took.append(time.monotonic() - started.pop(sock))
        return sum(t >= 0.5 for t in took) + len(started)
    finally:
        for sock in socks:
            sock.close()
        for proc in (old, new):
            proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


def _reuseport(args: argparse.Namespace) -> None:
    for src in [*(Path(s).resolve().as_posix() for s in args.src), None]:
        counts = [_delayed(src) for _ in range(args.repeats)]
        print(f"{src or 'installed'}: {counts} of 40 connections delayed >= 0.5 s")


def _loopback_up() -> None:
    """``ip link set lo up``, in a new network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, 0x8913, request))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))  # SIOCSIFFLAGS, UP


def _crowd(code: str, n: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"the crowd ({code.split()[1]}…) did not start")
    return proc


def _measure(src: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    done = subprocess.run(
        [sys.executable, "-c", MEASURE],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def _inside(args: argparse.Namespace) -> None:
    if args.namespaced:
        _loopback_up()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    crowds = []
    try:
        # Spread over processes of at most the hard RLIMIT_NOFILE descriptors each.
        per_process = max(100, min(hard, 1 << 20) - 200)
        for code, count, fds_each in ((FDS, args.fds, 1), (CONNECTIONS, args.connections, 2)):
            left = count
            while left > 0:
                chunk = min(left, per_process // fds_each)
                crowds.append(_crowd(code, chunk))
                left -= chunk
        with open("/proc/net/tcp", encoding="ascii") as table:
            rows = sum(1 for _ in table) - 1
        print(
            f"{args.fds} fds and {args.connections} connections held ({rows} rows in "
            f"/proc/net/tcp){', own PID and network namespaces' if args.namespaced else ''}"
        )
        sources = [*(Path(s).resolve().as_posix() for s in args.src), None]
        for src in sources:
            runs = [_measure(src) for _ in range(args.repeats)]
            name = src or "installed"

            def spread(key: str, scale: float = 1.0, runs: list[dict[str, float]] = runs) -> str:
                values = sorted(run[key] * scale for run in runs)
                return f"{values[0]:.1f} / {statistics.median(values):.1f} / {values[-1]:.1f}"

            print(
                f"{name}: longest stall {spread('longest_ms')} ms, loop blocked "
                f"{spread('blocked', 100)} % of the {spread('waited_s')} s wait, "
                f"close call {spread('call_ms')} ms; idle loop: longest "
                f"{spread('idle_longest_ms')} ms, {spread('idle_blocked', 100)} % "
                f"(min / median / max of {args.repeats})"
            )
    finally:
        for crowd in crowds:
            assert crowd.stdin is not None
            crowd.stdin.close()
            crowd.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fds", type=int, default=20000)
    parser.add_argument("--connections", type=int, default=9000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--src", action="append", default=[], help="another source tree to compare")
    parser.add_argument("--reuseport", action="store_true", help="measure reuseport siblings")
    parser.add_argument("--no-namespace", action="store_true", help="run on the machine as it is")
    parser.add_argument("--namespaced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reuseport:
        _reuseport(args)
        return
    if args.namespaced or args.no_namespace or os.geteuid() != 0 or not shutil.which("unshare"):
        _inside(args)
        return
    command = ["unshare", "--pid", "--net", "--fork", "--mount-proc", sys.executable]
    command += [__file__, "--namespaced", *sys.argv[1:]]
    raise SystemExit(subprocess.call(command))


if __name__ == "__main__":
    main()
