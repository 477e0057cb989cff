"""gunicorn's own HTTP/2 (27+: ``--http-protocols h2,h1``) under graceful's
``ThreadWorker``: when nudging begins every HTTP/2 connection gets a GOAWAY naming the
last stream it received — an idle one at once, a busy one right after its last response
— and is closed, so the worker drains instead of waiting for the deadline; stock
``gthread`` sends a busy connection none.  A frame-level client (h2c, prior knowledge),
httpx, and TLS with ALPN.  Every wait is on a log line, a frame or an exit."""

from __future__ import annotations

import signal
import sys
from typing import Any

import pytest

from tests.cli.test_cli_servers import certificate  # noqa: F401 (a fixture)
from tests.support.hypercorn_apps.h2frames import RawH2
from tests.support.servers import ServerProcess, h2_tls_request_across_sigterm

pytest.importorskip("gunicorn")
httpx = pytest.importorskip("httpx")

from graceful.gunicorn._http2 import SEAMS  # noqa: E402

pytestmark = pytest.mark.skipif(not SEAMS, reason="gunicorn before 27 (its HTTP/2 differs)")

FLASK = "tests.support.wsgi_apps.flask_app:app"
LISTENING = r"Listening at: https?://127\.0\.0\.1:(\d+)"
DRAINED = r"draining -> stopping: drained"


@pytest.fixture
def h2_servers() -> Any:
    started: list[ServerProcess] = []
    yield started
    RawH2.close_all()
    for server in started:
        server.stop()


def start(
    started: list[ServerProcess], *options: str, worker: str = "graceful.gunicorn.ThreadWorker"
) -> ServerProcess:
    server = ServerProcess(
        [sys.executable, "-m", "gunicorn", "-k", worker, "--threads", "4",
         "--http-protocols", "h2,h1", "--http2-cleartext", "prior-knowledge",
         "-b", "127.0.0.1:0", "--graceful-timeout", "8", *options, FLASK],
        env={"GRACEFUL_POLICY": "accept-until-idle", "GRACEFUL_IDLE": "1"},
    )  # fmt: skip
    started.append(server)
    server.port = int(server.wait_for_line(LISTENING, timeout_s=20).group(1))
    return server


@pytest.mark.parametrize("worker", ["graceful.gunicorn.ThreadWorker", "gthread"])
def test_busy_and_idle_http2_connections_get_goaway(
    h2_servers: list[ServerProcess], worker: str
) -> None:
    server = start(h2_servers, worker=worker)
    idle = RawH2(server.port)
    assert idle.response(idle.request("/"))[0] == 200
    busy = RawH2(server.port)
    slow = busy.request("/slow?s=2")  # stream 1
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    assert busy.response(slow) == (200, b"slow done after 2 s\n")
    busy.wait("eof")
    assert not [e for e in busy.events if e.startswith("rst")], busy
    if worker == "gthread":
        # Stock: the busy connection is closed with no GOAWAY (what this fixes).
        assert busy.events == ["end 1", "eof"], busy
        assert server.wait_exit(timeout_s=20) == 0
        return
    # graceful: the idle connection is told at once (nudging), the busy one right after
    # its response; each GOAWAY names the last stream, then the connection is closed.
    idle.wait("eof")
    assert idle.events == ["end 1", "goaway 1", "eof"], idle
    assert busy.events == ["end 1", "goaway 1", "eof"], busy
    assert {g.error_code for g in (*idle.goaways, *busy.goaways)} == {0}
    assert server.wait_exit(timeout_s=20) == 0
    assert server.has_line(DRAINED), server.output()
    assert not server.has_line(r"Traceback|\[ERROR\]"), server.output()


def test_a_connection_opened_while_nudging_is_served_first(
    h2_servers: list[ServerProcess],
) -> None:
    """A connection that comes while accepting (nudging) is served its first stream
    before its GOAWAY: a client is never sent away unserved."""
    server = start(h2_servers, "--keep-alive", "10", "--graceful-timeout", "12")
    keep = RawH2(server.port)
    slow = keep.request("/slow?s=3")  # holds the worker's drain open
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    server.wait_for_line(r"serving -> accepting")
    late = RawH2(server.port)
    assert late.response(late.request("/")) == (200, b"hello from -\n")
    late.wait("eof")
    assert late.events[:2] == ["end 1", "goaway 1"], late
    assert keep.response(slow)[0] == 200
    assert server.wait_exit(timeout_s=20) == 0


