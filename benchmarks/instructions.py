"""Instructions per request: the ASGI app bare and through GracefulMiddleware, in-process.

(graceful's own uvicorn server does not use the middleware on its hot path: measure it
with ``benchmarks/server_instructions.py``.)

    python benchmarks/instructions.py [--calls 10000] [--src PATH]

Counts machine instructions with ``valgrind --tool=callgrind`` — repeatable on a noisy,
shared machine where wall-clock differences of a few percent are lost in the noise.  Each
variant runs twice (a short and a long run); the difference divided by the extra calls is
the per-request cost, free of start-up.  ``tracked`` is one turn of the loop
``with coordinator.track_request(): handler()`` (``benchmarks/tracking.py``); the last line
is graceful's uvicorn server's hot path (a request's task run with the app its server
gives uvicorn) against uvicorn's own app, in this tree only.  ``--src``
runs another checkout's ``src`` (e.g. a ``git worktree`` of the previous release) side by
side, for a before/after figure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DRIVER = """
import sys, anyio
from benchmarks.tracking import asgi_ns
from graceful._demo.app import app
from graceful.asgi import GracefulMiddleware
from graceful import ShutdownCoordinator
if sys.argv[1] == "track":
    from benchmarks.tracking import tracked
    tracked(int(sys.argv[2]), ShutdownCoordinator())
elif sys.argv[1] in ("uvicorn", "graceful"):
    import asyncio
    from benchmarks.tracking import hot_path_apps, start_tasks
    async def main():
        apps, _ = hot_path_apps()
        await start_tasks(apps[sys.argv[1]], int(sys.argv[2]))
    asyncio.run(main())
else:
    coordinator = ShutdownCoordinator()
    target = GracefulMiddleware(app, coordinator=coordinator) if sys.argv[1] == "mw" else app
    anyio.run(asgi_ns, target, int(sys.argv[2]))
"""


def instructions(variant: str, calls: int, src: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        result = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-c",
                DRIVER,
                variant,
                str(calls),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT}", "PYTHONHASHSEED": "0"},
            capture_output=True,
            text=True,
            check=True,
        )
    match = re.search(r"Collected : (\d+)", result.stderr)
    assert match, result.stderr
    return int(match.group(1))


def per_request(variant: str, calls: int, src: Path) -> float:
    short, long = instructions(variant, calls // 5, src), instructions(variant, calls, src)
    return (long - short) / (calls - calls // 5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--src", type=Path, action="append", default=[])
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind not found; install it (Debian: apt install valgrind)")
        return 1
    print(f"instructions per request, {args.calls:,} calls")
    print(f"{'src':>40} {'bare app':>10} {'middleware':>11} {'overhead':>9} {'tracked':>8}")
    for src in [ROOT / "src", *args.src]:
        bare = per_request("app", args.calls, src)
        mw = per_request("mw", args.calls, src)
        track = per_request("track", args.calls * 10, src)
        print(f"{str(src)[-40:]:>40} {bare:10.0f} {mw:11.0f} {mw - bare:9.0f} {track:8.0f}")
    calls = args.calls - args.calls % 320  # whole batches of 64 in both runs
    uvicorn = per_request("uvicorn", calls, ROOT / "src")
    graceful = per_request("graceful", calls, ROOT / "src")
    print(
        f"\ngraceful's uvicorn server, a request's task started (and run): uvicorn's app "
        f"{uvicorn:.0f}, graceful's {graceful:.0f}, the hot path adds {graceful - uvicorn:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
