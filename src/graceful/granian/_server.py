"""granian's embedded server following a coordinator: the shape filled in.

Why it looks like this
----------------------
granian is a Rust server: its listener, its accept loop, its connections and their
keep-alive all live in Rust (tokio and hyper).  Python sees a request only when the
application is called, and granian's embedded server (``granian.server.embed.Server``)
has one control: ``stop()``.  What ``stop()`` does was found by experiment (granian
2.8.9, ``docs/granian.md``): the listener closes at once (new connections are refused),
idle keep-alive connections are closed at once, requests in flight finish (hyper adds
``Connection: close`` to their responses), and only once they have ended does granian
run the ASGI lifespan shutdown and return from ``serve()`` — with no timeout.

So the shape (``graceful._core.shape``) is filled in with what Python can do:

* **accepting** is simply not calling ``stop()``: granian keeps accepting and serving.
  The embedded server installs no signal handler; ours (``catch_signals``) is the only
  one, so a SIGTERM is the coordinator's.  The middleware answers readiness 503, adds
  ``Connection: close`` while the policy nudges, and counts each connection's first
  request as activity (``first_request``: a connection granian accepted is seen only
  when it sends a request).
* **draining** calls ``stop()`` ``idle_grace_s`` after draining begins, not at once:
  ``stop()`` closes every idle keep-alive connection in the same moment, so first every
  response says ``Connection: close`` for the grace, as the other servers' idle
  connections get it.  Until granian has finished (its ``serve()`` has returned, or it
  has reached the lifespan shutdown), one connection is counted for all of granian's:
  draining ends when granian has closed them, not when the last request we saw ended.
* **stopping** calls ``stop()`` if the grace has not, cancels the requests still running
  (the middleware answers 503 where no response started; the cancellation reaches
  granian as the application's error) and waits for granian's lifespan shutdown, each
  bounded by the share of stopping's budget the shape gives it.

While nothing shuts down, HTTP requests skip the middleware (the hot path,
``graceful.granian._hot``): the hot path finds the ones in flight among the loop's tasks
and adopts them at the shutdown request.  Every other application call goes through our
wrapper (``_Tracked``) to the middleware; the wrapper notes the lifespan's progress and
the task of each call it has seen start and not end.  granian runs each application
call in an asyncio task of its own (its default ``task_impl``), which is what the cut
cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio
import anyio.abc
from granian._granian import SocketHolder
from granian.constants import Interfaces, TaskImpl
from granian.server.embed import Server

from .._core.coordinator import ShutdownCoordinator
from .._core.policy import Phase
from .._core.shape import ServerShape
from .._core.signals import QUICK_SIGNALS, catch_signals, held_while_starting
from ..asgi import GracefulMiddleware
from ._hot import HotPath

logger = logging.getLogger("graceful")

#: The signals ``serve`` handles when it is given no ``shutdown_trigger``.
HANDLED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, *QUICK_SIGNALS)

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


class NotStarted(RuntimeError):
    """granian ended before the application's lifespan startup completed."""


class _Embedded(Server):
    """granian's embedded server on a listening socket graceful bound.

    granian binds its own socket from ``address``/``port``; graceful binds it instead
    (the port is known before granian starts, and a ``--workers`` parent's socket can
    be served) and hands granian the descriptor.  granian takes ownership of it: its
    Rust listener closes it at ``stop()``.
    """

    def __init__(self, target: Any, sock: socket.socket, **options: Any) -> None:
        super().__init__(target, **options)
        self._graceful_backlog = int(options.get("backlog", 1024))
        self._graceful_uds = sock.family == getattr(socket, "AF_UNIX", None)
        self._graceful_fd: int | None = sock.detach()

    def _init_shared_socket(self) -> None:  # granian's own method, replaced
        fd = self._graceful_fd
        if fd is None:
            raise RuntimeError("granian's socket was handed over already")
        self._graceful_fd = None
        # granian's stub declares SocketHolder without its constructor (fd, uds, backlog).
        holder: Any = SocketHolder(fd, self._graceful_uds, max(128, self._graceful_backlog))  # type: ignore[call-arg]
        self._ssp = None
        self._shd = holder
        self._sfd: Any = fd

    def close_unused(self) -> None:
        """Close the descriptor if granian never took it (it failed before binding)."""
        fd, self._graceful_fd = self._graceful_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                socket.socket(fileno=fd).close()