def test_tls_alpn_h2_request_in_flight_completes_then_goaway(
    h2_servers: list[ServerProcess],
    certificate: tuple[str, str],  # noqa: F811 (the fixture)
) -> None:
    cert, key = certificate
    server = start(h2_servers, "--certfile", cert, "--keyfile", key)
    response = h2_tls_request_across_sigterm(server, cert, "/slow?s=2")
    assert (response.http_version, response.status_code) == ("HTTP/2", 200)
    assert server.wait_exit(timeout_s=20) == 0
    assert server.has_line(DRAINED), server.output()


# ------------------------------------------------------------------- the exit's cut


@pytest.mark.parametrize("worker", ["graceful.gunicorn.ThreadWorker", "gthread"])
def test_a_stream_running_at_the_exit_gets_an_http2_503_and_goaway(
    h2_servers: list[ServerProcess], worker: str
) -> None:
    """A stream whose response has not started when the exit deadline comes is answered
    in HTTP/2 — 503, then GOAWAY naming it — and nothing else reaches the client (no
    HTTP/1.1 bytes, nothing left unparsed).  Stock ``gthread``: the master's SIGKILL
    ends the worker and the client gets a bare EOF."""
    server = start(h2_servers, "--graceful-timeout", "3", worker=worker)
    client = RawH2(server.port)
    stream = client.request("/slow?s=30")
    server.wait_for_line(r"slow request started")
    server.signal(signal.SIGTERM)
    client.wait("eof", timeout_s=15)
    assert client._buffer == b"", client  # every byte was a whole frame
    if worker == "gthread":
        assert client.events == ["eof"], client
        assert client.streams[stream].status is None
        server.wait_exit(timeout_s=20)
        return
    assert client.response(stream) == (503, b"server shutting down\n")
    assert client.events == [f"end {stream}", f"goaway {stream}", "eof"], client
    assert [g.error_code for g in client.goaways] == [0]
    assert server.wait_exit(timeout_s=20) == 0
    assert server.has_line(r"still alive at the last moment before SIGKILL.*1 request answered 503")


@pytest.mark.parametrize("worker", ["graceful.gunicorn.ThreadWorker", "gthread"])
def test_a_connection_waiting_for_a_thread_at_the_exit_gets_goaway_naming_no_stream(
    h2_servers: list[ServerProcess], worker: str
) -> None:
    """``--threads 1``: an HTTP/2 connection still waiting for a thread at the exit gets
    the server's SETTINGS and GOAWAY naming stream 0 (none of its streams was
    processed: a client retries them elsewhere), not an HTTP/1.1 503.  Stock: EOF."""
    server = start(h2_servers, "--graceful-timeout", "3", "--threads", "1", worker=worker)
    busy = RawH2(server.port)
    busy.request("/slow?s=30")  # the one thread, for the connection's life
    server.wait_for_line(r"slow request started")
    waiting = RawH2(server.port)
    stream = waiting.request("/")
    server.signal(signal.SIGTERM)
    waiting.wait("eof", timeout_s=15)
    assert waiting._buffer == b"", waiting
    assert waiting.streams[stream].status is None
    if worker == "gthread":
        assert waiting.events == ["eof"], waiting
        server.wait_exit(timeout_s=20)
        return
    assert waiting.events == ["goaway 0", "eof"], waiting
    assert [g.error_code for g in waiting.goaways] == [0]
    assert server.wait_exit(timeout_s=20) == 0
    assert server.has_line(r"2 requests answered 503"), server.output()


def test_the_start_up_check_knows_gunicorns_http2_connection() -> None:
    """The names graceful reads of gunicorn's HTTP/2 connection (docs/adapters.md) are
    all on the installed gunicorn's; an object without them lacks every one (the
    worker then keeps gunicorn's own HTTP/2 handling, with one warning)."""
    from gunicorn.config import Config
    from gunicorn.http2.connection import HTTP2ServerConnection

    from graceful.gunicorn._http2 import CONNECTION_NAMES, missing

    assert missing(HTTP2ServerConnection(Config(), None, ("127.0.0.1", 1))) == []
    assert missing(object()) == list(CONNECTION_NAMES)
