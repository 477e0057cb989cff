"""Rollout: failed requests per server x policy vs stock uvicorn, over a matrix.

    python benchmarks/rollout.py [--repeats 3] [--delays 0.5,1.5,3] [--mixes ...]

Each cell is one ``graceful demo`` scenario (the same balancer, clients and backends:
see ``graceful._demo``), run side by side for every server in one run. Client mixes:

* ``keep-alive``: 4 keep-alive clients
* ``fresh``: 4 clients opening a new connection per request
* ``long``: 2 keep-alive clients + 2 clients doing 2 s requests
* ``websockets``: 4 websocket clients echoing a message every 20 ms (reconnecting after a
  close frame; a connection cut without one, or a failed connect, is a failure)

Printed: failed requests min / median / max over the repeats, and the failure ratio
against stock uvicorn in the same cell.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from graceful._demo import build_parser
from graceful._demo._report import Progress
from graceful._demo._scenario import SERVERS, Outcome, run_scenario

MIXES = {
    "keep-alive": ["--keepalive-clients", "4", "--fresh-clients", "0", "--long-requests", "0"],
    "fresh": ["--keepalive-clients", "0", "--fresh-clients", "4", "--long-requests", "0"],
    "long": ["--keepalive-clients", "2", "--fresh-clients", "0", "--long-requests", "2"],
    "websockets": [
        "--keepalive-clients", "0", "--fresh-clients", "0", "--long-requests", "0",
        "--websockets", "4",
    ],
}  # fmt: skip


async def cell(delay: float, mix: str, grace: float) -> dict[str, Outcome]:
    args = build_parser().parse_args(
        [*MIXES[mix], "--propagation-delay", f"{delay:g}", "--grace-period", f"{grace:g}"]
    )
    outcomes = {}
    with Progress() as progress:
        for kind in SERVERS.values():
            outcomes[kind.name] = await run_scenario(kind, args, progress)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--delays", default="0.5,1.5,3")
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--grace-period", type=float, default=8.0)
    args = parser.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    mixes = args.mixes.split(",")
    failed: dict[tuple[float, str, str], list[int]] = {}
    requests: dict[tuple[float, str, str], list[int]] = {}
    for _ in range(args.repeats):
        for delay in delays:
            for mix in mixes:
                for name, outcome in asyncio.run(cell(delay, mix, args.grace_period)).items():
                    failed.setdefault((delay, mix, name), []).append(outcome.tally.failed)
                    requests.setdefault((delay, mix, name), []).append(outcome.tally.requests)
    print(
        f"\nrollout: failed requests, {args.repeats} repeats, grace period "
        f"{args.grace_period:g} s (min / median / max; requests median)"
    )
    print(f"{'delay':>6} {'mix':>10} {'server':>28} {'failed':>16} {'requests':>9} {'vs stock':>9}")
    for (delay, mix, name), values in failed.items():
        stock = statistics.median(failed[(delay, mix, "uvicorn")])
        median = statistics.median(values)
        ratio = "-" if name == "uvicorn" else (f"{median / stock:.2f}" if stock else "n/a")
        print(
            f"{delay:6g} {mix:>10} {name:>28} "
            f"{min(values):4d} / {median:5g} / {max(values):4d} "
            f"{statistics.median(requests[(delay, mix, name)]):9g} {ratio:>9}"
        )


if __name__ == "__main__":
    main()
