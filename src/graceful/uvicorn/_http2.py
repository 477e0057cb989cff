"""uvicorn's own HTTP/2 (zttp: ``--http zttp --http2``) at a shutdown: GOAWAY.

uvicorn's ``--http2`` dispatcher (``AutoZttpProtocol``) hands each connection to zttp's
HTTP/1.1 or HTTP/2 protocol, which add themselves to ``server_state.connections``.
zttp's HTTP/2 protocol (``ZttpH2Protocol``) has no public way to say "go away after the
streams in flight" other than its ``shutdown()``, which is uvicorn's stop: GOAWAY at
once.  So ``Http2GoAway`` reads a few of its names (``ZTTP_H2_NAMES``,
``ZTTP_CONNECTION_NAMES``; docs/adapters.md, "Private names each adapter reads"), and
checks them once, at start-up, on a protocol made as the dispatcher makes it
(``check``): a uvicorn whose protocol lacks any gets one warning naming them and its
version, and its HTTP/2 connections are left to uvicorn (zttp's own ``shutdown`` when
draining, like an idle HTTP/1.1 connection) instead of failing mid-shutdown.

Why a busy connection gets its GOAWAY only after its last response, not at once and not
twice (2^31-1, then the last stream, as RFC 9113 §6.8 suggests): ``h2``-based clients
(httpx) fail a response still arriving when any GOAWAY comes (docs/uvicorn.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final

import uvicorn
from typing_extensions import final

from .._core.coordinator import ShutdownCoordinator

__all__ = (
    "POLL_S",
    "ZTTP_CONNECTION_NAMES",
    "ZTTP_H2_NAMES",
    "Http2GoAway",
    "missing",
    "zttp_http2_class",
)

logger = logging.getLogger("graceful")

#: What ``Http2GoAway`` reads of zttp's HTTP/2 protocol: ``cycles``, a dict of the
#: streams in flight by id; ``conn``, its zttp connection; ``transport``; ``shutdown()``
#: (GOAWAY, closed when idle, else after the last stream); ``shutdown_requested``
#: (written: closed after its last stream); ``flush()`` (writes what zttp queued).
ZTTP_H2_NAMES: Final = ("cycles", "conn", "transport", "shutdown_requested", "shutdown", "flush")
#: What it reads of the zttp connection: ``close()`` queues GOAWAY naming the highest
#: stream received (zttp still sends the responses of the streams it names).
ZTTP_CONNECTION_NAMES: Final = ("close",)
#: How often a busy HTTP/2 connection waiting for its GOAWAY is looked at, s.
POLL_S: Final = 0.02


def zttp_http2_class(protocol_class: type[Any]) -> type[Any] | None:
    """zttp's HTTP/2 protocol class if ``protocol_class`` is uvicorn's ``--http2``
    dispatcher (``AutoZttpProtocol``), else ``None``; ``object`` if the dispatcher's
    module no longer names it (the check then says so)."""
    try:
        from uvicorn.protocols.http import auto_zttp_impl
    except ImportError:  # uvicorn before zttp, or zttp not installed
        return None
    if not issubclass(protocol_class, auto_zttp_impl.AutoZttpProtocol):
        return None
    h2_class: type[Any] = getattr(auto_zttp_impl, "ZttpH2Protocol", object)
    return h2_class


def missing(protocol: Any) -> list[str]:
    """The names ``Http2GoAway`` reads that ``protocol`` (zttp's HTTP/2 protocol, made
    but not connected) lacks."""
    absent = [name for name in ZTTP_H2_NAMES if not hasattr(protocol, name)]
    if "cycles" not in absent and not isinstance(protocol.cycles, dict):
        absent.append("cycles (a dict by stream id)")
    if "conn" not in absent:
        absent += [f"conn.{n}" for n in ZTTP_CONNECTION_NAMES if not hasattr(protocol.conn, n)]
    return absent


@final
class Http2GoAway:
    """A server's zttp HTTP/2 connections told to go away (``goaway``), once ``check``
    found the names it reads."""

    def __init__(
        self,
        coordinator: ShutdownCoordinator,
        loop: Callable[[], asyncio.AbstractEventLoop | None],
    ) -> None:
        self.coordinator = coordinator
        self.loop = loop  # the server's loop, once it serves
        #: zttp's HTTP/2 protocol class, once ``check`` passed; ``None``: none of ours.
        self.protocol_class: type[Any] | None = None
        #: Busy connections waiting for their GOAWAY: the highest stream seen.
        self.busy: dict[Any, int] = {}

    def check(self, config: uvicorn.Config, server_state: Any) -> None:
        """At start-up, if ``config`` serves zttp's HTTP/2: make its protocol as the
        dispatcher does (not connected) and check every name ``goaway`` reads; if any
        is absent, one warning, and its connections stay uvicorn's."""
        h2_class = zttp_http2_class(config.http_protocol_class)
        if h2_class is None:
            return
        try:
            protocol = h2_class(
                config=config, server_state=server_state, app_state={}, _loop=self.loop()
            )
        except Exception as exc:  # a constructor that changed is a missing name too
            absent = [f"ZttpH2Protocol(config, server_state, app_state, _loop) ({exc!r})"]
        else:
            absent = missing(protocol)
        if absent:
            logger.warning(
                "uvicorn %s's zttp HTTP/2 protocol lacks %s: its HTTP/2 connections are "
                "left to uvicorn (no GOAWAY when nudging; zttp's own shutdown at draining)",
                uvicorn.__version__,
                ", ".join(absent),
            )
            return
        self.protocol_class = h2_class

    def handles(self, connection: Any) -> bool:
        """Whether ``connection`` is zttp's HTTP/2 protocol, its names checked."""
        return self.protocol_class is not None and isinstance(connection, self.protocol_class)

    def goaway(self, connection: Any) -> None:
        """An HTTP/2 connection told to go away (RFC 9113 §6.8), as graceful's hypercorn
        does (docs/hypercorn.md, "HTTP/2 and GOAWAY"): an idle one gets GOAWAY naming
        its last stream and is closed at once (uvicorn's ``shutdown``); a busy one right
        after its last response in flight, and the streams it opens meanwhile are
        served.  While draining, one that keeps opening streams while others run gets
        it at once (zttp still serves the streams it names), or it would never go.
        """
        transport = connection.transport
        if transport is None or transport.is_closing() or connection in self.busy:
            return
        if not connection.cycles:
            connection.shutdown()
            return
        self.busy[connection] = max(connection.cycles)
        self._watch(connection)

    def _watch(self, connection: Any) -> None:
        seen = self.busy.get(connection)
        loop = self.loop()
        if seen is None or loop is None or connection.transport.is_closing():
            self.busy.pop(connection, None)
            return
        if not connection.cycles:  # its last response went out: GOAWAY, closed
            del self.busy[connection]
            connection.shutdown()
            return
        highest = max(connection.cycles)
        if (
            highest > seen
            and len(connection.cycles) > 1
            and self.coordinator.draining
            and not connection.shutdown_requested
        ):
            connection.conn.close()  # GOAWAY now, naming the highest stream received
            connection.flush()
            connection.shutdown_requested = True  # closed once its last stream ends
        self.busy[connection] = max(highest, seen)
        loop.call_later(POLL_S, self._watch, connection)
