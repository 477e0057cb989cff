"""GracefulMiddleware called directly as an ASGI app (its own behaviour; the servers'
behaviour is tested against real processes in tests/uvicorn/, tests/hypercorn/ and
tests/matrix/)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from graceful import Phase, RefuseImmediately, ServeUntilKilled, ShutdownCoordinator
from graceful.asgi import DrainSignal, GracefulMiddleware, drain_signal

pytestmark = pytest.mark.anyio


async def hello(scope: Any, receive: Any, send: Any) -> None:
    signal = drain_signal(scope)
    body = b"draining" if signal is not None and signal.draining else b"hello"
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"connection", b"keep-alive")]}
    )
    await send({"type": "http.response.body", "body": body})


async def call(
    app: Any, path: str = "/", http_version: str = "1.1", **more: Any
) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(dict(message))

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": http_version,
        "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "headers": [],
        "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80), **more,
    }  # fmt: skip
    await app(scope, receive, send)
    return sent


def header(messages: list[dict[str, Any]], name: bytes) -> bytes | None:
    for key, value in messages[0].get("headers", []):
        if key == name:
            return bytes(value)
    return None


async def test_health_endpoints_follow_the_phases() -> None:
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    app = GracefulMiddleware(hello, coordinator=c, prestop_path="/prestop")
    assert (await call(app, "/readyz"))[0]["status"] == 200
    assert (await call(app, "/livez"))[0]["status"] == 200
    assert c.statistics().requests_total == 0  # probes are not counted as requests
    c.request_shutdown("test")
    ready = await call(app, "/readyz")
    assert ready[0]["status"] == 503
    assert ready[1]["body"] == b"shutting down (accepting)\n"
    assert (await call(app, "/livez"))[0]["status"] == 200


async def test_nudges_http1_but_never_http2() -> None:
    c = ShutdownCoordinator(policy=RefuseImmediately())
    app = GracefulMiddleware(hello, coordinator=c)
    assert header(await call(app), b"connection") == b"keep-alive"
    c.request_shutdown("test")
    assert c.nudging
    assert header(await call(app), b"connection") == b"close"
    assert header(await call(app, http_version="2"), b"connection") == b"keep-alive"


async def test_handlers_see_the_drain_signal() -> None:
    c = ShutdownCoordinator(policy=RefuseImmediately())
    app = GracefulMiddleware(hello, coordinator=c)
    assert (await call(app))[1]["body"] == b"hello"
    c.request_shutdown("test")  # refuse-immediately drains as soon as run() decides
    async with anyio.create_task_group() as tg:
        tg.start_soon(c.run)
        assert await c.wait_for_phase(Phase.DRAINING, timeout_s=5)
        assert (await call(app))[1]["body"] == b"draining"
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("extensions", [None, {}, {"http.response.trailers": {}}])
async def test_the_drain_signal_joins_whatever_extensions_the_server_gave(
    extensions: dict[str, Any] | None,
) -> None:
    """A server's own extensions are kept; ``None`` (some test harnesses send it) is
    replaced by a dict."""
    seen: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(dict(scope["extensions"]))
        await hello(scope, receive, send)

    given = None if extensions is None else dict(extensions)  # the server's, this request's
    wrapped = GracefulMiddleware(app, coordinator=ShutdownCoordinator())
    assert (await call(wrapped, extensions=given))[1]["body"] == b"hello"
    assert isinstance(seen[0].pop("graceful"), DrainSignal)
    assert seen[0] == (extensions or {})


async def test_lifespan_passes_through_and_readiness_waits_for_startup() -> None:
    c = ShutdownCoordinator()
    started = anyio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            assert (await receive())["type"] == "lifespan.startup"
            await started.wait()
            await send({"type": "lifespan.startup.complete"})

    wrapped = GracefulMiddleware(app, coordinator=c)
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wrapped, {"type": "lifespan"}, receive, send)
        await anyio.wait_all_tasks_blocked()
        assert (await call(wrapped, "/readyz"))[0]["status"] == 503
        started.set()
    assert messages == [{"type": "lifespan.startup.complete"}]
    assert (await call(wrapped, "/readyz"))[0]["status"] == 200


async def test_works_as_starlette_middleware() -> None:
    c = ShutdownCoordinator()

    async def hi(request: Any) -> PlainTextResponse:
        return PlainTextResponse("hi")

    app = Starlette(
        routes=[Route("/", hi)],
        middleware=[Middleware(GracefulMiddleware, coordinator=c, readiness_path="/ready")],
    )
    assert (await call(app, "/"))[1]["body"] == b"hi"
    assert (await call(app, "/ready"))[0]["status"] == 200
    assert c.statistics().requests_total == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"readiness_path": "ready"}, "readiness_path must be a path starting with '/'"),
        ({"websocket_close_grace_s": -1}, "websocket_close_grace_s must be a finite"),
        ({"coordinator": object()}, "coordinator must be a graceful.ShutdownCoordinator"),
    ],
)
def test_bad_options_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    options: dict[str, Any] = {"coordinator": ShutdownCoordinator(), **kwargs}
    with pytest.raises((TypeError, ValueError), match=message):
        GracefulMiddleware(hello, **options)


def test_drain_signal_is_shared_and_typed() -> None:
    assert drain_signal({"type": "http"}) is None
    c = ShutdownCoordinator()
    signal = DrainSignal(c)
    assert drain_signal({"extensions": {"graceful": signal}}) is signal
    assert drain_signal({"state": {"graceful": signal}}) is signal  # the lifespan state
    assert drain_signal({"state": {"graceful": "an app's own"}, "extensions": None}) is None
    assert signal.time_left_s() is None


async def test_lifespan_state_carries_the_drain_signal() -> None:
    """The middleware puts its DrainSignal in the lifespan state, which servers copy
    into every request's scope (graceful's uvicorn server reads nothing else on its hot
    path); an app's own state keys are kept."""
    c = ShutdownCoordinator()
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.update(scope["state"])
        await receive()
        await send({"type": "lifespan.startup.complete"})

    wrapped = GracefulMiddleware(app, coordinator=c)
    state: dict[str, Any] = {"db": "the app's"}

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: dict[str, Any]) -> None:
        pass

    await wrapped({"type": "lifespan", "state": state}, receive, send)
    assert state == seen == {"db": "the app's", "graceful": wrapped.drain_signal}
    assert drain_signal({"type": "http", "state": dict(state)}) is wrapped.drain_signal


async def test_metrics_path_serves_the_coordinators_metrics_uncounted() -> None:
    import graceful.metrics

    c = ShutdownCoordinator()
    graceful.metrics.register(c)  # the default registry, as the middleware uses
    try:
        app = GracefulMiddleware(hello, coordinator=c, metrics_path="/metrics")
        messages = await call(app, "/metrics")
        assert messages[0]["status"] == 200
        body = b"".join(m.get("body", b"") for m in messages[1:]).decode()
        assert 'graceful_phase{phase="serving"} 1.0' in body
        assert c.statistics().requests_total == 0  # not counted as a request
        with pytest.raises(ValueError, match="metrics_path must be a path starting with '/'"):
            GracefulMiddleware(hello, coordinator=c, metrics_path="metrics")
        with pytest.raises(ValueError, match="already used"):
            GracefulMiddleware(hello, coordinator=c, metrics_path="/readyz")
    finally:
        graceful.metrics.unregister()
    graceful.metrics.register(ShutdownCoordinator())  # another coordinator may come now
    graceful.metrics.unregister()
    graceful.metrics.unregister()  # nothing left: harmless
