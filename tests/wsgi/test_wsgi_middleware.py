"""graceful.wsgi without a server: a CoordinatorThread and the middleware, as another
WSGI server would drive them (the gunicorn workers are tested in tests/gunicorn/)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from graceful import Phase, RefuseImmediately, ShutdownCoordinator
from graceful.wsgi import CoordinatorThread, GracefulMiddleware, drain_signal


def hello(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    signal = drain_signal(environ)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [f"draining={signal is not None and signal.draining}".encode()]


class Call:
    def __init__(self, app: Any, path: str) -> None:
        self.status = ""
        self.headers: list[tuple[str, str]] = []
        result = app({"PATH_INFO": path, "REMOTE_ADDR": "127.0.0.1", "REMOTE_PORT": "1"},
                     self.start_response)  # fmt: skip
        self.body = b"".join(result)
        close = getattr(result, "close", None)
        if close is not None:
            close()

    def start_response(self, status: str, headers: list[tuple[str, str]], *exc: Any) -> None:
        self.status, self.headers = status, headers


@pytest.fixture
def running() -> Iterator[tuple[CoordinatorThread, GracefulMiddleware]]:
    thread = CoordinatorThread(ShutdownCoordinator(policy=RefuseImmediately()))
    app = GracefulMiddleware(hello, thread)
    thread.start()
    yield thread, app
    thread.request_shutdown("test over", escalate=False)  # ignored if stopped already
    assert thread.join(10)


def test_endpoints_drain_signal_and_shutdown(
    running: tuple[CoordinatorThread, GracefulMiddleware],
) -> None:
    thread, app = running
    assert Call(app, "/readyz").status == "200 OK"
    assert Call(app, "/livez").body == b"alive (serving)\n"
    assert Call(app, "/").body == b"draining=False"
    thread.request_shutdown("SIGTERM")
    assert thread.wait_for_phase(Phase.STOPPED, 10)  # nothing in flight: drained at once
    ready = Call(app, "/readyz")
    assert ready.status.startswith("503")
    assert ("Connection", "close") in ready.headers
    assert Call(app, "/").body == b"draining=True"
    assert Call(app, "/livez").status.startswith("503")


def test_a_request_in_flight_holds_the_drain(
    running: tuple[CoordinatorThread, GracefulMiddleware],
) -> None:
    """The request counts until the server closes its response iterable."""
    thread, app = running
    result = app({"PATH_INFO": "/"}, lambda status, headers, *exc: None)
    thread.request_shutdown("SIGTERM")
    assert thread.wait_for_phase(Phase.DRAINING, 10)
    assert not thread.wait_for_phase(Phase.STOPPING, 0.2)  # still in flight
    result.close()
    assert thread.wait_for_phase(Phase.STOPPED, 10)


def test_bad_arguments_name_the_value() -> None:
    thread = CoordinatorThread(ShutdownCoordinator())
    with pytest.raises(TypeError, match="WSGI callable"):
        GracefulMiddleware("app", thread)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="readiness_path must be a path"):
        GracefulMiddleware(hello, thread, readiness_path="readyz")
    with pytest.raises(TypeError, match="coordinator must be a ShutdownCoordinator"):
        CoordinatorThread(object())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"before start\(\)"):
        thread.request_shutdown("SIGTERM")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_coordinator_thread_leaves_the_process_signals_to_the_main_thread(
    running: tuple[CoordinatorThread, GracefulMiddleware],
) -> None:
    """A SIGTERM the kernel gave the coordinator's thread would not interrupt the main
    thread's sleep in the app (a sync worker would hear of it after the request)."""
    thread, _ = running
    assert thread._thread is not None
    tid = thread._thread.native_id
    with open(f"/proc/self/task/{tid}/status", encoding="ascii") as status:
        blocked = int(next(line for line in status if line.startswith("SigBlk:")).split()[1], 16)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        assert blocked & (1 << (sig - 1)), f"{sig.name} not blocked in the coordinator thread"
    main = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.SIGTERM not in main  # the calling (main) thread is left as it was
