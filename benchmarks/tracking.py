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


#: The keys uvicorn's httptools protocol puts in an HTTP scope (13: adding the
#: extensions key does not make the dict grow, as it would with SCOPE's 5).
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
    """What ``_start_asgi_task`` reads of uvicorn's request cycle: the scope, and a
    ``run_asgi`` coroutine (that returns at once here)."""

    __slots__ = ("scope",)

    def __init__(self, scope: dict[str, Any]) -> None:
        self.scope = scope

    async def run_asgi(self, app: Any) -> None:
        pass


async def _start_tasks_ns(protocol: Any, n: int) -> float:
    """The median ns of one ``protocol._start_asgi_task`` call.

    Each call is timed on its own (the clock read costs the same on both sides of a
    comparison) and the tasks it starts run between the timed calls, so the median is
    free of what the tasks cost and of the machine's hiccups.
    """
    start, app, tasks = protocol._start_asgi_task, protocol.app, protocol.tasks
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n // 64):
        cycles = [_Cycle(dict(HTTPTOOLS_SCOPE)) for _ in range(64)]
        for cycle in cycles:
            t0 = clock()
            start(cycle, app)
            samples.append(clock() - t0)
        if tasks:
            await asyncio.wait(list(tasks))
    return statistics.median(samples)


def hot_path_protocols() -> tuple[dict[str, Any], Any]:
    """uvicorn's httptools protocol and graceful's server's protocol class (its fast
    path: the request counted, the DrainSignal in the scope, the middleware bypassed),
    one instance each, and graceful's server; call in a running event loop."""
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from graceful._demo.app import app
    from graceful.uvicorn import Server

    server = Server(uvicorn.Config(app, http="httptools", log_level="warning"))
    server._loop = asyncio.get_running_loop()
    server._prepare()
    graceful_class: Any = server.config.http_protocol_class
    config = server.config
    protocols: dict[str, Any] = {
        name: cls(config=config, server_state=server.server_state, app_state={})
        for name, cls in (("uvicorn", HttpToolsProtocol), ("graceful", graceful_class))
        if cls is not None
    }
    return protocols, server


async def start_tasks(protocol: Any, n: int) -> None:
    """``n`` requests' tasks started by ``protocol`` (and run), untimed: for callgrind."""
    start, app, tasks = protocol._start_asgi_task, protocol.app, protocol.tasks
    for _ in range(n // 64):
        for cycle in [_Cycle(dict(HTTPTOOLS_SCOPE)) for _ in range(64)]:
            start(cycle, app)
        await asyncio.wait(list(tasks))


async def measure_server_hot_path(n: int, repeats: int) -> dict[str, list[float]]:
    """uvicorn's protocol starting a request's task against graceful's server's: the
    per-request work graceful adds to uvicorn."""
    protocols, server = hot_path_protocols()
    results: dict[str, list[float]] = {"uvicorn": [], "graceful": [], "overhead": []}
    n -= n % 64
    for _ in range(repeats):
        u = await _start_tasks_ns(protocols["uvicorn"], n)
        g = await _start_tasks_ns(protocols["graceful"], n)
        results["uvicorn"].append(u)
        results["graceful"].append(g)
        results["overhead"].append(g - u)
    assert server._fastpath.started == n * repeats, "the fast path did not run"
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
        f"\ngraceful's uvicorn server, starting a request's task, {calls:,} x {args.repeats}"
        " (medians of single calls)",
        hot_path,
    )


if __name__ == "__main__":
    main()
