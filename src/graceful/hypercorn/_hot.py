"""graceful.hypercorn's hot path: HTTP requests straight to the app while nothing shuts down.

The ASGI middleware is costly on hypercorn's request path: its send wrapper is a
coroutine every response message goes through, and on trio every checkpoint inside a
send resumes it.  So the app hypercorn is given is a plain function
(``HotPath.app``) that returns the coroutine of the application itself for an HTTP
request to a path that is no health route while nothing shuts down — one flag, the
scope's type and path, one integer — and the middleware's otherwise (websockets,
lifespan, health routes, every request once shutdown was requested).  The
``DrainSignal`` reaches the application through the lifespan state, which hypercorn
copies into every request's scope (``scope["state"]["graceful"]``).  What the hot path
costs against stock hypercorn: ``benchmarks/server_instructions.py --server hypercorn``
(``hypercorn-trio``), figures in ``docs/performance.md``.

The requests in flight are counted where hypercorn runs them: each application call is a
task of its own (asyncio's, or trio's, found from the root task) with a coroutine
(hypercorn's own, possibly under a task factory's wrapper) that holds the worker's
hypercorn ``Config`` and the request's scope; one that is running the app and not
through the middleware is the hot path's (``HotPath.running``).  At the shutdown request
(the coordinator's first phase change) ``adopt`` turns the hot path off for good and
reports those to the coordinator, each until its application call returns — as the
middleware counts (a response sent, background work after it still counts).  When
nudging begins, an adopted HTTP/1.1 request whose response has not started gets
``Connection: close`` from hypercorn itself: its connection's ``keep_alive_requests`` is
raised to ``config.keep_alive_max_requests``, the limit at which hypercorn closes the
connection after the response (HTTP/2 connections get a GOAWAY: ``_Worker.nudge``).  At
the cut, an adopted request whose response has not started is answered 503 through its
stream's ``app_send`` before the connections are cancelled.

hypercorn's (and h11's, h2's) names read here, unprefixed attributes of their objects:
``ProtocolWrapper.protocol``, ``H11Protocol.stream``, ``connection`` and
``keep_alive_requests``, ``H2Protocol.streams`` and ``connection``, ``HTTPStream.scope``,
``closed``, ``state``, ``stream_id`` and ``app_send``, h11's ``our_state``, h2's
``H2Connection.streams`` and a stream's ``state_machine.headers_sent``; and the locals of
hypercorn's ``task_group._handle`` (the finder).  ``docs/adapters.md`` ("Private names
each adapter reads") lists them with the releases they were checked against.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from importlib.metadata import version as _version
from typing import Any

import anyio
import h11
from hypercorn.config import Config
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.typing import AppWrapper
from typing_extensions import final

from .._core.coordinator import ShutdownCoordinator
from .._core.shape import awaited, self_test_failed, stack_frames
from ..asgi import GracefulMiddleware
from ._connection import _Connection

__all__ = ("HotPath",)

logger = logging.getLogger("graceful")

_POLL_S = 0.02  # trio: how often adopted requests are checked for their end


def _protocol(conn: _Connection) -> Any:
    """The connection's HTTP protocol object (hypercorn swaps it on an HTTP/2 upgrade)."""
    return getattr(getattr(conn.server, "protocol", None), "protocol", None)


def _ended(coroutine: Any) -> bool:
    return getattr(coroutine, "cr_frame", None) is None


@final
class _Adopted:
    """A request the hot path started, adopted at the shutdown request."""

    __slots__ = ("coroutine", "finished", "sampled", "scope")

    def __init__(self, coroutine: Any, scope: dict[str, Any], sampled: float | None) -> None:
        self.coroutine = coroutine  # hypercorn's application call
        self.scope = scope
        self.sampled = sampled
        self.finished = False


