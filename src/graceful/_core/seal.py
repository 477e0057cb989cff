"""The seal of a draining listener: no handshake completes between its last accept and its close.

``graceful._core.listeners.close_keeping_backlog`` accepts a listener's backlog once more
just before the close; that still leaves a window: a client whose handshake the kernel
completes between that last ``accept()`` and the ``close()`` is queued, then reset — with
clients opening connections all the time (a fault-suite case runs 250 of them), that
happens.  So on Linux the listener is *sealed* before the last accept: a socket filter
drops every new SYN (the kernel never answers it; the client retransmits it a second later
and, the listener closed by then, is refused — safe to retry), while handshakes already
under way complete (their ACK passes) and are accepted.  Those under way are the
connections in ``SYN_RECV`` on the listener's port, which the kernel lists for us
(``NETLINK_SOCK_DIAG``, filtered by state and port in the kernel: no ``/proc`` table read:
~0.3 ms, ~3 ms with 16,000 connections on the machine; ``handshakes_under_way``); the last
accept waits until there are none (``close_keeping_backlog`` polls it, for at most a
second).

Only a listener this process alone holds
----------------------------------------
The filter belongs to the socket, not to this process: every process holding the socket
would see its SYNs dropped, and after our close for ever.  So a listener is sealed only
when this process can *prove* it alone holds it — ``/proc`` cannot: a holder in another
PID namespace (systemd or podman socket activation, a supervisor outside the container,
``uvicorn --fd``) or behind ``hidepid`` is invisible there.  The proof (``_alone``):

* the socket was created here: this process bound it (``socket.bind``, seen by an audit
  hook installed when this module is imported — with ``graceful._core.listeners``, which
  imports it: asyncio's ``create_server``, hypercorn, aiohttp, trio, ``graceful run``), or
  uvloop created it from a host and port (its server holds no Python socket:
  ``count_accepts`` records it through ``_note_created_by_loop``); a socket inherited,
  handed over (``--fd``, ``sockets=``, ``sock=``) or already open when this module was
  imported is not;
* and it was never passed on: a fork (``os.register_at_fork``: parent and child both
  forget every proof — each holds the socket now), a process spawned (``subprocess``,
  ``posix_spawn``, ``os.system``: it may have been given the socket) or a message sent on
  a Unix socket (it may carry descriptors) forgets every proof made before it;
* and it is not in a ``SO_REUSEPORT`` group: a sealed member still gets its share of new
  SYNs and drops them (each such client waits a second), while a closed member's share
  goes to the other members at once — so a reuseport listener is simply closed (set
  ``net.ipv4.tcp_migrate_req=1`` to have the kernel hand its queue to the others).

And the filter never outlives the seal: a sealed socket object detaches it
(``SO_DETACH_FILTER``) in its ``close()``, right before the descriptor is closed, so even a
wrong proof costs the other holders at most the wait.  Elsewhere (not Linux, no proof)
nothing is sealed and the window stays, as narrow as two system calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import struct
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import asyncio

__all__ = ("handshakes_under_way", "seal", "unseal")

logger = logging.getLogger("graceful")

# A classic BPF socket filter for a listening TCP socket: at the filter the packet starts
# with its TCP header, byte 13 holds the flags.  SYN without ACK (a new handshake): drop;
# anything else (the ACK completing a handshake, data on accepted sockets, which share
# the filter): keep.
_DROP_NEW_SYN: Final = (
    (0x30, 0, 0, 13),  # ldb [13]
    (0x54, 0, 0, 0x12),  # and #(SYN|ACK)
    (0x15, 0, 1, 0x02),  # jeq #SYN, drop, keep
    (0x06, 0, 0, 0),  # drop: ret #0
    (0x06, 0, 0, 0xFFFFFFFF),  # keep: ret #-1
)
_PROGRAM: Final = b"".join(struct.pack("HBBI", *op) for op in _DROP_NEW_SYN)
_SO_ATTACH_FILTER: Final = 26
_SO_DETACH_FILTER: Final = 27
_LINUX: Final = sys.platform.startswith("linux")
_INET: Final = (socket.AF_INET, socket.AF_INET6)

# ----------------------------------------------------------------- the proof of "alone"

#: Inodes of the TCP sockets this process created (bound, or uvloop made them) since it
#: last passed anything on (oldest first; bounded: a forgotten one is merely not sealed).
_created: dict[int, None] = {}
_CREATED_MAX: Final = 4096


def _socket_inodes() -> frozenset[int]:
    """The inodes of the sockets this process holds (``/proc/self/fd``; once, at import)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
    return frozenset(inodes)


