"""Tracking overhead: ns per tracked request, side by side with the same loop untracked.

    python benchmarks/tracking.py [--requests 1000000] [--repeats 7]

Both loops run in the same process and run, alternating, so the ratio is robust against a
noisy machine; min / median / max over the repeats are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

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


SCOPE = {"type": "http", "path": "/", "http_version": "1.1", "query_string": b"", "headers": []}


async def _receive() -> dict[str, object]:
    return {"type": "http.request"}


async def _send(message: object) -> None:
    pass


async def asgi_ns(app: Any, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        await app(dict(SCOPE), _receive, _send)
    return (time.perf_counter_ns() - t0) / n


async def measure_middleware(n: int, repeats: int) -> dict[str, list[float]]:
    """The same hello-world ASGI app called in-process, bare and through the middleware."""
    from graceful._demo.app import app
    from graceful.asgi import GracefulMiddleware

    wrapped = GracefulMiddleware(app, coordinator=ShutdownCoordinator())
    results: dict[str, list[float]] = {"bare app": [], "middleware": [], "overhead": []}
    for _ in range(repeats):
        b = await asgi_ns(app, n)
        m = await asgi_ns(wrapped, n)
        results["bare app"].append(b)
        results["middleware"].append(m)
        results["overhead"].append(m - b)
    return results


def show(title: str, results: dict[str, list[float]]) -> None:
    print(title)
    print(f"{'':>10} {'min':>9} {'median':>9} {'max':>9}   (ns per request)")
    for name, values in results.items():
        print(f"{name:>10} {min(values):9.1f} {statistics.median(values):9.1f} {max(values):9.1f}")


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
    show(f"tracking overhead, {args.requests:,} requests x {args.repeats} repeats", results)
    ratio = [t / b for t, b in zip(results["tracked"], results["bare"], strict=True)]
    print(
        f"{'ratio':>10} {min(ratio):9.2f} {statistics.median(ratio):9.2f} {max(ratio):9.2f}"
        "   (tracked / bare loop time)"
    )
    calls = args.requests // 5
    middleware = anyio.run(measure_middleware, calls, args.repeats)
    show(f"\nGracefulMiddleware in-process, {calls:,} calls x {args.repeats} repeats", middleware)


if __name__ == "__main__":
    main()