@final
class HotPath:
    """The app graceful's hypercorn worker gives hypercorn, and what it started.

    Args:
        middleware: The middleware around the application.
        connections: The worker's open connections.
        config: The worker's hypercorn configuration (each application call holds it).
        trio: The worker runs on trio (else asyncio).
    """

    __slots__ = (
        "adopted",
        "app",
        "config",
        "connections",
        "failed",
        "middleware",
        "on",
        "started",
        "trio",
    )

    def __init__(
        self,
        middleware: GracefulMiddleware,
        connections: Iterable[_Connection],
        config: Config,
        *,
        trio: bool,
    ) -> None:
        self.middleware = middleware
        self.connections = connections
        self.config = config
        self.trio = trio
        self.on = True  # until the first phase change
        self.started = 0  # requests it started (less those adopted)
        self.adopted: list[_Adopted] = []
        self.failed = False  # the self-test failed: off for good
        self.app: AppWrapper = self._dispatcher()

    def _dispatcher(self) -> AppWrapper:
        hot, real, middleware = self, self.middleware.app, self.middleware
        special = middleware.health_endpoints
        app: Callable[[Any, Any, Any], Awaitable[None]] = real

        def first(scope: Any, receive: Any, send: Any) -> Awaitable[None]:
            # The first hot request only: the self-test (``_probe``).  The dispatcher's
            # ``app`` is the application from now on, so later requests pay nothing.
            nonlocal app
            app = real
            return hot._probe(scope, real(scope, receive, send))

        app = first

        def graceful(
            scope: Any,
            receive: Any,
            send: Any,
            sync_spawn: Callable[..., Any],
            call_soon: Callable[..., Any],
        ) -> Awaitable[None]:
            if hot.on and scope["type"] == "http" and scope["path"] not in special:
                hot.started += 1
                return app(scope, receive, send)
            return middleware(scope, receive, send)

        return graceful  # type: ignore[return-value]

    # --------------------------------------------------------------- self-test

    async def _probe(self, scope: dict[str, Any], coroutine: Awaitable[None]) -> None:
        """The first hot request's application call: ``check`` runs (outside this task)
        while the request waits for it, then the application runs.  If the check
        failed, this request is counted here, as the middleware counts the later ones."""
        done = anyio.Event()

        def check() -> None:
            try:
                self.check(scope)
            finally:
                done.set()

        try:
            if self.trio:
                import trio

                trio.lowlevel.current_trio_token().run_sync_soon(check)
            else:
                asyncio.get_running_loop().call_soon(check)
        except RuntimeError:
            self.fail("the application is not called on the worker's event loop")
        else:
            await done.wait()
        if not self.failed:
            await coroutine
            return
        coordinator = self.middleware.coordinator
        self.started -= 1
        sampled = coordinator.request_started()
        try:
            await coroutine
        finally:
            coordinator.request_finished(sampled)

    def check(self, scope: dict[str, Any]) -> None:
        """The self-test: ``running`` — the finder that counts the hot path's requests
        for the drain — finds the request being served (suspended), and ``_stream_of``
        its hypercorn stream (the nudge, the 503 of a cut)."""
        if not self.on:  # shutdown began meanwhile: adopt ran the finder already
            return
        if not any(found is scope for _, _, found in self.running()):
            self.fail("no task's application call holds the worker's Config and the scope")
        elif self._stream_of(scope) is None:
            self.fail("no connection's HTTP stream holds the request's scope")

    def fail(self, what: str) -> None:
        """One warning; every later request takes the middleware (which counts each)."""
        self_test_failed("hypercorn", _version("hypercorn"), what)
        self.on = False
        self.failed = True

    # ------------------------------------------------------------ what it started

    def _tasks(self) -> Iterator[tuple[Any, Any, bool]]:
        """``(task, its coroutine, whether it is the current task)`` for every task of
        the loop (trio: the tree from the root task).  Nothing outside it."""
        if self.trio:
            import trio

            try:
                root = trio.lowlevel.current_root_task()
            except RuntimeError:  # not in trio's thread
                return
            try:
                current = trio.lowlevel.current_task()
            except RuntimeError:  # a trio callback, not a task
                current = None
            todo = [] if root is None else [root]
            while todo:
                task = todo.pop()
                yield task, task.coro, task is current
                for nursery in task.child_nurseries:
                    todo.extend(nursery.child_tasks)
            return
        try:
            current_task = asyncio.current_task()
            tasks = asyncio.all_tasks()
        except RuntimeError:
            return
        for asyncio_task in tasks:
            if not asyncio_task.done():
                yield asyncio_task, asyncio_task.get_coro(), asyncio_task is current_task

    def _scope_in(self, frame: Any) -> dict[str, Any] | None:
        """The HTTP scope ``frame`` holds if it is one of this worker's application
        calls (hypercorn's, which holds the worker's ``Config`` and the scope)."""
        if frame is None:
            return None
        values = list(frame.f_locals.values())
        if not any(value is self.config for value in values):
            return None
        for value in values:
            if type(value) is dict and value.get("type") == "http":
                return value
        return None

    def running(self) -> list[tuple[Any, Any, dict[str, Any]]]:
        """The hot path's requests still running: ``(task, coroutine, scope)`` of each
        application call of this worker that started (a task not yet run takes the
        middleware once it runs, if the hot path is off by then), does not run through
        the middleware and is no health route's."""
        middleware_code = type(self.middleware).__call__.__code__
        special = self.middleware.health_endpoints
        found = []
        for task, coroutine, current in self._tasks():
            scope = None
            if current:
                frames = stack_frames()
                if any(f.f_code is middleware_code for f in frames):
                    continue
                for frame in frames:
                    scope = self._scope_in(frame)
                    if scope is not None:
                        break
            else:
                # The application call may sit below a wrapper (a task factory's): the
                # coroutine holding the scope, awaiting the app, anywhere in the chain.
                chain = awaited(coroutine)
                if any(getattr(c, "cr_code", None) is middleware_code for c in chain):
                    continue
                for awaiting in chain:
                    if getattr(awaiting, "cr_await", None) is not None:
                        scope = self._scope_in(getattr(awaiting, "cr_frame", None))
                        if scope is not None:
                            break
            if scope is not None and scope.get("path") not in special:
                found.append((task, coroutine, scope))
        return found

    def requests(self) -> tuple[int, int]:
        """The coordinator's request source: ``(in_flight, started)``."""
        return (len(self.running()) if self.on else 0), self.started

    # ------------------------------------------------------------- the shutdown

    def adopt(self, coordinator: ShutdownCoordinator) -> bool:
        """Shutdown was requested: later requests take the middleware; those in flight
        are reported to the coordinator until their application call returns.  Returns
        whether ``poll_finished`` must run (trio tasks have no done callback)."""
        if not self.on:
            return False
        self.on = False
        for task, coroutine, scope in self.running():
            self.started -= 1  # counted by the coordinator from now on
            adopted = _Adopted(coroutine, scope, coordinator.request_started())
            self.adopted.append(adopted)
            if not self.trio:
                task.add_done_callback(lambda _, a=adopted: self._finish(coordinator, a))
        return self.trio and bool(self.adopted)

    def _finish(self, coordinator: ShutdownCoordinator, adopted: _Adopted) -> None:
        if not adopted.finished:
            adopted.finished = True
            coordinator.request_finished(adopted.sampled)

    async def poll_finished(self, coordinator: ShutdownCoordinator) -> None:
        """trio: report each adopted request's end, checking every ``_POLL_S``."""
        while True:
            running = False
            for adopted in self.adopted:
                if not adopted.finished:
                    if _ended(adopted.coroutine):
                        self._finish(coordinator, adopted)
                    else:
                        running = True
            if not running:
                return
            await anyio.sleep(_POLL_S)

    def _stream_of(self, scope: dict[str, Any]) -> tuple[Any, HTTPStream] | None:
        """The protocol and stream serving ``scope``, while hypercorn has them."""
        for conn in list(self.connections):
            protocol = _protocol(conn)
            if isinstance(protocol, H2Protocol):
                candidates: list[Any] = list(protocol.streams.values())
            elif isinstance(protocol, H11Protocol):
                candidates = [protocol.stream]
            else:
                continue
            for stream in candidates:
                if type(stream) is HTTPStream and getattr(stream, "scope", None) is scope:
                    return protocol, stream
        return None

    @staticmethod
    def _response_started(protocol: Any, stream: HTTPStream) -> bool:
        """Whether the response's headers were handed to h11/h2 (synchronously, before
        hypercorn's own state follows)."""
        try:
            if isinstance(protocol, H11Protocol):
                return protocol.connection.our_state is not h11.SEND_RESPONSE
            h2_stream = protocol.connection.streams.get(stream.stream_id)
            return h2_stream is None or bool(h2_stream.state_machine.headers_sent)
        except AttributeError:  # a hypercorn or h2 release without these: assume it did
            return True

    def nudge(self) -> None:
        """Adopted HTTP/1.1 requests whose response has not started close their
        connection after it, with ``Connection: close`` (hypercorn's own limit)."""
        for adopted in self.adopted:
            found = None if adopted.finished else self._stream_of(adopted.scope)
            if found is None:
                continue
            protocol, stream = found
            if isinstance(protocol, H11Protocol) and not self._response_started(protocol, stream):
                protocol.keep_alive_requests = max(
                    protocol.keep_alive_requests, self.config.keep_alive_max_requests
                )

    def to_answer(self) -> list[tuple[Any, HTTPStream]]:
        """``(protocol, stream)`` of the adopted requests still running whose response
        has not started."""
        found = []
        for adopted in self.adopted:
            serving = None if adopted.finished else self._stream_of(adopted.scope)
            if serving is not None and self._unanswered(*serving):
                found.append(serving)
        return found

    def _unanswered(self, protocol: Any, stream: HTTPStream) -> bool:
        return (
            not stream.closed
            and stream.state is ASGIHTTPState.REQUEST
            and not self._response_started(protocol, stream)
        )

    async def answer_cut(self, streams: list[tuple[Any, HTTPStream]], timeout_s: float) -> None:
        """The 503 of each of ``streams`` (before the cut cancels them; no middleware
        around them would send it), together; each send is bounded by the middleware's
        ``cut`` (at most a second, and ``exit_by``), the wait for them by ``timeout_s``."""

        async def answer(protocol: Any, stream: HTTPStream) -> None:
            # Checked again with nothing awaited until the 503's headers reach h11/h2:
            # the app may have started its response meanwhile.
            if self._unanswered(protocol, stream):
                await self.middleware.cut(stream.scope, stream.app_send)  # type: ignore[arg-type]

        with anyio.move_on_after(max(timeout_s, 0.001)):
            async with anyio.create_task_group() as tg:
                for protocol, stream in streams:
                    tg.start_soon(answer, protocol, stream)
