"""Regressions of the core rewrite.  Most of these failed on the code before it; the
others pin down behaviour it already had and must keep (a request cancelled while
serving is left alone, a websocket still open after its grace gets 1001).

* GracefulMiddleware and cancellation: a request cut while *stopping* gets a shielded
  503 and the cancellation still propagates (anyio scopes and native asyncio timeouts);
  a request cancelled while *serving* is left alone.
* Websockets through the middleware: an escalation from a plain event-loop callback
  closes them with 1001; app errors come out as themselves; nothing is sent after the
  client disconnected and the app's own cleanup is not cancelled.
* Waiters and listeners: ``wait_drained()`` wakes in any phase; a listener that
  escalates does not make others see phases out of order.
* Policies and the coordinator reject positional, mistyped and out-of-range options by
  name.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from graceful import (
    AcceptUntilIdle,
    Phase,
    RefuseImmediately,
    ServeUntilKilled,
    ShutdownCoordinator,
)
from graceful.asgi import ASGIApp, GracefulMiddleware, Message, Receive, Scope, Send

pytestmark = pytest.mark.anyio


async def never() -> None:
    await anyio.sleep_forever()


async def start(tg: anyio.abc.TaskGroup, c: ShutdownCoordinator) -> None:
    await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))


def call_from_loop_callback(backend: str, fn: Callable[[], object]) -> None:
    """Run ``fn`` from a plain event-loop callback (outside any task), like a signal
    handler's scheduled callback does."""
    if backend == "asyncio":
        asyncio.get_running_loop().call_soon(fn)
    else:
        import trio

        trio.lowlevel.current_trio_token().run_sync_soon(fn)


@contextmanager
def no_warnings() -> Iterator[None]:
    """Fail on any warning, including a coroutine garbage-collected unawaited."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
    assert [str(w.message) for w in caught] == []


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# ---------------------------------------------------------------- HTTP and cancellation


def http_scope(path: str = "/slow") -> Scope:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "headers": [],
        "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80),
    }  # fmt: skip


class HTTPPeer:
    """The server's side of one HTTP request.  Every send is a checkpoint, as with a
    real server, so a send made inside a cancelled scope is itself cancelled."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(self, message: Message) -> None:
        await anyio.lowlevel.checkpoint()
        self.sent.append(dict(message))

    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return int(starts[0]["status"]) if starts else None

    def headers(self) -> list[tuple[bytes, bytes]]:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return [(bytes(k), bytes(v)) for k, v in starts[0].get("headers", [])]


def hanging_app(entered: anyio.Event, *, start_response: bool = False) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if start_response:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        entered.set()
        await anyio.sleep_forever()

    return app


async def cut_in_scope(
    c: ShutdownCoordinator, app: Any, entered: anyio.Event, *, stop_first: bool
) -> tuple[anyio.CancelScope, HTTPPeer]:
    """Run one request through the middleware and cancel it with an anyio cancel scope
    once the app is inside (after escalating to stopping if ``stop_first``)."""
    peer = HTTPPeer()
    middleware = GracefulMiddleware(app, coordinator=c)
    scope = anyio.CancelScope()

    async def request() -> None:
        with scope:
            await middleware(http_scope(), peer.receive, peer.send)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            await entered.wait()
            if stop_first:
                c.request_shutdown("SIGQUIT", immediate=True)
                assert c.cutting
            scope.cancel()
    return scope, peer


async def test_request_cut_while_stopping_gets_a_shielded_503_and_is_still_cancelled() -> None:
    c = ShutdownCoordinator()
    entered = anyio.Event()
    scope, peer = await cut_in_scope(c, hanging_app(entered), entered, stop_first=True)
    assert scope.cancelled_caught  # the cancellation reached its scope
    assert peer.status() == 503
    assert (b"connection", b"close") in peer.headers()
    assert peer.sent[-1] == {"type": "http.response.body", "body": b"server shutting down\n"}
    assert c.statistics().requests == 0


