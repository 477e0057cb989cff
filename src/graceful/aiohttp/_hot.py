"""graceful.aiohttp's hot path: requests straight to the application while nothing shuts down.

aiohttp runs a middleware through machinery of its own (a cached chain of
``functools.partial`` objects and a coroutine per middleware): graceful's middleware in
the application's chain costs about 28,000 instructions a request, 15 % of a
hello-world request, most of it that machinery (``benchmarks/server_instructions.py
--server aiohttp-chain``).  So graceful's ``AppRunner`` keeps its ``Middleware`` out of
the application's chain and hands aiohttp's ``web.Server`` a dispatcher as its
``request_handler`` (a public attribute, read by each connection when it is made): a
plain function that returns the coroutine of the application's own handler while
nothing shuts down — one flag, one header test, one integer per request, no coroutine
of its own — and calls the middleware around that handler otherwise, and for every
websocket upgrade.

The requests the hot path started are counted where they run: each is a task whose
awaited coroutines include the application's handler and not the middleware, serving a
request (found among the locals of its coroutines, by type) on one of the runner's
connections to a path that is no health route (``HotPath.running``).  At the shutdown
request (the coordinator's first phase change) ``adopt`` turns the hot path off for
good and reports those still running to the coordinator, each until its task ends.
The middleware watches them (``Middleware.watch``): their responses are nudged like any
other and the middleware notes which began; at the cut, those whose response had not
begun are cancelled and answered 503 in the same step.

The self-test: the first request the hot path serves (no health route) is checked once,
while it runs — suspended for one loop turn, the finder (``running``) must find its task
and that very request, and the request must offer what the nudge and the 503 of a cut
read (its class's ``keep_alive``, its writer's ``output_size``).  If not, one warning
names aiohttp's version and what did not hold, that request is counted until it ends,
and every later one takes the middleware (which counts each).  The dispatcher's call
target is swapped for the application's handler at that first request, so later
requests run the same code as without the self-test.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Container
from typing import Any, cast

import aiohttp
import anyio
from aiohttp import hdrs, web
from typing_extensions import final

from .._core.coordinator import ShutdownCoordinator
from .._core.shape import awaited, called_from, finisher, local_of, self_test_failed, stack_frames
from ._middleware import Middleware, _started

__all__ = ("HotPath",)

logger = logging.getLogger("graceful")

#: aiohttp's ``web.Server.request_handler``.
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def _code(function: Any) -> Any:
    """The code object of a function or bound method (``None`` for other callables)."""
    return getattr(getattr(function, "__func__", function), "__code__", None)


@final
class HotPath:
    """The dispatcher ``AppRunner`` gives aiohttp's server, and what it started.

    Args:
        middleware: The runner's middleware, out of the application's chain.
        server: aiohttp's server, with the ``request_handler`` it was made with (the
            application's); it counts the requests it reads (``requests_count``).
        connections: The runner's open connections (aiohttp's request handlers): a
            task serving a request on another connection is another server's.
        loop: The loop the server runs on.
    """

    __slots__ = (
        "_started_off",
        "adopted",
        "connections",
        "elsewhere",
        "failed",
        "handle",
        "loop",
        "middleware",
        "on",
        "request_handler",
        "server",
    )

    def __init__(
        self,
        middleware: Middleware,
        server: web.Server,
        connections: Container[object],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.middleware = middleware
        self.server = server
        self.handle: Handler = server.request_handler
        self.connections = connections
        self.loop = loop
        self.on = True  # until the first phase change
        #: The server's requests the hot path did not start: those it handed to the
        #: middleware, and health probes.
        self.elsewhere = 0
        self._started_off: int | None = None  # ``started`` once adopted
        #: The requests adopted at the shutdown request, with their tasks.
        self.adopted: list[tuple[asyncio.Task[Any], web.BaseRequest]] = []
        self.failed = False  # the self-test failed: off for good, nothing to adopt
        self.request_handler = self._dispatcher()

    def _dispatcher(self) -> Handler:
        hot, real, middleware, upgrade = self, self.handle, self.middleware, hdrs.UPGRADE
        health = middleware.uncounted_paths
        handle: Handler = real

        def first(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
            # The first hot request that is no health probe only: the self-test
            # (``_probe``).  The dispatcher's ``handle`` is the application's handler
            # from then on, so later requests pay nothing.
            nonlocal handle
            if request.path in health:
                return real(request)
            handle = real
            return hot._probe(request, real(request))

        handle = first

        def dispatch(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
            if hot.on and upgrade not in request.headers:
                return handle(request)
            hot.elsewhere += 1
            return middleware(cast(web.Request, request), real)

        return dispatch

    def running(self) -> list[tuple[asyncio.Task[Any], web.BaseRequest]]:
        """The hot path's requests still running, with their tasks: a task awaiting the
        application's handler and not the middleware, serving a request on one of the
        runner's connections to a path that is no health route.  Empty off the loop."""
        try:
            if asyncio.get_running_loop() is not self.loop:
                return []
        except RuntimeError:
            return []
        # The application's handler, or the self-test's wrapper of its first call.
        handle_code, probe_code = _code(self.handle), _code(HotPath._probe)
        middleware_code = _code(type(self.middleware).__call__)
        health = self.middleware.uncounted_paths
        current = asyncio.current_task()
        found = []
        for task in asyncio.all_tasks():
            if task.done():
                continue
            if task is current:  # running, not suspended: its call stack tells
                codes = {frame.f_code for frame in stack_frames()}
            else:
                codes = {getattr(c, "cr_code", None) for c in awaited(task.get_coro())}
            if (handle_code not in codes and probe_code not in codes) or middleware_code in codes:
                continue
            request = local_of(task.get_coro(), web.BaseRequest)  # the one it serves
            if request is None or request.protocol not in self.connections:
                continue  # another application's (the same code serves every one)
            if request.path not in health:
                found.append((task, request))
        return found

    # --------------------------------------------------------------- self-test

    async def _probe(
        self, request: web.BaseRequest, coroutine: Awaitable[web.StreamResponse]
    ) -> web.StreamResponse:
        """The first hot request's handler call: the self-test (``check``) runs while
        this request is suspended (``call_soon`` runs before the task's next step), then
        the handler runs.  If the check failed, this request is counted here, as the
        middleware counts the later ones."""
        task = asyncio.current_task()
        if task is None:
            self.fail("the request handler's coroutine is not run by a task")
        else:
            asyncio.get_running_loop().call_soon(self.check, task, request)
            await asyncio.sleep(0)
        if not self.failed:
            return await coroutine
        coordinator = self.middleware.coordinator
        self.elsewhere += 1  # the coordinator counts it
        sampled = coordinator.request_started()
        try:
            return await coroutine
        finally:
            coordinator.request_finished(sampled)

    def check(self, task: asyncio.Task[Any], request: web.BaseRequest) -> None:
        """The self-test: ``running`` — the finder that counts the hot path's requests
        for the drain — finds ``task`` (suspended) serving ``request``, the very object
        its handler gets (the nudge watches it, the 503 of a cut is written to it), and
        ``request`` offers what those read: its class's ``keep_alive`` and its writer's
        ``output_size`` (whether its response began)."""
        if not self.on:  # shutdown began meanwhile: adopt ran the finder already
            return
        if any(t is task and r is request for t, r in self.running()):
            try:
                size = request.writer.output_size
            except (AttributeError, RuntimeError):
                size = None
            if not isinstance(size, int):
                self.fail("the request's writer has no output_size")
            elif not hasattr(inspect.getattr_static(type(request), "keep_alive", None), "__get__"):
                self.fail("the request's class has no keep_alive")
        else:
            self.fail(self._missed(task, request))

    def _missed(self, task: asyncio.Task[Any], request: web.BaseRequest) -> str:
        """What did not hold, ``running`` having missed ``request``'s ``task``."""
        if task not in asyncio.all_tasks():
            return "the request's task is not among the loop's tasks"
        if _code(HotPath._probe) not in {
            getattr(c, "cr_code", None) for c in awaited(task.get_coro())
        }:
            return "the request's task does not await the request handler's coroutine"
        found = local_of(task.get_coro(), web.BaseRequest)
        if found is None:
            return "no coroutine of the request's task holds the request"
        if found is not request:
            return "the request the handler gets is not the one its task holds"
        if request.protocol not in self.connections:
            return "the request's connection is not one of the runner's"
        return "the drain's finder does not find the request"

    def fail(self, what: str) -> None:
        """One warning; every later request takes the middleware (which counts each)."""
        self_test_failed("aiohttp", aiohttp.__version__, what)
        self.on = False
        self.failed = True

    # ------------------------------------------------------------ what it started

    @property
    def started(self) -> int:
        """The requests the hot path started (less those adopted): aiohttp's own count
        of the server's requests (the public ``requests_count``, which it increments for
        every request anyway: a count of the dispatcher's own would cost 300 to 400
        instructions a request more, by ``benchmarks/server_instructions.py --server
        aiohttp``) less those started elsewhere; fixed when adopted."""
        if self._started_off is not None:
            return self._started_off
        return self.server.requests_count - self.elsewhere

    def requests(self) -> tuple[int, int]:
        """The coordinator's request source: ``(in_flight, started)``."""
        return (len(self.running()) if self.on else 0), self.started

    def uncount(self) -> None:
        """A health route's handler runs: if the hot path dispatched it, it is no
        request (called first thing by each)."""
        if self.on and not called_from(_code(type(self.middleware).__call__)):
            self.elsewhere += 1

    def adopt(self, coordinator: ShutdownCoordinator) -> None:
        """Shutdown was requested: later requests take the middleware; those in flight
        are reported to the coordinator, each until its task ends, and cut with the
        middleware's (on the server's loop: from another thread, soon)."""
        if not self.on:
            return
        self.on = False
        self.middleware.responding = set()
        try:
            here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            here = False
        if here:
            self._adopt(coordinator)
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._adopt, coordinator)

    def _adopt(self, coordinator: ShutdownCoordinator) -> None:
        running = self.running()
        self._started_off = self.started - len(running)  # the coordinator counts them now
        for task, request in running:
            task.add_done_callback(finisher(coordinator, coordinator.request_started()))
            self.middleware.watch(request)
            self.middleware.adopt_task(task)
            self.adopted.append((task, request))

    async def answer_cut(self, timeout_s: float) -> None:
        """Cut each adopted request still running whose response has not started, and
        answer it 503, within ``timeout_s``.

        The task is cancelled first and the 503 written in the same step: the handler
        cannot write after it, and aiohttp's close of the connection, once the
        cancellation reached the handler, flushes it."""
        responding = self.middleware.responding or set()
        with anyio.move_on_after(max(timeout_s, 0.001)):
            for task, request in self.adopted:
                if task.done() or id(request) in responding or _started(request, None):
                    continue
                task.cancel(msg="graceful: stopping")
                await self.middleware.answer_cut(request)