#: Sockets open before this module was imported: inherited, or made before graceful was.
_preexisting: frozenset[int] = _socket_inodes() if _LINUX else frozenset()


def _inode(sock: Any) -> int | None:
    try:
        return os.fstat(sock.fileno()).st_ino
    except (OSError, ValueError, AttributeError):
        return None


def _record_created(sock: Any) -> None:
    inode = _inode(sock)
    if inode is None or inode in _preexisting:
        return
    _created[inode] = None
    while len(_created) > _CREATED_MAX:
        del _created[next(iter(_created))]


def _forget_created() -> None:
    """Something may now hold our sockets too: no proof made so far stands."""
    _created.clear()


#: Audit events after which a socket created before may be held by another process.
_PASSING_ON: Final = frozenset({"subprocess.Popen", "os.posix_spawn", "os.system"})
_AUDITED: Final = _PASSING_ON | {"socket.bind", "socket.sendmsg"}


def _audit(event: str, args: tuple[Any, ...], _audited: frozenset[str] = _AUDITED) -> None:
    """Record the TCP sockets bound here; forget them all when anything may pass them
    on.  Called for every audit event of the process: one set lookup for the others.
    The set is bound here: an audit hook outlives its module's globals, which the
    interpreter's shutdown sets to ``None`` (the lookup then printed "Exception ignored
    in audit hook" for events at exit)."""
    if event not in _audited:
        return
    try:
        if event == "socket.bind":
            sock = args[0]
            if sock.family in _INET and sock.type == socket.SOCK_STREAM:
                _record_created(sock)
        elif event == "socket.sendmsg":
            if args[0].family == socket.AF_UNIX:  # it may carry descriptors (SCM_RIGHTS)
                _forget_created()
        else:
            _forget_created()
    except Exception:  # an audit hook's exception would fail the audited operation
        pass


if _LINUX:
    sys.addaudithook(_audit)
    os.register_at_fork(after_in_parent=_forget_created, after_in_child=_forget_created)


def _note_created_by_loop(server: asyncio.AbstractServer) -> None:
    """uvloop binds a host and port in C (no audit event): its listeners count as created
    here when none of its server's handles holds a Python socket (``sock=`` — handed to
    it, whatever its origin — leaves one there)."""
    if not _LINUX or type(server).__module__ != "uvloop.loop":
        return
    import gc

    handles = [
        handle
        for referent in gc.get_referents(server)
        if isinstance(referent, list)
        for handle in referent
        if type(handle).__name__ == "TCPServer"
    ]
    if not handles:
        return
    for handle in handles:
        referents = gc.get_referents(handle)
        if not any(type(r).__name__ == "Loop" for r in referents):
            return  # not the layout we know: prove nothing
        if any(isinstance(r, socket.socket) for r in referents):
            return
    for sock in getattr(server, "sockets", None) or ():
        _record_created(sock)


def _alone(sock: socket.socket) -> bool:
    """Whether this process provably alone holds the TCP listener ``sock`` and sealing
    it can delay nobody else (the module docs: "Only a listener this process alone holds")."""
    if sock.family not in _INET or _inode(sock) not in _created:
        return False
    try:
        return not sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
    except OSError:
        return False


def seal(listeners: Iterable[socket.socket]) -> bool:
    """Drop new handshakes on the TCP ``listeners`` this process provably alone holds
    (Linux), until each is closed.

    Handshakes already under way still complete; see the module docs.  A sealed
    socket's ``close()`` detaches the filter first.  Returns whether any was sealed.
    """
    if not _LINUX:
        return False
    sealed = False
    for sock in listeners:
        if not _alone(sock):
            continue
        buffer = ctypes.create_string_buffer(_PROGRAM)  # the kernel copies it
        fprog = struct.pack("HL", len(_DROP_NEW_SYN), ctypes.addressof(buffer))
        try:
            sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
        except OSError as exc:
            logger.debug("could not seal %s: %s", sock, exc)
            continue
        if not getattr(type(sock), "_graceful_sealed", False):
            sock.__class__ = _sealed_class(type(sock))
        sealed = True
    return sealed


def unseal(listeners: Iterable[socket.socket]) -> None:
    """Detach the filter ``seal`` attached (a socket without one: nothing happens)."""
    for sock in listeners:
        with contextlib.suppress(OSError, ValueError):
            sock.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)


