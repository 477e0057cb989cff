"""Tracking overhead: ns per tracked request, side by side with the same loop untracked.

    python benchmarks/tracking.py [--requests 1000000] [--repeats 7]

Both loops run in the same process and run, alternating, so the ratio is robust against a
noisy machine; min / median / max over the repeats are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio

from graceful import ShutdownCoordinator


def handler() -> int:
    return 1


def bare(n: int) -> float:
    h = handler
    t0 = time.perf_counter_ns()
    for _ in range(n):
        h()
    return (time.perf_counter_ns() - t0) / n


def tracked(n: int, coordinator: ShutdownCoordinator) -> float:
    h = handler
    track = coordinator.track_request
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with track():
            h()
    return (time.perf_counter_ns() - t0) / n


async def measure(n: int, repeats: int) -> dict[str, list[float]]:
    coordinator = ShutdownCoordinator()
    results: dict[str, list[float]] = {"bare": [], "tracked": [], "overhead": []}
    for _ in range(repeats):
        b = bare(n)
        t = tracked(n, coordinator)
        results["bare"].append(b)
        results["tracked"].append(t)
        results["overhead"].append(t - b)
    assert coordinator.statistics().requests == 0
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = anyio.run(measure, args.requests, args.repeats)
    print(f"tracking overhead, {args.requests:,} requests x {args.repeats} repeats")
    print(f"{'':>10} {'min':>9} {'median':>9} {'max':>9}   (ns per request)")
    for name, values in results.items():
        print(f"{name:>10} {min(values):9.1f} {statistics.median(values):9.1f} {max(values):9.1f}")
    ratio = [t / b for t, b in zip(results["tracked"], results["bare"], strict=True)]
    print(
        f"{'ratio':>10} {min(ratio):9.2f} {statistics.median(ratio):9.2f} {max(ratio):9.2f}"
        "   (tracked / bare loop time)"
    )


if __name__ == "__main__":
    main()