class _Tracked:
    """The application granian calls for what the hot path does not take: notes the
    lifespan's progress and the task of every request and websocket running, for the
    cut."""

    __slots__ = ("_app", "ended", "running", "started", "startup_failed")

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self.running: set[asyncio.Task[Any]] = set()
        #: The lifespan startup completed (or the app has no lifespan: granian serves).
        self.started = asyncio.Event()
        self.startup_failed = False
        #: granian asked for the lifespan shutdown: its connections are all closed.
        self.ended = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        task = asyncio.current_task()
        if task is None:  # granian's Rust task implementation: nothing to cut
            await self._app(scope, receive, send)
            return
        self.running.add(task)
        try:
            await self._app(scope, receive, send)
        finally:
            self.running.discard(task)

    async def _lifespan(self, scope: Any, receive: Any, send: Any) -> None:
        async def observed_receive() -> Any:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                self.ended.set()
            return message

        async def observed_send(message: Any) -> None:
            if message["type"] == "lifespan.startup.complete":
                self.started.set()
            elif message["type"] == "lifespan.startup.failed":
                self.startup_failed = True
            await send(message)

        try:
            await self._app(scope, observed_receive, observed_send)
        except BaseException:
            if not self.started.is_set() and not self.startup_failed:
                # No lifespan support: granian goes on without it (as uvicorn's "auto").
                self.started.set()
            raise


