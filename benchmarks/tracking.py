"""Tracking overhead: ns per tracked request, side by side with the same loop untracked.

    python benchmarks/tracking.py [--requests 1000000] [--repeats 7]

Both loops run in the same process and run, alternating, so the ratio is robust against a
noisy machine; min / median / max over the repeats are printed.
"""

from __future__ import annotations

import argparse
import asyncio
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


#: The keys uvicorn's httptools protocol puts in an HTTP scope.
HTTPTOOLS_SCOPE = {
    "type": "http",
    "asgi": {"version": "3.0", "spec_version": "2.3"},
    "http_version": "1.1",
    "server": ("127.0.0.1", 8000),
    "client": ("127.0.0.1", 50000),
    "scheme": "http",
    "root_path": "",
    "headers": [(b"host", b"bench")],
    "state": {},
    "method": "GET",
    "path": "/",
    "raw_path": b"/",
    "query_string": b"",
}


class _Cycle:
    """What uvicorn's request task runs: ``run_asgi(app)``, the app called with the
    cycle's scope (the demo app answers at once here)."""

    __slots__ = ("scope",)

    def __init__(self, scope: dict[str, Any]) -> None:
        self.scope = scope

    async def run_asgi(self, app: Any) -> None:
        await app(self.scope, _receive, _send)


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: dict[str, Any]) -> None:
    pass


def _start(app: Any, tasks: set[asyncio.Task[None]]) -> Any:
    """Start a request's task as uvicorn does (held in the server's task set)."""
    create_task = asyncio.get_running_loop().create_task

    def start(cycle: _Cycle) -> None:
        task = create_task(cycle.run_asgi(app))
        task.add_done_callback(tasks.discard)
        tasks.add(task)

    return start


async def _requests_ns(app: Any, n: int) -> float:
    """The median ns of one request's task started and run to its end.

    Each request is timed on its own (the clock read costs the same on both sides of a
    comparison), so the median is free of the machine's hiccups.
    """
    tasks: set[asyncio.Task[None]] = set()
    start = _start(app, tasks)
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n // 64):
        for cycle in [_Cycle(dict(HTTPTOOLS_SCOPE)) for _ in range(64)]:
            t0 = clock()
            start(cycle)
            await asyncio.wait(list(tasks))
            samples.append(clock() - t0)
    return statistics.median(samples)


def hot_path_apps() -> tuple[dict[str, Any], Any]:
    """What uvicorn's protocol calls for a request: the app uvicorn loaded, and the app
    graceful's server gives it instead (its hot path: the request counted, the
    middleware bypassed); and graceful's server.  Call in a running event loop."""
    import uvicorn

    from graceful._demo.app import app
    from graceful.uvicorn import Server

    server = Server(uvicorn.Config(app, http="httptools", log_level="warning"))
    server._loop = asyncio.get_running_loop()
    server._prepare()
    assert server._hot is not None, "no hot path (httptools missing?)"
    apps = {"uvicorn": server._hot.middleware.app, "graceful": server.config.loaded_app}
    return apps, server


async def start_tasks(app: Any, n: int) -> None:
    """``n`` requests' tasks started with ``app`` (and run), untimed: for callgrind."""
    tasks: set[asyncio.Task[None]] = set()
    start = _start(app, tasks)
    for _ in range(n // 64):
        for cycle in [_Cycle(dict(HTTPTOOLS_SCOPE)) for _ in range(64)]:
            start(cycle)
        await asyncio.wait(list(tasks))


async def measure_server_hot_path(n: int, repeats: int) -> dict[str, list[float]]:
    """A request's task with uvicorn's app against one with graceful's hot path: the
    per-request work graceful adds to uvicorn."""
    apps, server = hot_path_apps()
    results: dict[str, list[float]] = {"uvicorn": [], "graceful": [], "overhead": []}
    n -= n % 64
    for _ in range(repeats):
        u = await _requests_ns(apps["uvicorn"], n)
        g = await _requests_ns(apps["graceful"], n)
        results["uvicorn"].append(u)
        results["graceful"].append(g)
        results["overhead"].append(g - u)
    assert server._hot is not None
    assert server._hot.started == n * repeats, "the hot path did not run"
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
    hot_path = asyncio.run(measure_server_hot_path(calls, args.repeats))
    show(
        f"\ngraceful's uvicorn server, a request's task run to its end, {calls:,} x {args.repeats}"
        " (medians of single calls)",
        hot_path,
    )


if __name__ == "__main__":
    main()