async def test_request_cut_after_its_response_started_gets_no_second_start() -> None:
    c = ShutdownCoordinator()
    entered = anyio.Event()
    app = hanging_app(entered, start_response=True)
    scope, peer = await cut_in_scope(c, app, entered, stop_first=True)
    assert scope.cancelled_caught
    assert [m["type"] for m in peer.sent] == ["http.response.start"]
    assert peer.status() == 200


async def test_request_cancelled_while_serving_gets_no_503() -> None:
    c = ShutdownCoordinator()
    entered = anyio.Event()
    scope, peer = await cut_in_scope(c, hanging_app(entered), entered, stop_first=False)
    assert scope.cancelled_caught
    assert peer.sent == []
    assert c.statistics().requests == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_asyncio_timeout_still_raises_after_a_cut() -> None:
    """A request cancelled by ``asyncio.timeout()`` while stopping gets its 503, and the
    cancellation is re-raised so that ``asyncio.timeout`` turns it into TimeoutError."""
    if sys.version_info < (3, 11):
        pytest.skip("asyncio.timeout() is new in 3.11")
    c = ShutdownCoordinator()
    entered = anyio.Event()
    peer = HTTPPeer()
    middleware = GracefulMiddleware(hanging_app(entered), coordinator=c)
    c.request_shutdown("SIGQUIT", immediate=True)
    loop = asyncio.get_running_loop()

    async def request() -> None:
        async with asyncio.timeout(None) as timeout:

            async def expire_once_inside() -> None:
                await entered.wait()
                timeout.reschedule(loop.time())

            helper = asyncio.ensure_future(expire_once_inside())
            try:
                await middleware(http_scope(), peer.receive, peer.send)
            finally:
                await helper

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(request(), 10)
    assert peer.status() == 503
    assert c.statistics().requests == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_asyncio_cancel_while_serving_propagates() -> None:
    c = ShutdownCoordinator()
    entered = anyio.Event()
    peer = HTTPPeer()
    middleware = GracefulMiddleware(hanging_app(entered), coordinator=c)
    task = asyncio.ensure_future(middleware(http_scope(), peer.receive, peer.send))
    await asyncio.wait_for(entered.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert peer.sent == []
    assert c.statistics().requests == 0


# ------------------------------------------------------------------------- websockets


def websocket_scope() -> Scope:
    return {
        "type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "scheme": "ws", "path": "/ws", "raw_path": b"/ws", "query_string": b"",
        "root_path": "", "headers": [], "subprotocols": [],
        "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80),
    }  # fmt: skip


class WebSocketPeer:
    """The server's side of one websocket, as uvicorn behaves: a close from the app is
    answered by the client (the app then receives ``websocket.disconnect``), and a send
    after the connection closed raises."""

    def __init__(self) -> None:
        self._to_app: MemoryObjectSendStream[Message]
        self._inbox: MemoryObjectReceiveStream[Message]
        self._to_app, self._inbox = anyio.create_memory_object_stream[Message](16)
        self.sent: list[Message] = []
        self.gone = False  # the connection is closed: disconnect delivered or close sent
        self._to_app.send_nowait({"type": "websocket.connect"})

    def __enter__(self) -> WebSocketPeer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._to_app.close()
        self._inbox.close()

    async def receive(self) -> Message:
        message = await self._inbox.receive()
        if message["type"] == "websocket.disconnect":
            self.gone = True
        return message

    async def send(self, message: Message) -> None:
        await anyio.lowlevel.checkpoint()
        if self.gone:
            raise OSError(f"{message['type']} sent after the websocket closed")
        self.sent.append(dict(message))
        if message["type"] == "websocket.close":
            self.client_disconnects(message.get("code", 1000))

    def client_disconnects(self, code: int = 1000) -> None:
        self._to_app.send_nowait({"type": "websocket.disconnect", "code": code})

    def client_sends(self, text: str) -> None:
        self._to_app.send_nowait({"type": "websocket.receive", "text": text})


class EchoApp:
    """Echoes until the client disconnects, then cleans up (which takes a checkpoint and
    may wait for ``release``)."""

    def __init__(self, *, hold_cleanup: bool = False) -> None:
        self.accepted = anyio.Event()
        self.disconnected = anyio.Event()
        self.release = anyio.Event()
        if not hold_cleanup:
            self.release.set()
        self.cleaned_up = False
        self.close_code: int | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        self.accepted.set()
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                self.close_code = message["code"]
                break
            await send({"type": "websocket.send", "text": message["text"]})
        self.disconnected.set()
        await anyio.lowlevel.checkpoint()
        await self.release.wait()
        self.cleaned_up = True


async def test_escalation_from_a_loop_callback_closes_websockets_with_1001(
    anyio_backend_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The session is asked to end from a callback, not a task, so the middleware may
    only signal there; the 1001 goes out at once (stopping cuts the close grace short),
    with no error logged and no coroutine left unawaited."""
    c = ShutdownCoordinator()
    app = EchoApp()
    # Stopping cuts the grace short: the 1001 goes out at once, not after 60 s.
    middleware = GracefulMiddleware(app, coordinator=c, websocket_close_grace_s=60)
    with no_warnings(), WebSocketPeer() as peer, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await start(tg, c)
            tg.start_soon(middleware, websocket_scope(), peer.receive, peer.send)
            await app.accepted.wait()
            peer.client_sends("hi")
            call_from_loop_callback(
                anyio_backend_name, lambda: c.request_shutdown("SIGQUIT", immediate=True)
            )
            await app.disconnected.wait()
            assert await c.wait_for_phase(Phase.STOPPED)
    assert peer.sent == [
        {"type": "websocket.accept"},
        {"type": "websocket.send", "text": "hi"},
        {"type": "websocket.close", "code": 1001, "reason": "server shutting down"},
    ]
    assert app.close_code == 1001
    assert app.cleaned_up
    assert errors(caplog) == []
    assert c.statistics().sessions == 0


async def test_websocket_app_error_is_raised_as_itself() -> None:
    c = ShutdownCoordinator()

    async def fails(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        raise ValueError("boom")

    middleware = GracefulMiddleware(fails, coordinator=c)
    with WebSocketPeer() as peer, pytest.raises(ValueError, match=r"^boom$"):
        await middleware(websocket_scope(), peer.receive, peer.send)
    assert c.statistics().sessions == 0


async def test_websocket_app_error_while_draining_is_raised_as_itself() -> None:
    c = ShutdownCoordinator()
    accepted = anyio.Event()

    async def fails_when_told(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        accepted.set()
        await receive()  # the 1001 close's answer
        raise KeyError("late")

    middleware = GracefulMiddleware(fails_when_told, coordinator=c, websocket_close_grace_s=0)
    with WebSocketPeer() as peer, anyio.fail_after(10):

        async def request_drain() -> None:
            await accepted.wait()
            c.request_shutdown("SIGTERM", drain_now=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(request_drain)
            with pytest.raises(KeyError, match="late"):
                await middleware(websocket_scope(), peer.receive, peer.send)
    assert peer.sent[-1]["code"] == 1001


async def test_nothing_is_sent_after_the_client_disconnected_and_cleanup_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client closes first; draining begins while the app is still cleaning up: the
    middleware sends no 1001 to a gone client, and nothing cancels the cleanup."""
    c = ShutdownCoordinator()
    app = EchoApp(hold_cleanup=True)
    middleware = GracefulMiddleware(app, coordinator=c, websocket_close_grace_s=0)
    with no_warnings(), WebSocketPeer() as peer, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(middleware, websocket_scope(), peer.receive, peer.send)
            await app.accepted.wait()
            peer.client_disconnects(1000)
            await app.disconnected.wait()
            c.request_shutdown("SIGTERM", drain_now=True)  # the session is asked to end
            await anyio.wait_all_tasks_blocked()  # the closer had its chance
            app.release.set()
    assert app.cleaned_up
    assert peer.sent == [{"type": "websocket.accept"}]
    assert errors(caplog) == []
    assert c.statistics().sessions == 0


async def test_client_disconnect_during_the_close_grace_is_respected_at_stopping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = ShutdownCoordinator()
    app = EchoApp(hold_cleanup=True)
    middleware = GracefulMiddleware(app, coordinator=c, websocket_close_grace_s=1000)
    with no_warnings(), WebSocketPeer() as peer, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(middleware, websocket_scope(), peer.receive, peer.send)
            await app.accepted.wait()
            c.request_shutdown("SIGTERM", drain_now=True)  # the grace starts
            await anyio.wait_all_tasks_blocked()
            peer.client_disconnects(1000)
            await app.disconnected.wait()
            c.request_shutdown("SIGINT")  # stopping cuts the grace short
            await anyio.wait_all_tasks_blocked()
            app.release.set()
    assert app.cleaned_up
    assert peer.sent == [{"type": "websocket.accept"}]
    assert errors(caplog) == []


async def test_websocket_still_open_after_the_grace_gets_1001() -> None:
    c = ShutdownCoordinator()
    app = EchoApp()
    middleware = GracefulMiddleware(app, coordinator=c, websocket_close_grace_s=0.01)
    with WebSocketPeer() as peer, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(middleware, websocket_scope(), peer.receive, peer.send)
            await app.accepted.wait()
            c.request_shutdown("SIGTERM", drain_now=True)
    assert peer.sent[-1] == {
        "type": "websocket.close",
        "code": 1001,
        "reason": "server shutting down",
    }
    assert app.close_code == 1001
    assert app.cleaned_up


# ------------------------------------------------------------------ waiters, listeners


async def test_wait_drained_while_serving_returns_when_the_last_request_ends() -> None:
    c = ShutdownCoordinator()
    results: list[bool] = []

    async def waiter() -> None:
        results.append(await c.wait_drained())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            c.connection_opened()
            c.request_started()
            session = c.track_session()
            session.__enter__()
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            c.connection_closed()
            await anyio.wait_all_tasks_blocked()
            assert results == []
            c.request_finished()
            await anyio.wait_all_tasks_blocked()
            assert results == []
            session.__exit__(None, None, None)  # the last one
    assert results == [True]
    assert c.phase is Phase.SERVING


@pytest.mark.parametrize("last", ["request", "connection", "session"])
async def test_wait_drained_wakes_on_each_kind_of_last_end(last: str) -> None:
    c = ShutdownCoordinator()
    results: list[bool] = []

    async def waiter() -> None:
        results.append(await c.wait_drained())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            if last == "request":
                with c.track_request():
                    tg.start_soon(waiter)
                    await anyio.wait_all_tasks_blocked()
                    assert results == []
            elif last == "connection":
                c.connection_opened()
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                assert results == []
                c.connection_closed()
            else:
                with c.track_session():
                    tg.start_soon(waiter)
                    await anyio.wait_all_tasks_blocked()
                    assert results == []
    assert results == [True]


async def test_wait_drained_without_connections_ignores_them() -> None:
    c = ShutdownCoordinator()
    c.connection_opened()  # the asking connection of a preStop request
    results: list[bool] = []

    async def waiter() -> None:
        results.append(await c.wait_drained(include_connections=False))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            with c.track_request():
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                assert results == []
    assert results == [True]
    assert c.statistics().connections == 1


async def test_listener_escalating_inside_accepting_keeps_everyone_in_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="graceful")
    c = ShutdownCoordinator(policy=ServeUntilKilled(), grace_period_s=30)
    before: list[Phase] = []
    after: list[Phase] = []
    phase_seen_by_after: list[Phase] = []

    def escalate(phase: Phase) -> None:
        if phase is Phase.ACCEPTING:
            c.request_shutdown("listener")

    c.subscribe(before.append)
    c.subscribe(escalate)
    c.subscribe(after.append)
    c.subscribe(lambda phase: phase_seen_by_after.append(c.phase))
    c.request_shutdown("SIGTERM")
    assert before == after == [Phase.ACCEPTING, Phase.STOPPING]
    assert phase_seen_by_after == [Phase.ACCEPTING, Phase.STOPPING]  # phase matches the call
    assert c.phase is Phase.STOPPING
    lines = [r.getMessage() for r in caplog.records if " -> " in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == [
        "serving -> accepting",
        "accepting -> stopping",
    ]
    assert lines[1].startswith("accepting -> stopping: listener (escalated)")


async def test_listener_escalating_inside_accepting_then_run_stops() -> None:
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    seen: list[Phase] = []

    def escalate(phase: Phase) -> None:
        seen.append(phase)
        if phase is Phase.ACCEPTING:
            c.request_shutdown("listener")

    c.subscribe(escalate)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await start(tg, c)
            c.request_shutdown("SIGTERM")
            assert await c.wait_for_phase(Phase.STOPPED)
    assert seen == [Phase.ACCEPTING, Phase.STOPPING, Phase.STOPPED]


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("make", "args"),
    [
        (AcceptUntilIdle, (5, 1)),
        (AcceptUntilIdle, (5,)),
        (ServeUntilKilled, (True,)),
        (RefuseImmediately, (False,)),
        (ShutdownCoordinator, (RefuseImmediately(),)),
    ],
)
def test_positional_options_are_rejected(make: Callable[..., object], args: tuple[Any]) -> None:
    with pytest.raises(TypeError):
        make(*args)


@pytest.mark.parametrize(
    ("make", "option", "value"),
    [
        (AcceptUntilIdle, "idle_s", "5"),
        (AcceptUntilIdle, "min_wait_s", None),
        (AcceptUntilIdle, "max_wait_s", [30]),
        (AcceptUntilIdle, "idle_s", True),
        (AcceptUntilIdle, "nudge_clients", "yes"),
        (AcceptUntilIdle, "nudge_clients", 1),
        (AcceptUntilIdle, "wait_for_endpoint_removal", None),
        (ServeUntilKilled, "max_wait_s", "5"),
        (ServeUntilKilled, "nudge_clients", 0),
        (RefuseImmediately, "nudge_clients", "no"),
        (ShutdownCoordinator, "policy", "refuse-immediately"),
        (ShutdownCoordinator, "drain_timeout_s", "30"),
        (ShutdownCoordinator, "grace_period_s", "30"),
        (ShutdownCoordinator, "kill_margin_s", None),
        (ShutdownCoordinator, "hook_timeout_s", b"5"),
        (ShutdownCoordinator, "exit_on_third_request", 1),
        (ShutdownCoordinator, "hard_exit", "yes"),
    ],
)
def test_wrong_types_are_rejected_by_name(
    make: Callable[..., object], option: str, value: object
) -> None:
    with pytest.raises(TypeError, match=option):
        make(**{option: value})


@pytest.mark.parametrize(
    ("make", "option", "value"),
    [
        (AcceptUntilIdle, "idle_s", -1),
        (AcceptUntilIdle, "min_wait_s", math.nan),
        (AcceptUntilIdle, "max_wait_s", math.inf),
        (ServeUntilKilled, "max_wait_s", -0.5),
        (ShutdownCoordinator, "drain_timeout_s", -1),
        (ShutdownCoordinator, "grace_period_s", math.nan),
        (ShutdownCoordinator, "kill_margin_s", math.inf),
        (ShutdownCoordinator, "hook_timeout_s", -3),
    ],
)
def test_bad_values_are_rejected_by_name(
    make: Callable[..., object], option: str, value: object
) -> None:
    with pytest.raises(ValueError, match=option):
        make(**{option: value})


def test_fast_exit_survives_a_dead_weak_proxy_in_a_garbage_cycle() -> None:
    """``graceful``'s fast exit walks every live object to flush open files; a dead
    ``weakref.proxy`` (websockets leaves some in garbage cycles) made ``isinstance``
    raise ReferenceError, so ``graceful demo --websockets`` crashed at exit."""
    import subprocess

    code = (
        "import weakref, graceful.__main__ as m\n"
        "class A: pass\n"
        "a = A(); holder = [weakref.proxy(a)]; holder.append(holder); del a\n"
        "f = open(1, 'w', closefd=False)\n"  # an open buffered file: flushed, not lost
        "f.write('flushed')\n"
        "m._exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 3, done.stderr
    assert "ReferenceError" not in done.stderr
    assert done.stdout == "flushed"