_sealed_classes: dict[type, type] = {}


def _sealed_class(base: type[socket.socket]) -> type[socket.socket]:
    cls = _sealed_classes.get(base)
    if cls is None:

        def close(self: socket.socket, _base: Any = base) -> None:
            # Never leave the filter to whoever else may hold the socket.
            if self.fileno() >= 0:
                unseal([self])
            _base.close(self)

        cls = type(
            f"Sealed{base.__name__}",
            (base,),
            {"__slots__": (), "_graceful_sealed": True, "close": close},
        )
        _sealed_classes[base] = cls
    return cls


# ------------------------------------------------------------------ handshakes under way

_NETLINK_SOCK_DIAG: Final = 4
_SOCK_DIAG_BY_FAMILY: Final = 20
_NLM_F_REQUEST_DUMP: Final = 0x1 | 0x300
_NLMSG_ERROR: Final = 2
_NLMSG_DONE: Final = 3
_TCPF_SYN_RECV: Final = 1 << 3
_NLMSGHDR: Final = struct.Struct("=IHHII")
# inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid: sport and
# dport (big-endian), src and dst (16 bytes each), interface, cookie.
_DIAG_REQ: Final = struct.Struct("=BBBxIHH16s16sI8x")
_DIAG_MSG_HEAD: Final = 4 + 4  # inet_diag_msg: family, state, timer, retrans; sport, dport
_DIAG_SRC: Final = slice(_NLMSGHDR.size + _DIAG_MSG_HEAD, _NLMSGHDR.size + _DIAG_MSG_HEAD + 16)


def _syn_recv(family: int, port: int, address: bytes) -> bool | None:
    """Whether a connection to ``address`` (all zeros: any) and ``port`` is in
    ``SYN_RECV`` (``None``: the kernel could not tell, e.g. no sock_diag).

    The kernel filters by state and local port while it walks its table; only matches
    are sent: ~0.3 ms, ~3 ms with 16,000 connections on the machine.
    """
    request = _DIAG_REQ.pack(
        family, socket.IPPROTO_TCP, 0, _TCPF_SYN_RECV, socket.htons(port), 0, b"", b"", 0
    )
    header = _NLMSGHDR.pack(
        _NLMSGHDR.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0
    )
    wildcard = not address.strip(b"\0")
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(0.05)  # the kernel answers within the send; never a long block
            nl.send(header + request)
            while True:
                data = nl.recv(65536)
                offset = 0
                while offset + _NLMSGHDR.size <= len(data):
                    length, kind = _NLMSGHDR.unpack_from(data, offset)[:2]
                    if kind == _NLMSG_DONE:
                        return False
                    if kind == _NLMSG_ERROR or length < _NLMSGHDR.size:
                        return None
                    message = data[offset : offset + length]
                    sport = int.from_bytes(message[_NLMSGHDR.size + 4 : _NLMSGHDR.size + 6], "big")
                    if sport == port and (wildcard or message[_DIAG_SRC].startswith(address)):
                        return True
                    offset += (length + 3) & ~3
                if not data:
                    return None
    except (OSError, struct.error):
        return None


def _where(sock: socket.socket) -> list[tuple[int, int, bytes]]:
    """What sock_diag reports for connections to ``sock``: (family, port, packed local
    address) per family (a dual-stack IPv6 listener gets IPv4 ones too)."""
    try:
        host, port = sock.getsockname()[:2]
        where: list[tuple[int, int, bytes]] = [
            (sock.family, port, socket.inet_pton(sock.family, host))
        ]
        if sock.family == socket.AF_INET6 and not sock.getsockopt(
            socket.IPPROTO_IPV6, socket.IPV6_V6ONLY
        ):
            where.append((socket.AF_INET, port, b""))
    except (OSError, ValueError, TypeError):
        return []
    return where


def handshakes_under_way(listeners: Iterable[socket.socket]) -> bool:
    """Whether a connection to one of the TCP ``listeners`` (their address and port) is in
    ``SYN_RECV``: its handshake is under way, or complete but deferred
    (``TCP_DEFER_ACCEPT``).  ``False`` where the kernel cannot tell (not Linux)."""
    if not _LINUX:
        return False
    for sock in listeners:
        if sock.family in _INET and any(_syn_recv(*where) for where in _where(sock)):
            return True
    return False
