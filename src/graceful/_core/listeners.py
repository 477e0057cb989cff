"""Listening sockets: count connections from the kernel's hand-over, close keeping the backlog.

Why connections count from ``accept()``
---------------------------------------
A drain is done when no connection is left.  If a connection counted only once its
protocol's ``connection_made`` ran, there is a window in which the event loop has
already ``accept()``-ed a socket but the coordinator does not know it: on asyncio's
selector loop ``_accept_connection`` accepts up to ``backlog`` sockets in one callback
and creates one task per socket, and only that task (one loop iteration later) builds
the protocol and schedules ``connection_made`` (another iteration).  A SIGTERM handled
in between would see "0 connections" and declare the drain done, and the process would
exit with those sockets — every client that had sent its request would get a reset.

So a connection counts from the moment the kernel handed it over:

* **asyncio (selector loops, every Python we support)**: the loop calls the listening
  socket's Python-level ``accept()``, always in the same callback that creates the
  hand-over task.  ``count_accepts`` gives the listening socket a subclass whose
  ``accept()`` reports each socket before returning it (the object keeps its file
  descriptor; only its class changes).  No socket the loop accepts escapes the count.
  The protocol, once created, takes the count over instead of adding to it
  (``Handovers``).
* **uvloop**: libuv accepts in C and uvloop calls the protocol factory synchronously in
  the same callback, before ``connection_made`` is scheduled; so counting at protocol
  creation *is* counting at the hand-over.
* **our own backlog accepts** (below) count at their ``accept()`` too.

What is left uncounted: a socket whose hand-over task fails before its protocol exists
(asyncio then closes it itself); it may hold the count up to the drain deadline, never
lose a request.

Closing without resetting the backlog
-------------------------------------
Closing a listening socket makes the kernel reset every connection that completed its
handshake but was not yet ``accept()``-ed: those clients already sent a request and get
``ECONNRESET``, which is not safe to retry.  So before an ``asyncio.Server`` is
closed we accept everything in the backlog through a duplicate of the listening file
descriptor (the socket stays open while the event loop's own reader is removed), close the
server, accept once more, and only then close the duplicate.  The accepted sockets are
handed to the loop with ``connect_accepted_socket`` and served like any other connection;
a connection attempt after that is refused, which a client can always retry.

When the listening socket is shared with other processes (gunicorn workers), closing our
copy does not close the socket at all; accepting the backlog then only serves a few
connections a sibling would otherwise have taken, which is harmless.

Sealing: no handshake completes between the last accept and the close
-----------------------------------------------------------------------
Accepting once more just before the close still leaves a window: a handshake the kernel
completes between that last ``accept()`` and the ``close()`` is queued, then reset.  So on
Linux, a listener this process provably alone holds is *sealed* first
(``graceful._core.seal``: new SYNs are dropped, handshakes under way complete), and the
last accept waits until none is under way, polling, for at most ``_HANDSHAKES_WAIT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from ssl import SSLContext
from typing import TYPE_CHECKING, Any, Final

from typing_extensions import final

from .seal import _note_created_by_loop
from .seal import handshakes_under_way as handshakes_under_way
from .seal import seal as seal
from .seal import unseal as unseal

if TYPE_CHECKING:
    from .tracking import Tracking

__all__ = (
    "CLOSE_BOUND_S",
    "Handovers",
    "close_keeping_backlog",
    "count_accepts",
    "handshakes_under_way",
    "seal",
    "unseal",
)

logger = logging.getLogger("graceful")


@final
class Handovers:
    """Counts each connection once, from its ``accept()`` to its protocol.

    ``accepted()`` at the kernel hand-over (counted at once), ``protocol_created()``
    when its protocol exists (takes over a pending count, or counts a connection whose
    accept we did not see — uvloop), ``failed()`` if it never got a protocol.
    """

    __slots__ = ("_c", "pending")

    def __init__(self, coordinator: Tracking) -> None:
        self._c = coordinator
        self.pending = 0

    def accepted(self) -> None:
        self.pending += 1
        self._c.connection_opened()

    def protocol_created(self) -> None:
        if self.pending:
            self.pending -= 1
        else:
            self._c.connection_opened()

    def failed(self) -> None:
        if self.pending:
            self.pending -= 1
        self._c.connection_closed()

    def hold(self) -> None:
        """Count the handshakes a sealed listener still waits for as one connection
        (so that the drain waits for them too), until ``release``."""
        self._c.connection_opened()

    def release(self) -> None:
        self._c.connection_closed()


def _real_socket(obj: object) -> socket.socket | None:
    if isinstance(obj, socket.socket):
        return obj
    inner = getattr(obj, "sock", None)  # gunicorn's socket wrappers
    return inner if isinstance(inner, socket.socket) else None


def count_accepts(server: asyncio.AbstractServer, handovers: Handovers) -> int:
    """Make ``server``'s listening sockets report every ``accept()`` to ``handovers``.

    Returns:
        How many listening sockets now count (0 on loops that accept in C: uvloop).
    """
    _note_created_by_loop(server)
    counted = 0
    for obj in getattr(server, "_sockets", None) or ():  # asyncio.Server's own list
        sock = _real_socket(obj)
        if sock is None or getattr(type(sock), "_graceful_counting", False):
            continue
        base = type(sock)

        def accept(
            self: socket.socket, _base: Any = base, _accepted: Any = handovers.accepted
        ) -> tuple[socket.socket, Any]:
            conn, address = _base.accept(self)
            _accepted()
            return conn, address

        cls = type(
            f"Counting{base.__name__}",
            (base,),
            {"__slots__": (), "_graceful_counting": True, "accept": accept},
        )
        sock.__class__ = cls
        counted += 1
    return counted


def _accept_all(listeners: list[socket.socket], handovers: Handovers) -> list[socket.socket]:
    accepted: list[socket.socket] = []
    for listener in listeners:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # BlockingIOError: backlog empty
                break
            handovers.accepted()
            sock.setblocking(False)
            accepted.append(sock)
    return accepted


def close_keeping_backlog(
    servers: Iterable[asyncio.AbstractServer],
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    loop: asyncio.AbstractEventLoop,
    handovers: Handovers,
    *,
    extra_sockets: Iterable[socket.socket] = (),
    ssl: SSLContext | None = None,
) -> asyncio.Future[list[asyncio.Task[object]]]:
    """Close ``servers`` (and ``extra_sockets``); serve the backlog with ``protocol_factory``.

    ``protocol_factory`` must report ``handovers.protocol_created()`` like the server's
    own factory does; each backlog socket counts from its accept.  ``ssl`` is the
    listeners' TLS context: backlog connections do their handshake like the others.

    The loop stops accepting at once (its reader on each listening socket is removed);
    the server itself is closed only once every socket the loop already accepted has
    its transport: asyncio's hand-over task attaches the transport to its server and
    fails (closing the socket: a reset) if the server was closed meanwhile.  Until then
    the listening sockets stay open, so nothing queued in the kernel is reset either.

    Returns:
        A future of the close (done at once when no hand-over is pending and no
        handshake of a sealed listener is under way); its result are the tasks serving
        the backlog.
    """
    servers = list(servers)
    extra = list(extra_sockets)
    listening = [s for server in servers for s in (server.sockets or ())] + extra  # type: ignore[attr-defined]
    dups: list[socket.socket] = []
    for sock in listening:
        with contextlib.suppress(ValueError, OSError, NotImplementedError):
            loop.remove_reader(sock.fileno())  # uvloop: not a reader of ours, no-op
        try:
            dup = socket.socket(fileno=os.dup(sock.fileno()))
        except OSError:
            continue
        dup.setblocking(False)
        dups.append(dup)
    serving = [
        _start(loop, protocol_factory, sock, handovers, ssl)
        for sock in _accept_all(dups, handovers)
    ]

    def close() -> bool:
        """Close the servers; accept what completed meanwhile.  Returns whether the
        listeners are sealed with handshakes still under way (to wait for)."""
        for server in servers:
            server.close()
        for sock in extra:
            sock.close()
        sealed = seal(dups)
        # Whatever completed its handshake meanwhile.
        accept_more()
        return sealed and handshakes_under_way(dups)

    def accept_more() -> None:
        serving.extend(
            _start(loop, protocol_factory, s, handovers, ssl) for s in _accept_all(dups, handovers)
        )

    def finish() -> list[asyncio.Task[object]]:
        accept_more()
        for dup in dups:
            dup.close()
        if serving:
            logger.debug("serving %d connections from the accept backlog", len(serving))
        return serving

    async def close_after_handovers(waiting: bool) -> list[asyncio.Task[object]]:
        # Hand-over tasks the loop created before its reader was removed are already
        # scheduled: they reach protocol creation within an iteration or two.
        if waiting:
            for _ in range(_HANDOVER_ITERATIONS):
                if not handovers.pending:
                    break
                await asyncio.sleep(0)
            else:
                logger.warning("%d accepted connections still not handed over", handovers.pending)
            if not close():
                return finish()
            handovers.hold()
        # Sealed, with handshakes under way: accept them as they complete; until then
        # they hold the drain as one connection.  Each look walks the kernel's
        # connection table (~0.3 ms): first soon (a round trip), then less often.
        deadline = time.monotonic() + _HANDSHAKES_WAIT_S
        poll_s = _HANDSHAKES_POLL_S
        try:
            while handshakes_under_way(dups):
                if time.monotonic() >= deadline:
                    logger.warning(
                        "listener closed with handshakes still under way after %.1f s: "
                        "their clients are reset (a client gone, or one deferred by "
                        "TCP_DEFER_ACCEPT that has not sent yet)",
                        _HANDSHAKES_WAIT_S,
                    )
                    break
                await asyncio.sleep(poll_s)
                poll_s = min(2 * poll_s, _HANDSHAKES_POLL_MAX_S)
                accept_more()
            return finish()
        finally:
            handovers.release()

    if handovers.pending:
        return loop.create_task(close_after_handovers(True))
    if close():  # sealed, with handshakes to wait for
        handovers.hold()
        return loop.create_task(close_after_handovers(False))
    done: asyncio.Future[list[asyncio.Task[object]]] = loop.create_future()
    done.set_result(finish())  # nothing on its way (always so on uvloop): closed now
    return done


_HANDOVER_ITERATIONS: Final = 1000
#: How long the last accept of a sealed listener waits for handshakes under way: a client's
#: ACK is a round trip away; a lost one is answered to the SYN-ACK the kernel resends after
#: a second.  (A handshake that never completes — a scanner, a client gone — costs this.)
_HANDSHAKES_WAIT_S: Final = 1.0
#: The longest the future ``close_keeping_backlog`` returns takes (the wait above, its last
#: poll and the hand-overs' iterations): who awaits it waits this long, not less, or the
#: close is cut short before it served the handshakes it waited for.
CLOSE_BOUND_S: Final = _HANDSHAKES_WAIT_S + 0.5
_HANDSHAKES_POLL_S: Final = 0.005
_HANDSHAKES_POLL_MAX_S: Final = 0.05


def _start(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    sock: socket.socket,
    handovers: Handovers,
    ssl: SSLContext | None,
) -> asyncio.Task[object]:
    return loop.create_task(_serve(loop, protocol_factory, sock, handovers, ssl))


async def _serve(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    sock: socket.socket,
    handovers: Handovers,
    ssl: SSLContext | None,
) -> object:
    created = False

    def factory() -> asyncio.BaseProtocol:
        nonlocal created
        created = True
        return protocol_factory()

    try:
        return await loop.connect_accepted_socket(factory, sock, ssl=ssl)
    except OSError:
        sock.close()
        if not created:
            handovers.failed()
        return None
