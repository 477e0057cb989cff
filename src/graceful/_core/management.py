"""The management listener: readiness, liveness, preStop and metrics off the app's port.

Whoever can reach the application's port could otherwise take the pod out of rotation
with one ``GET /prestop`` and read its internals at ``/metrics``.  Envoy's admin
listener, Spring Boot's ``management.server.port`` and the Prometheus conventions keep
these on a port of their own, which the Service or the ingress never exposes; so does
``--management-port``.

The listener is a task of the coordinator (``start_background``): it opens when
``ShutdownCoordinator.run`` starts and closes when the coordinator reaches ``STOPPED``,
after the application's listeners were closed — a preStop ``httpGet`` that waits for the
drain gets its answer on it.  Its connections are not the application's: they are never
reported to the coordinator, so a health check here never counts as traffic and never
holds the drain.

It speaks just enough HTTP/1.1 for probes and scrapers: one request per connection
(``Connection: close``), ``GET`` and ``HEAD``, the request head bounded in size and
time, no body read.  The answers are the same as on the application's port
(``graceful._core.health``): the adapter that builds the listener hands in what only it
knows — whether the application is still starting, and the metrics renderer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
from typing_extensions import final

from . import health as _health
from .coordinator import ShutdownCoordinator

__all__ = ("HEAD_LIMIT", "HEAD_TIMEOUT_S", "Management", "MetricsRenderer", "check_management")

logger = logging.getLogger("graceful")

#: ``(accept, names) -> (status, body, content type)``: ``graceful.metrics``'
#: ``Exposition.render_retrying``.
MetricsRenderer = Callable[[str, Sequence[str]], Awaitable[tuple[int, bytes, str]]]

#: The longest request head read (request line and headers), bytes.
HEAD_LIMIT: Final = 16384
#: How long a client may take to send its request head, s.
HEAD_TIMEOUT_S: Final = 10.0

#: The pause before accepting again when ``accept()`` failed (no descriptor left), s.
ACCEPT_RETRY_S: Final = 0.1
_TEXT: Final = [("Content-Type", "text/plain; charset=utf-8")]

_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def check_management(port: object, host: object, health_on_app_port: object) -> None:
    """The management options' types and ranges, each error naming the value."""
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise TypeError(f"management_port must be an int or None, got {port!r}")
    if isinstance(port, int) and not 0 <= port <= 65535:
        raise ValueError(
            f"management_port must be a port from 0 (any free port) to 65535, got {port!r}"
        )
    if not isinstance(host, str) or not host:
        raise TypeError(f"management_host must be a host name or address, got {host!r}")
    if not isinstance(health_on_app_port, bool):
        raise TypeError(f"health_on_app_port must be True or False, got {health_on_app_port!r}")


