"""graceful.aiohttp's request side: the middleware and the health handlers.

``graceful.aiohttp._setup.setup`` installs them on an application.  ``Middleware``
counts requests and websocket sessions, nudges responses, closes websockets with 1001
once draining began, and answers a request cut at stopping with 503.  The connection
side is ``graceful.aiohttp._runner``.

A response the handler prepares itself (a stream, a file, an ``HTTPException``) is
prepared before the middleware sees it.  aiohttp reads the request's public
``keep_alive`` for every response that did not set its own, as it computes the
headers: from the moment the coordinator nudges, each request the middleware runs
(and each the hot path adopted, ``graceful.aiohttp._hot``) is made an instance of a
subclass of its class whose ``keep_alive`` answers ``False`` and notes that the
response began (``Middleware.watch``).  No ``on_response_prepare`` receiver is needed,
which aiohttp would run for every response of the application, watched or not (about
5,000 instructions a request: ``benchmarks/server_instructions.py --server
aiohttp-prepare``).  A websocket's ``WebSocketResponse`` is found, for its 1001,
among the locals of the coroutines its handler's task awaits.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import anyio
from aiohttp import WSCloseCode, hdrs, web
from typing_extensions import final

from .._core import health as _health
from .._core.coordinator import ShutdownCoordinator, _check_coordinator
from .._core.policy import Phase, _check_readiness_on_shutdown, _check_seconds
from .._core.shape import local_of
from .._core.tracking import is_probe


class _HotPath(Protocol):
    """What the middleware asks of the runner's hot path (``graceful.aiohttp._hot``,
    which uses the middleware, not the other way round)."""

    def uncount(self) -> None: ...


__all__ = ("Handler", "Middleware")

logger = logging.getLogger("graceful")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CUT_SEND_S: Final = 1.0  # the longest a cut request's 503 may take to send
_WS_CLOSE_WAIT_S: Final = 1.0  # how long a closing handshake may finish after the handler
_PREPARE_TRIES: Final = 100  # loop iterations a websocket handshake may take to finish
_WS_LOOK_S: Final = 0.05  # first wait before a websocket not found is looked for again
_WS_LOOK_MAX_S: Final = 1.0  # the longest (the wait doubles)


class _RequestState:
    """What the middleware and a watched request's ``keep_alive`` share about one
    request."""

    __slots__ = ("closing", "started")

    def __init__(self) -> None:
        self.started = False  # the response (headers) went out, or is going out
        self.closing = False  # the middleware sent the websocket's 1001


# ``keep_alive`` is read in the request's task (or a child of it): a context variable
# finds the request's state however the handler cloned or wrapped the request.
_STATE: contextvars.ContextVar[_RequestState | None] = contextvars.ContextVar(
    "graceful_aiohttp_request", default=None
)


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text)


@final
class Middleware:
    """An aiohttp middleware that reports to and obeys a coordinator.

    Prefer ``setup``, which also installs the health routes.

    * HTTP requests count as in-flight requests; a returned response gets ``Connection:
      close`` while the coordinator nudges.
    * Websocket upgrades count as sessions; once draining began the app has
      ``websocket_close_grace_s`` to close by itself, then the middleware closes with
      ``WSCloseCode.GOING_AWAY`` (1001).
    * ``cut`` (the ``AppRunner`` calls it when stopping) cancels what still runs;
      a request whose response had not started gets a 503 with ``Connection: close``,
      sent shielded and bounded, and the cancellation is re-raised.

    Args:
        coordinator: The process's coordinator.
        websocket_close_grace_s: How long a websocket may stay open after draining began
            before it is closed with 1001.
    """

    __middleware_version__: Final = 1  # aiohttp's marker of a new-style middleware

    def __init__(
        self,
        coordinator: ShutdownCoordinator,
        *,
        websocket_close_grace_s: float = 1.0,
        readiness_on_shutdown: str = "fail",
    ) -> None:
        _check_coordinator(coordinator)
        _check_seconds("websocket_close_grace_s", websocket_close_grace_s)
        #: ``"fail"`` or ``"keep"``: see ``graceful.asgi.GracefulMiddleware``.
        self.readiness_on_shutdown = _check_readiness_on_shutdown(readiness_on_shutdown)
        self.coordinator: Final = coordinator
        self.websocket_close_grace_s = float(websocket_close_grace_s)
        #: Route handlers that are not counted as requests (the health endpoints).
        self.uncounted: set[Callable[..., object]] = set()
        #: Their paths: graceful's ``AppRunner`` calls the middleware before aiohttp
        #: resolved the route (``graceful.aiohttp._hot``).
        self.uncounted_paths: set[str] = set()
        #: The runner's hot path, if the middleware is out of the application's chain.
        self.hot: _HotPath | None = None
        #: Once the hot path adopted its requests: the ids of the requests without a
        #: state of the middleware's (the adopted ones) whose response began.
        self.responding: set[int] | None = None
        self._watching: dict[type[web.BaseRequest], type[web.BaseRequest]] = {}
        #: Requests running before nudging began, by id: watched when it begins.
        self._unwatched: dict[int, web.BaseRequest] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._request_started = coordinator.request_started
        self._request_finished = coordinator.request_finished
        self._nudging = coordinator.nudging
        # Probes are not traffic (graceful._core.tracking): while accepting, each
        # connection's first request says whether it counts as activity.
        coordinator.classify_connections()
        self._classifying = False
        coordinator.subscribe(self._on_phase)

    def _on_phase(self, phase: Phase) -> None:
        nudging = self.coordinator.nudging
        if nudging and not self._nudging:
            for request in self._unwatched.values():
                self.watch(request)
            self._unwatched.clear()
        self._nudging = nudging
        self._classifying = phase is Phase.ACCEPTING

    def _uncounted(self, request: web.Request) -> bool:
        """Whether ``request`` goes to a route that is not counted (a health route)."""
        if self.hot is not None:  # out of the chain: called before aiohttp routes
            return request.path in self.uncounted_paths
        return request.match_info.handler in self.uncounted

    def _first_request(self, request: web.Request) -> None:
        probe = self._uncounted(request) or is_probe(request.headers.get(hdrs.USER_AGENT))
        transport = request.transport
        peer = None if transport is None else transport.get_extra_info("peername")
        key = tuple(peer[:2]) if isinstance(peer, tuple) else None
        self.coordinator.first_request(key, probe=probe)

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._classifying:
            self._first_request(request)
        if self.uncounted and self._uncounted(request):
            return await handler(request)
        if request.headers.get(hdrs.UPGRADE, "").lower() == "websocket":
            return await self._websocket(request, handler)
        c = self.coordinator
        state = _RequestState()
        token = _STATE.set(state)
        self._watch_from_nudging(request)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        sampled = self._request_started()
        try:
            response = await handler(request)
            if self._nudging and isinstance(response, web.StreamResponse) and not response.prepared:
                response.force_close()
            return response
        except asyncio.CancelledError:
            if c.cutting and not _started(request, state):
                await self.answer_cut(request)
            raise
        finally:
            self._request_finished(sampled)
            self._unwatched.pop(id(request), None)
            if task is not None:
                self._tasks.discard(task)
            _STATE.reset(token)

    def watch(self, request: web.BaseRequest) -> None:
        """Nudge ``request``'s response, and note when it begins, however it is prepared.

        ``request`` becomes an instance of a subclass of its class (made once per class)
        whose ``keep_alive`` — which aiohttp reads as it prepares any response that did
        not set its own — notes that the response began and answers ``False`` while the
        coordinator nudges, so aiohttp sends ``Connection: close`` and closes the
        connection after the response.  Everything else about the request is unchanged.
        """
        base = type(request)
        watching = self._watching.get(base)
        if watching is None:  # a watching class maps to itself: watched already
            watching = self._watching[base] = self._watching_class(base)
            self._watching[watching] = watching
        # object's own __setattr__: aiohttp's debug mode warns about unknown attributes.
        object.__setattr__(request, "__class__", watching)

    def _watch_from_nudging(self, request: web.BaseRequest) -> None:
        """``watch`` ``request`` from the moment the coordinator nudges (at once if it
        does).  A watched request's attributes cost aiohttp more to read for the rest
        of the request — CPython's fast path for instance attributes does not survive
        a change of class — so a request that ends before nudging began never is."""
        if self._nudging:
            self.watch(request)
        else:
            self._unwatched[id(request)] = request

    def _watching_class(self, base: type[web.BaseRequest]) -> type[web.BaseRequest]:
        middleware = self
        # The base's own keep_alive (aiohttp's reify: whether the client keeps alive).
        clients = inspect.getattr_static(base, "keep_alive")

        def keep_alive(request: web.BaseRequest) -> bool:
            """Is keep-alive enabled by client, and not nudged away by graceful?"""
            state = _STATE.get()
            if state is not None:
                state.started = True
            elif (responding := middleware.responding) is not None:
                responding.add(id(request))
            return not middleware._nudging and bool(clients.__get__(request, base))

        namespace = {
            "__slots__": (),
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "keep_alive": property(keep_alive),
        }
        return type(base.__name__, (base,), namespace)

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Deprecated, and no longer needed: the middleware nudges the responses a
        handler prepares itself through ``watch``.  Kept so that code which appended it
        to ``app.on_response_prepare`` keeps working; it nudges only."""
        ws = isinstance(response, web.WebSocketResponse)
        if self._nudging and response.keep_alive and not ws:
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    async def cut(self, *, timeout_s: float) -> None:
        """Cancel the requests and sessions still running; wait ``timeout_s`` for them."""
        tasks = [t for t in self._tasks if not t.done()]
        if not tasks:
            return
        logger.warning("cutting %d request(s) still running", len(tasks))
        for task in tasks:
            task.cancel(msg="graceful: stopping")
        await asyncio.wait(tasks, timeout=max(timeout_s, 0.001))

    def adopt_task(self, task: asyncio.Task[Any]) -> None:
        """Cut ``task`` with the requests of the middleware's own (a request the hot
        path started and the coordinator adopted)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def answer_cut(self, request: web.BaseRequest) -> None:
        """Answer a request cut while stopping with 503 + ``Connection: close``.

        Shielded from a cancellation being delivered, bounded by the time stopping has
        left; a caller in the request's task re-raises the cancellation (then aiohttp
        closes the connection).
        """
        c = self.coordinator
        logger.warning("request %s cut: %s", request.path, c.statistics().reason)
        d = c.deadlines
        limit = c.time_left_s(None if d is None else d.exit_by, at_most_s=_CUT_SEND_S)
        with anyio.CancelScope(shield=True), anyio.move_on_after(limit):
            try:
                response = web.Response(
                    status=503, text=_health.CUT_BODY.decode(), headers={"Retry-After": "0"}
                )
                response.force_close()
                await response.prepare(request)
                await response.write_eof()
            except Exception:  # the client is gone: nothing to do
                logger.debug("could not answer the cut request %s", request.path)

    # ----------------------------------------------------------------- websockets

    async def _websocket(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        c = self.coordinator
        state = _RequestState()
        drain = asyncio.Event()
        token = _STATE.set(state)
        self._watch_from_nudging(request)  # a handler may answer the upgrade with HTTP
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        closer = asyncio.ensure_future(self._close_going_away(request, task, state, drain))
        try:
            with c.track_session(drain.set):
                try:
                    return await handler(request)
                except asyncio.CancelledError:
                    if c.cutting and not _started(request, state):
                        await self.answer_cut(request)
                    raise
                finally:
                    if state.closing and not closer.done():
                        # Our close frame is out: let the closing handshake finish.
                        await asyncio.wait((closer,), timeout=_WS_CLOSE_WAIT_S)
        finally:
            closer.cancel()
            self._unwatched.pop(id(request), None)
            if task is not None:
                self._tasks.discard(task)
            _STATE.reset(token)

    async def _close_going_away(
        self,
        request: web.Request,
        task: asyncio.Task[Any] | None,
        state: _RequestState,
        drain: asyncio.Event,
    ) -> None:
        """Once draining began and the grace passed, close the websocket with 1001.

        ``drain`` is set by the session's ``on_drain`` (which may run from a loop
        callback, so it only signals); the grace is cut short when stopping begins.
        The ``WebSocketResponse`` is looked for among the locals of the coroutines the
        handler's ``task`` awaits (a handler waiting for a message awaits the
        websocket's own ``receive``) until it is found; this closer is cancelled when
        the handler returns, and a websocket never found is cut at stopping.
        """
        c = self.coordinator
        await drain.wait()
        await c.wait_for_phase(Phase.STOPPING, timeout_s=self.websocket_close_grace_s)
        # Nothing is told when a handler prepares its websocket: it is looked for (ended
        # by the handler's end, which cancels this closer, or by the cut).
        look_s = _WS_LOOK_S
        while (ws := _websocket_of(task)) is None:
            await asyncio.sleep(look_s)
            look_s = min(look_s * 2, _WS_LOOK_MAX_S)  # many never found: little work
        # A handshake under way may not have its websocket writer yet: closing then
        # raises RuntimeError("Call .prepare() first").
        for _ in range(_PREPARE_TRIES):
            if ws.closed:
                return
            try:
                state.closing = True
                await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
                return
            except RuntimeError:
                state.closing = False
                await asyncio.sleep(0)
            except Exception:  # the connection went away meanwhile
                logger.debug("could not close websocket %s with 1001", request.path)
                return

    # --------------------------------------------------------------------- health

    def not_a_request(self) -> None:
        """A health route's handler starts: the hot path does not count it."""
        if self.hot is not None:
            self.hot.uncount()

    def _respond(self, status: int, text: str) -> web.Response:
        response = _text(status, text)
        if self.coordinator.nudging:
            response.force_close()
        return response

    async def readiness(self, request: web.Request) -> web.Response:
        """200 while serving, 503 from the moment shutdown is requested (with
        ``readiness_on_shutdown="keep"``: from draining on)."""
        self.not_a_request()
        return self._respond(
            *_health.readiness(
                self.coordinator,
                self.readiness_on_shutdown,
                peer=request.remote,
                user_agent=request.headers.get("User-Agent"),
            )
        )

    async def liveness(self, request: web.Request) -> web.Response:
        """200 until stopped."""
        self.not_a_request()
        return self._respond(*_health.liveness(self.coordinator))

    async def prestop(self, request: web.Request) -> web.Response:
        """Request shutdown; answer once the drain is done (or at its deadline)."""
        self.not_a_request()
        return self._respond(*await _health.prestop_done(self.coordinator))


def _websocket_of(task: asyncio.Task[Any] | None) -> web.WebSocketResponse | None:
    """The prepared websocket among the locals of the coroutines ``task`` awaits."""
    if task is None:
        return None
    return local_of(task.get_coro(), web.WebSocketResponse, lambda ws: ws.prepared)


def _started(request: web.BaseRequest, state: _RequestState | None) -> bool:
    """Whether ``request``'s response began (``state``: what its ``keep_alive`` noted;
    a websocket's handshake is sent as it is prepared)."""
    if state is not None and state.started:
        return True
    try:
        return request.writer.output_size > 0
    except (AttributeError, RuntimeError):
        return False
