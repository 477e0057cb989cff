"""Closing a listener without resetting the connections in its accept backlog.

Closing a listening socket makes the kernel reset every connection that completed its
handshake but was not yet ``accept()``-ed: those clients already sent a request and get
``ECONNRESET``, which is not safe to retry.  So before an :class:`asyncio.Server` is
closed we accept everything in the backlog through a duplicate of the listening file
descriptor (the socket stays open while the event loop's own reader is removed), close the
server, accept once more, and only then close the duplicate.  The accepted sockets are
handed to the loop with ``connect_accepted_socket`` and served like any other connection;
a connection attempt after that is refused, which a client can always retry.

When the listening socket is shared with other processes (gunicorn workers), closing our
copy does not close the socket at all; accepting the backlog then only serves a few
connections a sibling would otherwise have taken, which is harmless.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._coordinator import ShutdownCoordinator

__all__ = ("close_keeping_backlog",)

logger = logging.getLogger("graceful")


def _accept_all(listeners: list[socket.socket]) -> list[socket.socket]:
    accepted: list[socket.socket] = []
    for listener in listeners:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # BlockingIOError: backlog empty
                break
            sock.setblocking(False)
            accepted.append(sock)
    return accepted


def close_keeping_backlog(
    servers: Iterable[asyncio.AbstractServer],
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    loop: asyncio.AbstractEventLoop,
    coordinator: ShutdownCoordinator,
    *,
    extra_sockets: Iterable[socket.socket] = (),
) -> list[asyncio.Task[object]]:
    """Close ``servers`` (and ``extra_sockets``); serve the backlog with ``protocol_factory``.

    Each backlog socket counts as an open connection from the moment it is accepted
    until its protocol took over, so the coordinator cannot declare the drain done while
    the hand-over is still under way.

    Returns:
        The tasks connecting the accepted backlog sockets (already scheduled).
    """
    servers = list(servers)
    extra = list(extra_sockets)
    dups: list[socket.socket] = []
    for listening in [s for server in servers for s in (server.sockets or ())] + extra:  # type: ignore[attr-defined]
        try:
            dup = socket.socket(fileno=os.dup(listening.fileno()))
        except OSError:
            continue
        dup.setblocking(False)
        dups.append(dup)
    backlog = _accept_all(dups)
    for server in servers:
        server.close()  # the loop stops reading; the dups keep the sockets listening
    for sock in extra:
        sock.close()
    backlog += _accept_all(dups)  # whatever completed its handshake meanwhile
    for dup in dups:
        dup.close()
    if backlog:
        logger.debug("serving %d connections from the accept backlog", len(backlog))
    for _ in backlog:
        coordinator.connection_opened()
    return [loop.create_task(_serve(loop, protocol_factory, sock, coordinator)) for sock in backlog]


async def _serve(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    sock: socket.socket,
    coordinator: ShutdownCoordinator,
) -> object:
    try:
        return await loop.connect_accepted_socket(protocol_factory, sock)
    except OSError:
        sock.close()
        return None
    finally:
        coordinator.connection_closed()  # the protocol reports the connection itself