@final
class Management:
    """The management listener of one process.

    Args:
        coordinator: The process's coordinator.
        host: The address to listen on.
        port: The port (not the application's).
        readiness_path, liveness_path, prestop_path, metrics_path: What is served
            (``None``: not served), as on the application's port.
        readiness_on_shutdown: As ``GracefulMiddleware``'s.
        starting: Whether the application is still starting (readiness answers 503).
        metrics: The metrics renderer, when ``metrics_path`` is set.
    """

    def __init__(
        self,
        coordinator: ShutdownCoordinator,
        *,
        host: str,
        port: int,
        readiness_path: str | None,
        liveness_path: str | None,
        prestop_path: str | None,
        metrics_path: str | None,
        readiness_on_shutdown: str,
        starting: Callable[[], bool] = lambda: False,
        metrics: MetricsRenderer | None = None,
    ) -> None:
        if metrics_path is not None and metrics is None:
            raise ValueError("metrics_path needs a metrics renderer")
        self.coordinator: Final = coordinator
        self.host: Final = host
        self.port: Final = port
        self.readiness_on_shutdown: Final = readiness_on_shutdown
        self._starting = starting
        self._metrics = metrics
        self.paths: Final = {
            path: kind
            for path, kind in (
                (readiness_path, "readiness"),
                (liveness_path, "liveness"),
                (prestop_path, "prestop"),
                (metrics_path, "metrics"),
            )
            if path is not None
        }
        #: Set once the listener is open (tests, and whoever waits for it).
        self.listening: Final = anyio.Event()
        #: The port it listens on once open (``port``, or the one chosen for 0).
        self.bound_port: int | None = None

    @classmethod
    def for_options(
        cls,
        coordinator: ShutdownCoordinator,
        *,
        port: int | None,
        host: str,
        paths: tuple[str | None, str | None, str | None, str | None],
        readiness_on_shutdown: str,
        starting: Callable[[], bool] = lambda: False,
        metrics: MetricsRenderer | None = None,
    ) -> Management | None:
        """The management listener of a middleware's options, started (``None``
        without ``port``); ``paths``: readiness, liveness, preStop and metrics."""
        if port is None:
            return None
        readiness_path, liveness_path, prestop_path, metrics_path = paths
        management = cls(
            coordinator,
            host=host,
            port=port,
            readiness_path=readiness_path,
            liveness_path=liveness_path,
            prestop_path=prestop_path,
            metrics_path=metrics_path,
            readiness_on_shutdown=readiness_on_shutdown,
            starting=starting,
            metrics=metrics,
        )
        management.start()
        return management

    def start(self) -> None:
        """Serve while the coordinator runs (from its ``run`` until ``STOPPED``)."""
        self.coordinator.start_background(self.serve)

    async def serve(self) -> None:
        """Listen and answer until cancelled."""
        try:
            listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        except OSError as exc:
            logger.error(
                "management listener: cannot listen on %s port %d: %s (the health "
                "endpoints are not served)",
                self.host,
                self.port,
                exc.strerror or exc,
            )
            return
        async with listener:
            self.bound_port = listener.extra(anyio.abc.SocketAttribute.local_port)
            logger.info(
                "management listener on %s port %d: %s",
                self.host,
                self.bound_port,
                ", ".join(f"{kind} {path}" for path, kind in self.paths.items()) or "no paths",
            )
            self.listening.set()
            async with anyio.create_task_group() as tg:
                for one in listener.listeners:
                    assert isinstance(one, anyio.abc.SocketListener)
                    tg.start_soon(self._accept, one, tg)

    async def _accept(self, listener: anyio.abc.SocketListener, tg: anyio.abc.TaskGroup) -> None:
        """Accept until cancelled.  ``accept()`` failing (no descriptor left) pauses
        and retries: the listener must outlive anything a client can do."""
        warned = False
        while True:
            try:
                stream = await listener.accept()
            except (OSError, anyio.BrokenResourceError) as exc:  # trio's EMFILE is the latter
                if not warned:
                    logger.warning("management listener: accept failed (%s); retrying", exc)
                    warned = True
                await anyio.sleep(ACCEPT_RETRY_S)
                continue
            warned = False
            tg.start_soon(self._connection, stream)

    async def _connection(self, stream: anyio.abc.SocketStream) -> None:
        """One request, one answer; whatever a client sends ends only its connection."""
        async with stream:
            try:
                status, headers, body, head_only = await self._answer(stream)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return
            except Exception as exc:  # never the listener's end
                logger.debug("management listener: bad request: %r", exc)
                status, headers, body, head_only = 400, _TEXT, b"bad request\n", False
            reason = _REASONS.get(status, "")
            lines = [f"HTTP/1.1 {status} {reason}"]
            lines += [f"{name}: {value}" for name, value in headers]
            lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
            payload = "\r\n".join(lines).encode("latin-1") + (b"" if head_only else body)
            try:
                await stream.send(payload)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                logger.debug("management listener: the client left before its answer")

    async def _answer(
        self, stream: anyio.abc.SocketStream
    ) -> tuple[int, list[tuple[str, str]], bytes, bool]:
        text = _TEXT
        head = b""
        with anyio.move_on_after(HEAD_TIMEOUT_S):
            while _head_end(head) < 0:
                if len(head) > HEAD_LIMIT:
                    return 431, text, b"request head too large\n", False
                head += await stream.receive(HEAD_LIMIT + 1 - len(head))
        end = _head_end(head)
        if end < 0:
            return 408, text, b"request head not received in time\n", False
        if end > HEAD_LIMIT:
            return 431, text, b"request head too large\n", False
        request_line, _, rest = head.partition(b"\n")
        parts = request_line.decode("latin-1").strip().split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, text, b"not an HTTP request\n", False
        method, target, _ = parts
        head_only = method == "HEAD"
        if method not in ("GET", "HEAD"):
            return 405, [*text, ("Allow", "GET, HEAD")], b"method not allowed\n", False
        try:
            url = urlsplit(target)
        except ValueError:
            return 400, text, b"bad request target\n", False
        kind = self.paths.get(url.path)
        c = self.coordinator
        if kind == "prestop" and head_only:  # no shutdown for a HEAD
            return 405, [*text, ("Allow", "GET")], b"method not allowed\n", True
        if kind is None:
            known = ", ".join(self.paths) or "none"
            return 404, text, f"not found (served here: {known})\n".encode(), head_only
        if kind == "readiness":
            status, answer = _health.readiness(
                c,
                self.readiness_on_shutdown,
                starting=self._starting(),
                peer=_peer(stream),
                user_agent=_header(rest, "user-agent"),
            )
        elif kind == "liveness":
            status, answer = _health.liveness(c)
        elif kind == "prestop":
            status, answer = await _health.prestop_done(c)
        else:
            assert self._metrics is not None
            accept = _header(rest, "accept") or ""
            names = parse_qs(url.query).get("name[]", [])
            status, body, content_type = await self._metrics(accept, names)
            return status, [("Content-Type", content_type)], body, head_only
        return status, text, answer.encode(), head_only


def _header(head: bytes, wanted: str) -> str | None:
    """The value of the header ``wanted`` (lower case) in the request ``head``, if any."""
    for line in head.decode("latin-1").splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() == wanted:
            return value.strip()
    return None


def _peer(stream: anyio.abc.SocketStream) -> str | None:
    """The client's address (for telling health checkers apart)."""
    try:
        address = stream.extra(anyio.abc.SocketAttribute.remote_address)
    except anyio.TypedAttributeLookupError:
        return None
    return str(address[0]) if isinstance(address, tuple) else str(address)


def _head_end(head: bytes) -> int:
    """Where the request head ends (the blank line; a bare LF is taken too), or -1."""
    ends = [i for i in (head.find(b"\r\n\r\n"), head.find(b"\n\n")) if i >= 0]
    return min(ends, default=-1)
