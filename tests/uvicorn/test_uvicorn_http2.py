"""uvicorn's own HTTP/2 (``--http zttp --http2``) at a rolling restart: every HTTP/2
connection is told to go away when nudging begins — GOAWAY naming the last stream it
will serve, idle ones closed at once, busy ones after their last response — and zttp's
HTTP/1.1 connections are closed like uvicorn's others, so the server leaves right after
the last response in flight instead of at the deadline.  h2c (prior knowledge) on a
frame-level client and on httpx, and TLS with ALPN.  Every wait is on a log line, a
frame or an exit."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import sys
import time
from collections import UserDict
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from tests.cli.test_cli_servers import certificate  # noqa: F401 (a fixture)
from tests.support.hypercorn_apps.h2frames import RawH2
from tests.support.servers import RawHTTP, ServerProcess, h2_tls_request_across_sigterm

pytest.importorskip("uvicorn.protocols.http.zttp_h2_impl", reason="uvicorn before zttp")
httpx = pytest.importorskip("httpx")

from uvicorn.protocols.http.zttp_h2_impl import ZttpH2Protocol  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from graceful import ShutdownCoordinator  # noqa: E402
from graceful.uvicorn._http2 import Http2GoAway, missing  # noqa: E402

RUNNING = r"running on https?://127\.0\.0\.1:(\d+)"
ACCEPTING = r"serving -> accepting"
DRAINING = r"accepting -> draining"
#: The drain ended because nothing was left, not at its deadline (how soon after the
#: last response is a benchmark's figure, not a test's: docs/uvicorn.md).
DRAINED = r"draining -> stopping: drained \(0 connections"


@pytest.fixture
def h2_servers() -> Any:
    started: list[ServerProcess] = []
    yield started
    RawH2.close_all()
    RawHTTP.close_all()
    for server in started:
        server.stop()


def start(
    started: list[ServerProcess],
    *options: str,
    app: str = "examples.asgi_app:app",
    env: dict[str, str] | None = None,
) -> ServerProcess:
    server = ServerProcess(
        [sys.executable, "-m", "graceful", "run", app, "--port", "0",
         "--http", "zttp", "--http2", "--grace-period", "6", *options],
        env=env,
    )  # fmt: skip
    started.append(server)
    server.port = int(server.wait_for_line(RUNNING).group(1))
    return server


def left_when_drained(server: ServerProcess) -> bool:
    """The server exited 0, its drain ended by itself (nothing left), not at the
    deadline."""
    assert server.wait_exit() == 0, server.output()
    return server.has_line(DRAINED) and not server.has_line(r"deadline reached")


@pytest.mark.parametrize(
    "options",
    [["--policy", "accept-until-idle", "--idle", "1"], ["--policy", "refuse-immediately"]],
    ids=["accept-until-idle", "refuse-immediately"],
)
def test_busy_and_idle_http2_connections_go_away_and_the_server_leaves_after_the_last(
    h2_servers: list[ServerProcess], options: list[str]
) -> None:
    server = start(h2_servers, *options)
    idle = RawH2(server.port)
    assert idle.response(idle.request("/")) == (200, b"hello\n")
    busy = RawH2(server.port)
    assert busy.response(busy.request("/")) == (200, b"hello\n")
    slow = busy.request("/slow?s=2")  # stream 3
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    # The idle connection: GOAWAY naming its last stream, then closed, at once.
    idle.wait("eof", timeout_s=2)
    assert idle.events == ["end 1", "goaway 1", "eof"], idle
    assert (idle.goaways[0].last_stream_id, idle.goaways[0].error_code) == (1, 0)
    # The busy one: its response in flight completes, then GOAWAY naming stream 3 (an
    # h2-based client fails a response still arriving when a GOAWAY comes), closed.
    assert busy.response(slow) == (200, b"slept 2\n")
    busy.wait("eof")
    assert busy.events[:3] == ["end 1", "end 3", "goaway 3"], busy
    assert not [e for e in busy.events if e.startswith("rst")], busy
    assert {g.last_stream_id for g in busy.goaways} == {3}, busy
    assert left_when_drained(server), server.output()


def test_httpx_http2_client_moves_to_a_new_connection_while_accepting(
    h2_servers: list[ServerProcess],
) -> None:
    """accept-until-idle nudges: httpx's HTTP/2 connection is told to go away, and its
    next request opens a new one, still served here; nothing fails."""
    server = start(h2_servers, "--policy", "accept-until-idle", "--idle", "2")
    url = f"http://127.0.0.1:{server.port}/"
    with httpx.Client(http1=False, http2=True, timeout=15) as client:
        assert client.get(url).http_version == "HTTP/2"
        server.signal(signal.SIGTERM)
        server.wait_for_line(ACCEPTING)
        statuses = []
        for _ in range(5):  # bounded: a request every 0.1 s while accepting
            response = client.get(url)
            statuses.append((response.http_version, response.status_code))
            time.sleep(0.1)
        assert set(statuses) == {("HTTP/2", 200)}, statuses
    assert not server.has_line(DRAINING) or server.has_line(r"no new connection for 2 s")
    assert server.wait_exit() == 0


def test_zttp_http1_keep_alive_is_closed_and_the_server_leaves_after_the_last(
    h2_servers: list[ServerProcess],
) -> None:
    """zttp's HTTP/1.1 protocol (the dispatcher's other half): an idle keep-alive
    connection is closed at draining, and the server leaves right after the request in
    flight (it waited for the deadline before)."""
    server = start(h2_servers, "--policy", "accept-until-idle", "--idle", "1")
    idle = RawHTTP(server.port)
    assert idle.get("/")[0] == 200
    busy = RawHTTP(server.port)
    busy.send("/slow?s=2")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    status, headers, _ = busy.response()
    assert (status, headers.get("connection")) == (200, "close")
    assert idle.closed_by_peer()
    assert left_when_drained(server), server.output()


def test_tls_with_alpn_h2_goes_away_too(
    h2_servers: list[ServerProcess],
    certificate: tuple[str, str],  # noqa: F811 (the fixture)
) -> None:
    """h2 negotiated by ALPN over TLS: the request in flight completes on HTTP/2, the
    connection goes away after it, and the server leaves right after."""
    cert, key = certificate
    server = start(
        h2_servers,
        # asyncio's own TLS transport: uvloop (the default when installed) hid a crash
        # at the exit on it
        "--loop",
        "asyncio",
        "--ssl-certfile",
        cert,
        "--ssl-keyfile",
        key,
        "--policy",
        "refuse-immediately",
    )
    response = h2_tls_request_across_sigterm(server, cert, "/slow?s=2")
    assert (response.http_version, response.status_code, response.text) == (
        "HTTP/2",
        200,
        "slept 2\n",
    )
    assert left_when_drained(server), server.output()


# ------------------------------------------------------------- the start-up check

#: The start-up check's warning (``graceful.uvicorn._http2.Http2GoAway.check``).
LACKS = r"zttp HTTP/2 protocol lacks"


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def checked(http: str, loop: asyncio.AbstractEventLoop, *, http2: bool = True) -> Http2GoAway:
    """``Http2GoAway.check`` on uvicorn's own configuration of ``examples.asgi_app``."""
    config = uvicorn.Config("examples.asgi_app:app", http=http, http2=http2)  # type: ignore[arg-type]
    config.load()
    goaway = Http2GoAway(ShutdownCoordinator(), lambda: loop)
    goaway.check(config, ServerState())
    return goaway


