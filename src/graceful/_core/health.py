"""What the health endpoints answer, decided once for every server.

The ASGI middleware, aiohttp's middleware and the WSGI middleware each serve readiness,
liveness and preStop in their own server's terms (ASGI messages, ``web.Response``, a WSGI
status line); the answer itself — status and text — depends on the coordinator only, and
is decided here.
"""

from __future__ import annotations

from .coordinator import ShutdownCoordinator
from .policy import Phase

__all__ = ("CUT_BODY", "check_path", "check_paths", "liveness", "prestop_done", "readiness")

#: The body of the 503 (``Retry-After: 0``, ``Connection: close``) a request gets when it
#: is cut before its response started, in every server's terms.
CUT_BODY = b"server shutting down\n"


def check_path(name: str, value: str | None) -> str | None:
    """An endpoint's path: starting with ``/``, or ``None`` (no endpoint)."""
    if value is not None and (not isinstance(value, str) or not value.startswith("/")):
        raise ValueError(f"{name} must be a path starting with '/' or None, got {value!r}")
    return value


def check_paths(paths: dict[str, str | None]) -> None:
    """Each endpoint's path (by option name) checked, and no two alike."""
    seen: dict[str, str] = {}
    for name, value in paths.items():
        path = check_path(name, value)
        if path is None:
            continue
        if path in seen:
            raise ValueError(
                f"{name} {path!r} is already used by another health endpoint ({seen[path]})"
            )
        seen[path] = name


def readiness(
    coordinator: ShutdownCoordinator,
    on_shutdown: str,
    *,
    starting: bool = False,
    peer: str | None = None,
    user_agent: str | None = None,
    count: bool = True,
) -> tuple[int, str]:
    """200 while serving; 503 from the shutdown request on (``on_shutdown="keep"``: from
    draining on) and while the app starts (``starting``: lifespan startup not done).

    The answer is counted for the health checker that asked (``peer``, the client's
    address, and its ``user_agent``): accept-until-idle waits until each checker has
    seen enough 503s to let go (see ``graceful._core.checkers``); ``count=False``: the
    caller reports it (``health_checkers.answered``) in the coordinator's thread."""
    status, text = _readiness(coordinator, on_shutdown, starting)
    if count:
        coordinator.health_checkers.answered(peer, user_agent, status)
    return status, text


def _readiness(c: ShutdownCoordinator, on_shutdown: str, starting: bool) -> tuple[int, str]:
    if c.shutdown_requested and (on_shutdown == "fail" or not c.accepting):
        if c.pod_still_serving():
            return 200, f"ready (this process {c.phase}, the pod still serving)\n"
        return 503, f"shutting down ({c.phase})\n"
    if starting:
        return 503, "starting\n"
    return 200, "ready\n"


def liveness(coordinator: ShutdownCoordinator) -> tuple[int, str]:
    """200 until stopped."""
    phase = coordinator.phase
    if phase is Phase.STOPPED:
        return 503, "stopped\n"
    return 200, f"alive ({phase})\n"


async def prestop_done(coordinator: ShutdownCoordinator) -> tuple[int, str]:
    """Request shutdown and wait until the drain is done (or its deadline passed); the
    asking connection stays open, so only requests and sessions are waited for."""
    c = coordinator
    c.request_shutdown("preStop", escalate=False)
    await c.wait_for_phase(Phase.DRAINING)
    await c.wait_drained(include_connections=False)
    s = c.statistics()
    return 200, f"{s.phase}: {s.requests} requests, {s.sessions} sessions left\n"
