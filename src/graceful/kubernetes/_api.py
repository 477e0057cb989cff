"""Talking to the API server: the client, reading the own pod, and what an API error
says in one line.

lightkube (the ``graceful-drain[kubernetes]`` extra) is imported inside the functions,
never at module level: ``import graceful.kubernetes`` works without it, and only
``Kubernetes.attach`` says it is missing.  Every call is bounded by ``api_timeout_s``
(``asyncio.wait_for`` around lightkube's own timeout): a frozen API server must not hold
the integration's thread past the point where the coordinator falls back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final

from .._core.policy import _check_bool, _check_seconds
from ._pod import PodIdentity, _pod_deadline, pod_identity

logger: Final = logging.getLogger("graceful")


class _Unavailable(Exception):
    """The API cannot tell us this; the message says why (one warning)."""


async def open_client(
    factory: Callable[[], Any] | None, namespace: str | None, api_timeout_s: float
) -> Any:
    """The ``lightkube.AsyncClient`` (``factory``'s, else lightkube's own configuration
    discovery), or ``_Unavailable`` saying why there is none."""
    try:
        if factory is not None:
            return factory()
        import httpx2
        import lightkube

        return lightkube.AsyncClient(
            namespace=namespace,
            timeout=httpx2.Timeout(api_timeout_s),
        )
    except Exception as exc:
        raise _Unavailable(f"no Kubernetes credentials ({exc})") from exc


async def get_pod(client: Any, identity: PodIdentity, api_timeout_s: float) -> Any:
    """The pod ``identity`` names, as a lightkube ``Pod``."""
    from lightkube.resources.core_v1 import Pod

    return await asyncio.wait_for(
        client.get(Pod, identity.name, namespace=identity.namespace),
        api_timeout_s,
    )


def read_kill_deadline(
    requested_at_s: float,
    *,
    grace_period_known: bool,
    clock_skew_s: float = 1.0,
    api_timeout_s: float = 5.0,
) -> tuple[float, str] | None:
    """Read the own pod now (blocking, at most about ``api_timeout_s``) and return
    ``kill_deadline`` of it, or ``None`` when the pod has no deadline to give or
    cannot be read (logged).  For a process without an event loop: the ``graceful run
    --workers`` parent, which must not SIGKILL its workers before the pod's own deadline.
    """
    _check_seconds("requested_at_s", requested_at_s)
    _check_bool("grace_period_known", grace_period_known)
    _check_seconds("clock_skew_s", clock_skew_s)
    _check_seconds("api_timeout_s", api_timeout_s)
    try:
        import httpx2
        import lightkube
        from lightkube.resources.core_v1 import Pod

        identity = pod_identity()
        client = lightkube.Client(
            namespace=identity.namespace, timeout=httpx2.Timeout(api_timeout_s)
        )
        try:
            pod = client.get(Pod, identity.name, namespace=identity.namespace)
        finally:
            client.close()
    except Exception as exc:
        logger.warning("kubernetes: cannot read the pod (%s)", _describe(exc))
        return None
    return _pod_deadline(pod, requested_at_s, grace_period_known, clock_skew_s)


def _status(exc: BaseException) -> int | None:
    """The HTTP status of an API error (lightkube's ``ApiError.status.code``, an HTTP
    error's ``response.status_code``), ``None`` for any other failure."""
    status = getattr(exc, "status", None)
    code = getattr(status, "code", None)
    if isinstance(code, int):
        return code
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def _describe(exc: BaseException) -> str:
    """``exc`` in one line for the log: the status and the API server's message."""
    status = getattr(exc, "status", None)
    message = getattr(status, "message", None)
    code = _status(exc)
    if message:
        return f"{code}: {message}" if code else str(message)
    text = str(exc) or type(exc).__name__
    return f"{code}: {text}" if code else text