class GranianShape(ServerShape):
    """The server shape (``graceful._core.shape``) filled in for granian's embedded
    server, and the sequence that serves with it."""

    def __init__(
        self,
        app: ASGIApp,
        sock: socket.socket,
        options: dict[str, Any],
        *,
        coordinator: ShutdownCoordinator,
        shutdown_trigger: Callable[[], Awaitable[object]] | None,
        quick_signals: tuple[int, ...],
        idle_grace_s: float,
    ) -> None:
        super().__init__(coordinator, idle_grace_s=idle_grace_s)
        self._c = coordinator
        self._app = _Tracked(app)
        #: The hot path (``graceful.granian._hot``), for an app behind the middleware.
        self.hot: HotPath | None = None
        target: ASGIApp = self._app
        if isinstance(app, GracefulMiddleware):
            self.hot = HotPath(app, self._app, _Tracked.__call__.__code__)
            try:
                coordinator.add_request_source(self.hot.requests)
            except RuntimeError:  # another server counts for this coordinator
                self.hot.on = False
            if coordinator.shutdown_requested:
                self.hot.on = False
            target = self.hot.app
        self._where = _where(sock)
        options = {**options, "interface": Interfaces.ASGI, "task_impl": TaskImpl.asyncio}
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # for granian's own log line
            options["address"], options["port"] = sock.getsockname()[:2]
        self._granian = _Embedded(target, sock, **options)
        self._trigger = shutdown_trigger
        self._quick_signals = quick_signals
        self._task: asyncio.Task[None] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stopped = False  # granian's stop() was called
        self._holding = False  # one connection counted for granian's, while draining
        #: The lifespan startup completed and granian serves.
        self.started = False

    # ------------------------------------------------------------------- serve

    async def serve(self) -> None:
        """Start granian, follow the coordinator until ``STOPPED``."""
        with held_while_starting(HANDLED_SIGNALS, wanted=self._trigger is None) as handle_signals:
            await self._start()
            logger.info("granian running on %s (CTRL + C to quit)", self._where)
            self.attach()
            self.listeners_opened()
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    tg.start_soon(self._watch_granian)
                    with contextlib.ExitStack() as stack:
                        if handle_signals:
                            stack.enter_context(catch_signals(HANDLED_SIGNALS, self._on_signal))
                        await tg.start(self._run_coordinator)
                        await self._c.wait_for_phase(Phase.STOPPED)
                    tg.cancel_scope.cancel()
            finally:
                self._tg = None
        if self._c.phase is Phase.STOPPED:
            self._c.exit_soon()

    async def _start(self) -> None:
        """granian's ``serve()`` as a task, until the lifespan startup completed."""
        self._task = asyncio.ensure_future(self._granian.serve())
        started = asyncio.ensure_future(self._app.started.wait())
        try:
            await asyncio.wait((self._task, started), return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if not self._app.started.is_set():
            self._granian.close_unused()
            self._task.result()  # granian's own error, if it raised one
            raise NotStarted("the application's lifespan startup failed")
        self.started = True

    async def _run_coordinator(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        # Signals reach the coordinator through us (quick signals differ per caller).
        await self._c.run(shutdown_trigger=self._trigger or _never, task_status=task_status)

    async def _watch_granian(self) -> None:
        """granian ended by itself (a worker crashed) while serving: shut down."""
        assert self._task is not None
        await asyncio.wait((self._task,))
        self._release()
        if not self._stopped:
            logger.error("granian stopped on its own; shutting down")
            self._c.request_shutdown("granian stopped", immediate=True)

    def _on_signal(self, signum: int) -> None:
        self._c.signal_received(signum, quick=self._quick_signals)

    # ----------------------------------------------------- granian's stop()

    def _stop(self) -> None:
        """granian's ``stop()``, once: listener and idle connections closed, requests
        in flight finish."""
        if self._stopped:
            return
        self._stopped = True
        logger.info("granian: listener closed, idle connections closed")
        self._granian.stop()  # type: ignore[no-untyped-call]

    async def _stop_after(self, grace_s: float) -> None:
        await self._c.wait_for_phase(Phase.STOPPING, timeout_s=grace_s)
        self._stop()
        await self._app.ended.wait()
        self._release()

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self._c.connection_closed()

    # ------------------------------------------------ the shape, for granian

    def shutdown_requested(self) -> None:
        """The requests the hot path runs are the coordinator's from now on."""
        if self.hot is not None:
            self.hot.adopt(self._c)

    def close_listeners(self) -> None:
        """Draining: granian's ``stop()`` after ``idle_grace_s`` (it closes the idle
        connections too); granian's connections count as one until it is done."""
        if self._task is None or self._task.done():
            return
        self._holding = True
        self._c.connection_opened()
        if self._tg is None:  # not serving yet (cannot happen after listeners_opened)
            self._stop()
            return
        self._tg.start_soon(self._stop_after, self.idle_grace_s)

    async def listeners_closed(self, timeout_s: float) -> None:
        self._stop()  # stopping cuts the grace short

    async def cut(self, timeout_s: float) -> None:
        """Cancel the requests and websockets still running: the middleware answers 503
        where no response started, and so does the hot path for the requests it
        started."""
        adopted = [] if self.hot is None else self.hot.still_running()
        running = [task for task in self._app.running if not task.done()]
        if not running and not adopted:
            return
        logger.warning("cutting %d request(s) still running", len(running) + len(adopted))
        if adopted:
            assert self.hot is not None
            await self.hot.cut(adopted, timeout_s / 2)
        for task in running:
            task.cancel()
        with anyio.move_on_after(timeout_s / 2 if adopted else timeout_s):
            await asyncio.wait([*running, *(request.task for request in adopted)])

    async def lifespan_shutdown(self) -> None:
        """granian runs the lifespan shutdown once its connections are closed, then its
        ``serve()`` returns: wait for that (``finish`` bounds the wait)."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait((task,))
        self._release()


def _where(sock: socket.socket) -> str:
    address = sock.getsockname()
    if sock.family == getattr(socket, "AF_UNIX", None):
        return f"unix socket {address}"
    host = f"[{address[0]}]" if sock.family == socket.AF_INET6 else address[0]
    return f"http://{host}:{address[1]}"


async def _never() -> None:
    await anyio.sleep_forever()
