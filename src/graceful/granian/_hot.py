"""graceful.granian's hot path: HTTP requests straight to the app while nothing shuts down.

Why it looks like this
----------------------
granian's own request costs little (its HTTP is Rust), so the ASGI middleware weighs a
fifth of a hello-world request under it.  The app granian is given is a plain function
(``HotPath.app``) that, while nothing shuts down, returns the application's own
coroutine for an HTTP request to a path that is no health route — one flag, the
scope's type and path, one integer — and the middleware's otherwise (websockets,
lifespan, health routes, every request once shutdown was requested).  The
``DrainSignal`` reaches the application through the lifespan state, which granian
copies into every request's scope (``scope["state"]["graceful"]``).

One thing the hot path keeps per request: its ``send`` is a small function in front of
granian's.  A request in flight at the shutdown request must still tell its client to
leave (``Connection: close``) if its response starts while the policy nudges, and
granian gives Python no other handle on a response's headers: while nothing shuts down
the function passes each message straight on; once the request is adopted it adds the
header.

The requests in flight are found where granian runs them: granian runs each
application call in an asyncio task of its own whose coroutine is granian's
``future_watcher`` (``granian._futures``), which holds the request's ``watcher`` (its
``scope`` and its ``proto``, the Rust protocol whose ``send`` answers).  A started task
of that coroutine, serving an HTTP request to no health route, that does not await the
middleware's wrapper (``_Tracked``), is the hot path's (``HotPath.running``).  At the
shutdown request ``adopt`` turns the hot path off for good and reports those to the
coordinator, each until its task ends.  At the cut, each adopted request still running
is answered 503 through its protocol (granian refuses a second response start with a
``RuntimeError``: a response already started is left alone) and its task cancelled in
the same loop step, so granian's own answer to the cancellation finds the response
sent.

The self-test: the first request the hot path serves is checked once, while it waits —
the finder must find its task and that very scope, and the protocol must offer
``send``.  If not, one warning names granian's version and what did not hold, that
request is counted until it ends, and every later one takes the middleware.

granian's names read here: ``granian._futures._future_watcher_wrapper`` (the code of
the coroutine it makes), that coroutine's local ``watcher`` and the watcher's ``scope``
and ``proto``, and the protocol's ``send``; ``docs/granian.md`` lists them with the
release they were checked against.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from granian import __version__ as granian_version
from granian._futures import _future_watcher_wrapper
from typing_extensions import final

from .._core import health as _health
from .._core.coordinator import ShutdownCoordinator
from .._core.shape import awaited, finisher, self_test_failed, stack_frames
from ..asgi import _CLOSE, _TEXT, GracefulMiddleware, _with_connection_close

__all__ = ("HotPath",)

logger = logging.getLogger("graceful")

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

#: The code of the coroutine granian runs each application call in (one per request).
_WATCHER_CODE: Any = getattr(_future_watcher_wrapper(None), "__code__", None)  # type: ignore[no-untyped-call]
_CUT_START: Any = {
    "type": "http.response.start",
    "status": 503,
    "headers": [*_TEXT, _CLOSE, (b"retry-after", b"0")],
}
_CUT_BODY: Any = {"type": "http.response.body", "body": _health.CUT_BODY}


@final
class _Adopted:
    """A request the hot path started, adopted at the shutdown request."""

    __slots__ = ("proto", "scope", "task")

    def __init__(self, task: asyncio.Task[Any], scope: dict[str, Any], proto: Any) -> None:
        self.task = task
        self.scope = scope
        self.proto = proto  # granian's protocol: its ``send`` answers


@final
class HotPath:
    """The app graceful gives granian, and what it started.

    Args:
        middleware: The middleware around the application.
        slow: What every request the hot path does not take goes to (the middleware,
            behind the wrapper that keeps the tasks for the cut).
        slow_code: The code of ``slow``'s coroutine: a task awaiting it is not the hot
            path's.
    """

    __slots__ = ("adopted", "app", "failed", "middleware", "on", "slow_code", "started")

    def __init__(self, middleware: GracefulMiddleware, slow: ASGIApp, slow_code: Any) -> None:
        self.middleware = middleware
        self.slow_code = slow_code
        self.on = True  # until the first phase change
        self.started = 0  # requests it started (less those adopted)
        self.adopted: list[_Adopted] = []
        self.failed = False  # the self-test failed: off for good
        self.app: ASGIApp = self._dispatcher(slow)

    def _dispatcher(self, slow: ASGIApp) -> ASGIApp:
        hot, real, special = self, self.middleware.app, self.middleware.health_endpoints
        app: ASGIApp = real

        def first(scope: Any, receive: Any, send: Any) -> Awaitable[None]:
            # The first hot request only: the self-test (``_probe``).  The dispatcher's
            # ``app`` is the application from now on, so later requests pay nothing.
            nonlocal app
            app = real
            return hot._probe(scope, real(scope, receive, send))

        app = first

        def graceful(scope: Any, receive: Any, send: Any) -> Awaitable[None]:
            if hot.on and scope["type"] == "http" and scope["path"] not in special:
                hot.started += 1

                def hot_send(message: Any) -> Awaitable[None]:
                    if hot.on:
                        return send(message)  # type: ignore[no-any-return]
                    return hot._adopted_send(scope, send, message)

                return app(scope, receive, hot_send)
            return slow(scope, receive, send)

        return graceful

    def _adopted_send(self, scope: Any, send: Any, message: Any) -> Awaitable[None]:
        """A message of a request the hot path started, once shutdown was requested:
        its response says ``Connection: close`` while the policy nudges (never on
        HTTP/2, where granian sends GOAWAY at ``stop()``)."""
        if (
            message["type"] == "http.response.start"
            and self.middleware.coordinator.nudging
            and scope.get("http_version", "1.1") not in ("2", "3")
        ):
            message = _with_connection_close(message)
        return send(message)  # type: ignore[no-any-return]

    # --------------------------------------------------------------- self-test

    async def _probe(self, scope: dict[str, Any], coroutine: Awaitable[None]) -> None:
        """The first hot request's application call: ``check`` runs while this request
        waits (suspended, as the finder sees the requests it adopts), then the
        application runs.  If the check failed, this request is counted here, as the
        middleware counts the later ones."""
        loop = asyncio.get_running_loop()
        checked = loop.create_future()

        def check() -> None:
            try:
                self.check(scope)
            finally:
                checked.set_result(None)

        loop.call_soon(check)
        await checked
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
        for the drain — finds the request being served (suspended), with the protocol
        the 503 of a cut is sent through."""
        if not self.on:  # shutdown began meanwhile: adopt ran the finder already
            return
        found = [proto for _, found, proto in self.running() if found is scope]
        if not found:
            self.fail(self._missed(scope))
        elif not callable(getattr(found[0], "send", None)):
            self.fail("granian's request protocol has no send")

    def _missed(self, scope: dict[str, Any]) -> str:
        """What did not hold, ``running`` having missed the request of ``scope``."""
        if _WATCHER_CODE is None:
            return "granian._futures._future_watcher_wrapper makes no coroutine function"
        if not any(getattr(coro, "cr_code", None) is _WATCHER_CODE for _, coro, _ in _tasks()):
            return "no task runs granian's future_watcher"
        return "no future_watcher's watcher holds the request's scope"

    def fail(self, what: str) -> None:
        """One warning; every later request takes the middleware (which counts each)."""
        self_test_failed("granian", granian_version, what)
        self.on = False
        self.failed = True

    # ------------------------------------------------------------ what it started

    def running(self) -> list[tuple[asyncio.Task[Any], dict[str, Any], Any]]:
        """The hot path's requests still running: ``(task, scope, protocol)`` of each
        started task of granian's ``future_watcher`` serving an HTTP request to no
        health route, not through the middleware (a task not yet run takes the
        middleware once it runs, if the hot path is off by then)."""
        special = self.middleware.health_endpoints
        found = []
        for task, coroutine, current in _tasks():
            if getattr(coroutine, "cr_code", None) is not _WATCHER_CODE:
                continue
            if current:
                codes = {frame.f_code for frame in stack_frames()}
            elif inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED:
                continue
            else:
                codes = {getattr(c, "cr_code", None) for c in awaited(coroutine)}
            if self.slow_code in codes:
                continue
            watcher = inspect.getcoroutinelocals(coroutine).get("watcher")
            scope = getattr(watcher, "scope", None)
            if type(scope) is not dict or scope.get("type") != "http":
                continue
            if scope.get("path") not in special:
                found.append((task, scope, getattr(watcher, "proto", None)))
        return found

    def requests(self) -> tuple[int, int]:
        """The coordinator's request source: ``(in_flight, started)``."""
        return (len(self.running()) if self.on else 0), self.started

    # ------------------------------------------------------------- the shutdown

    def adopt(self, coordinator: ShutdownCoordinator) -> None:
        """Shutdown was requested: later requests take the middleware; those in flight
        are reported to the coordinator, each until its task ends."""
        if not self.on:
            return
        self.on = False
        for task, scope, proto in self.running():
            self.started -= 1  # counted by the coordinator from now on
            task.add_done_callback(finisher(coordinator, coordinator.request_started()))
            self.adopted.append(_Adopted(task, scope, proto))

    def still_running(self) -> list[_Adopted]:
        """The adopted requests whose task has not ended."""
        return [adopted for adopted in self.adopted if not adopted.task.done()]

    async def cut(self, adopted: list[_Adopted], timeout_s: float) -> None:
        """Answer 503 each of ``adopted`` whose response has not started and cancel
        every one, waiting at most ``timeout_s`` for the answers to be written."""
        writes = []
        for request in adopted:
            written = self._answer(request)
            request.task.cancel(msg="graceful: stopping")
            if written is not None:
                writes.append(written)
        if writes:
            with anyio.move_on_after(max(timeout_s, 0.001)):
                await asyncio.gather(*writes, return_exceptions=True)

    def _answer(self, request: _Adopted) -> Awaitable[None] | None:
        """The 503 of ``request``, if granian takes a response start for it (it raises
        once the application's response started); the body's write, to await."""
        send = getattr(request.proto, "send", None)
        if send is None:
            return None
        try:
            send(_CUT_START)  # granian keeps it until the body
        except RuntimeError:  # the response started: the cancellation ends it
            return None
        c = self.middleware.coordinator
        logger.warning("request %s cut: %s", request.scope.get("path"), c.statistics().reason)
        try:
            written = send(_CUT_BODY)
        except RuntimeError:  # the client is gone
            return None
        return _awaited(written)


async def _awaited(awaitable: Awaitable[None]) -> None:
    await awaitable


def _tasks() -> list[tuple[asyncio.Task[Any], Any, bool]]:
    """``(task, its coroutine, whether it is the current task)`` of every task of the
    running loop not done (none off the loop)."""
    try:
        current = asyncio.current_task()
        tasks = asyncio.all_tasks()
    except RuntimeError:
        return []
    return [(task, task.get_coro(), task is current) for task in tasks if not task.done()]
