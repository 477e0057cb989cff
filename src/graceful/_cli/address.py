"""The address ``graceful run`` serves on: checked before the app is imported, bound by
a ``--workers`` parent for its workers to share.

A bad ``--host`` or ``--port`` is one line naming it and exit status 2 before anything
slow starts; uvicorn would only log the error once the app is imported.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from typing import Any

from .._options import ConfigError, Values
from .command import Invocation


def _addresses(values: Values, names: tuple[str, str] = ("host", "port")) -> list[tuple[Any, ...]]:
    host, port = _address(values, names)
    try:
        return socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
        )
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"{values.label(names[0])}: cannot resolve {host!r}: {reason}") from None


def _address(values: Values, names: tuple[str, str]) -> tuple[str, int]:
    """(host, port) of the app (``names``: host and port options) or of the management
    listener, whose host defaults to the app's."""
    return values[names[0]] or values["host"], values[names[1]]


def _bind(
    values: Values, family: int, address: Any, names: tuple[str, str] = ("host", "port")
) -> socket.socket:
    """A socket bound to ``address``, set up like asyncio's ``create_server``; bind
    errors as one line naming ``--host`` or ``--port``."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        host, port = _address(values, names)
        host_label, port_label = values.label(names[0]), values.label(names[1])
        where = f"{host_label} {host} {port_label} {port}"
        if exc.errno == errno.EADDRNOTAVAIL:
            where = f"{host_label}: {host!r} is not an address of this machine"
        elif exc.errno == errno.EADDRINUSE:
            where = f"{port_label}: port {port} on {host} is in use"
        elif exc.errno == errno.EACCES:
            where = f"{port_label}: no permission to bind port {port}"
        raise ConfigError(f"{where} ({exc.strerror or exc})") from None
    return sock


def _check_address(values: Values) -> None:
    """Refuse an address that cannot be bound, before the app is imported; uvicorn
    would only log the error after starting up."""
    for family, _, _, _, address in _addresses(values):
        _bind(values, family, address).close()
        if values["port"] == 0:
            break  # any free port: the first address is the one that matters
    if values["management_port"] is not None:
        names = ("management_host", "management_port")
        same_host = (values["management_host"] or values["host"]) == values["host"]
        if values["management_port"] == values["port"] != 0 and same_host:
            label = values.label
            raise ConfigError(
                f"{label('management_port')} {values['port']} is the app's {label('port')}: "
                "the management listener needs a port of its own"
            )
        for family, _, _, _, address in _addresses(values, names):
            _bind(values, family, address, names).close()


def _listener(inv: Invocation) -> socket.socket:
    """The socket the workers share: ``--uds``, ``--fd`` or ``--host``/``--port``."""
    values = inv.values
    path, fd = inv.option("uds"), inv.option("fd")
    if fd is not None:
        try:
            return socket.socket(fileno=fd)
        except OSError as exc:
            raise ConfigError(f"{inv.given['fd']}: {fd} is not a socket ({exc.strerror})") from None
    if path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o666)  # as uvicorn
        except OSError as exc:
            sock.close()
            raise ConfigError(
                f"{inv.given['uds']}: cannot bind {path!r} ({exc.strerror})"
            ) from None
    else:
        family, _, _, _, address = _addresses(values)[0]
        sock = _bind(values, family, address)
    sock.listen(inv.option("backlog", 2048))
    return sock


def _where(sock: socket.socket) -> str:
    address = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return f"unix socket {address}"
    host = f"[{address[0]}]" if sock.family == socket.AF_INET6 else address[0]
    return f"http://{host}:{address[1]}"


def _remove_uds(inv: Invocation) -> None:
    """As uvicorn: the process that bound ``--uds`` removes it at exit."""
    path = inv.option("uds")
    if path is not None and inv.worker_fd is None:
        with contextlib.suppress(OSError):
            os.remove(path)