def test_the_start_up_check_knows_uvicorns_zttp_http2_protocol(
    loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn's own objects: the protocol its ``--http2`` dispatcher makes has every
    name graceful reads; without ``--http2`` (or zttp) there is nothing to check."""
    protocol = ZttpH2Protocol(
        config=uvicorn.Config("examples.asgi_app:app", http="zttp", http2=True),
        server_state=ServerState(),
        app_state={},
        _loop=loop,
    )
    assert missing(protocol) == []
    with caplog.at_level(logging.WARNING, logger="graceful"):
        assert checked("zttp", loop).protocol_class is ZttpH2Protocol
        assert checked("zttp", loop, http2=False).protocol_class is None
        assert checked("h11", loop, http2=False).protocol_class is None
    assert not caplog.records


@pytest.mark.parametrize("change", ["flush", "conn.close", "cycles", "constructor"])
def test_the_start_up_check_names_what_uvicorn_changed_and_keeps_its_own_handling(
    loop: asyncio.AbstractEventLoop,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    change: str,
) -> None:
    """uvicorn's protocol changed on purpose: one warning naming what is absent and
    uvicorn's version; no HTTP/2 connection is graceful's then (no GOAWAY of ours)."""
    init = ZttpH2Protocol.__init__
    if change == "flush":
        monkeypatch.delattr(ZttpH2Protocol, "flush")
        said = "flush"
    elif change == "conn.close":

        class Closeless:
            """A zttp connection without ``close``."""

        def without_close(self: ZttpH2Protocol, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.conn = Closeless()  # type: ignore[assignment]

        monkeypatch.setattr(ZttpH2Protocol, "__init__", without_close)
        said = "conn.close"
    elif change == "cycles":

        def user_dict(self: ZttpH2Protocol, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.cycles = UserDict()  # type: ignore[assignment]

        monkeypatch.setattr(ZttpH2Protocol, "__init__", user_dict)
        said = "cycles (a dict by stream id)"
    else:

        def positional(self: ZttpH2Protocol, config: Any, server_state: Any, /) -> None:
            init(self, config, server_state, {})

        monkeypatch.setattr(ZttpH2Protocol, "__init__", positional)
        said = "ZttpH2Protocol(config, server_state, app_state, _loop)"
    with caplog.at_level(logging.WARNING, logger="graceful"):
        goaway = checked("zttp", loop)
    assert goaway.protocol_class is None
    assert not goaway.handles(object.__new__(ZttpH2Protocol))
    [record] = caplog.records
    assert f"uvicorn {uvicorn.__version__}'s" in record.getMessage()
    assert said in record.getMessage()


@pytest.mark.parametrize("change", ["", "cycles"], ids=["intact", "cycles"])
def test_a_changed_zttp_is_left_its_own_http2_shutdown(
    h2_servers: list[ServerProcess], change: str
) -> None:
    """A real server whose zttp keeps its streams otherwise (``tests/uvicorn/
    zttp_changed.py``): one warning at start-up, HTTP/2 served as before, and at SIGTERM
    zttp's own shutdown ends the busy connection after its response (GOAWAY, closed);
    the server exits 0 without a traceback.  Intact: no warning, graceful's GOAWAY."""
    server = start(
        h2_servers,
        *("--policy", "refuse-immediately"),
        app="tests.uvicorn.zttp_changed:app",
        env={"ZTTP_CHANGE": change},
    )
    # The check runs before uvicorn listens: its line comes before the one start() waited for.
    assert server.has_line(LACKS) is bool(change)
    if change:
        assert server.has_line(rf"uvicorn {re.escape(uvicorn.__version__)}'s .*lacks cycles")
    busy = RawH2(server.port)
    assert busy.response(busy.request("/")) == (200, b"hello\n")
    slow = busy.request("/slow?s=1")  # stream 3
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    assert busy.response(slow) == (200, b"slept 1\n")
    busy.wait("eof")
    assert busy.events[:3] == ["end 1", "end 3", "goaway 3"], busy
    assert server.wait_exit() == 0
    output = server.output()
    assert output.count("lacks") == (1 if change else 0), output
    assert "Traceback" not in output, output
