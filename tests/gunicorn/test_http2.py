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
