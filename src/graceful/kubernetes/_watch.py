"""The pod's EndpointSlices: which API version serves them, listing them, and the watch
that waits until none routes new traffic to the pod.

The watch is the classic list-then-watch from the list's ``resourceVersion``, with the
cases a shutdown cannot afford to get wrong:

* ``410 Gone`` (the version expired) lists afresh at once;
* 401, 403, 404 will not heal: one warning, and the idle window alone;
* any other failure reconnects with a doubling backoff (``_BACKOFF_START_S`` to
  ``_BACKOFF_MAX_S``, never a tight poll) until the watch has been broken for
  ``api_timeout_s``, then falls back the same way;
* a watch quiet for ``api_timeout_s`` is dropped for a fresh list: a shutdown waits
  seconds for one change, and a frozen API server never closes its watch, so only
  asking again shows it is alive.

The caller (``graceful.kubernetes.Kubernetes``) hands in what to do when the pod is out
(``removed``) and when the watch gives up (``failed``): this module reports to no
coordinator itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from ._api import _describe, _status
from ._pod import endpoint_state

logger: Final = logging.getLogger("graceful")

_DISCOVERY: Final = "discovery.k8s.io"
_BACKOFF_START_S: Final = 0.25
_BACKOFF_MAX_S: Final = 4.0
_WATCH_SERVER_TIMEOUT_S: Final = 60


async def slice_resource(client: Any, namespace: str | None, api_timeout_s: float) -> Any:
    """``discovery.k8s.io/v1`` EndpointSlices, else ``v1beta1`` (Kubernetes < 1.21)."""
    from lightkube.generic_resource import create_namespaced_resource

    last: Exception | None = None
    for version in ("v1", "v1beta1"):
        resource = create_namespaced_resource(
            _DISCOVERY, version, "EndpointSlice", "endpointslices"
        )
        try:
            await list_slices(client, resource, namespace, api_timeout_s, limit=1)
        except Exception as exc:
            if _status(exc) != 404:
                raise
            last = exc
            continue
        return resource
    assert last is not None
    raise last


async def list_slices(
    client: Any,
    resource: Any,
    namespace: str | None,
    api_timeout_s: float,
    *,
    limit: int | None = None,
) -> tuple[dict[str, Mapping[str, Any]], str]:
    """The namespace's EndpointSlices by name (at most ``limit``), and the list's
    ``resourceVersion`` to watch from."""

    async def collect() -> tuple[dict[str, Mapping[str, Any]], str]:
        found = client.list(resource, namespace=namespace, chunk_size=limit)
        items = {}
        async for item in found:
            items[item.metadata.name] = item
            if limit is not None:
                break
        try:
            return items, found.resourceVersion
        except Exception:  # lightkube: none before the first chunk
            return items, ""

    return await asyncio.wait_for(collect(), api_timeout_s)


async def watch_endpoints(
    client: Any,
    resource: Any,
    *,
    namespace: str | None,
    pod_name: str,
    pod_ip: str | None,
    api_timeout_s: float,
    where: str,
    removed: Callable[[], None],
    failed: Callable[[str, str], None],
) -> None:
    """Watch ``namespace``'s EndpointSlices until none routes to the pod, then call
    ``removed()``; or until the watch cannot go on, then ``failed(warning, reason)``
    (one warning, and the idle window alone).  ``where`` names the pod in the log."""
    slices: dict[str, Mapping[str, Any]] = {}
    version: str | None = None
    broken_since: float | None = None
    backoff = _BACKOFF_START_S
    watching = False
    while True:
        try:
            if version is None:
                slices, version = await list_slices(client, resource, namespace, api_timeout_s)
                broken_since, backoff = None, _BACKOFF_START_S
                if _check(slices, pod_name, pod_ip, where, removed):
                    return
                if not watching:
                    watching = True
                    state = endpoint_state(slices, pod_name=pod_name, pod_ip=pod_ip)
                    logger.info(
                        "kubernetes: pod %s is ready in %d of the %d EndpointSlice(s) "
                        "that list it; watching them",
                        where,
                        state.ready,
                        state.listed,
                    )
            events = client.watch(
                resource,
                namespace=namespace,
                resource_version=version,
                server_timeout=_WATCH_SERVER_TIMEOUT_S,
            ).__aiter__()
            try:
                while True:
                    try:
                        kind, obj = await asyncio.wait_for(events.__anext__(), api_timeout_s)
                    except asyncio.TimeoutError:
                        # Quiet for a while, in the few seconds a shutdown waits for
                        # one change: list again, which also shows the server is
                        # alive (a frozen one never closes the watch).
                        version = None
                        break
                    broken_since, backoff = None, _BACKOFF_START_S
                    version = obj.metadata.resourceVersion or version
                    if kind == "DELETED":
                        slices.pop(obj.metadata.name, None)
                    elif kind in ("ADDED", "MODIFIED"):
                        slices[obj.metadata.name] = obj
                    else:
                        continue
                    if _check(slices, pod_name, pod_ip, where, removed):
                        return
            finally:
                with contextlib.suppress(Exception):
                    await events.aclose()
        except Exception as exc:
            if _status(exc) == 410:  # the version expired: list afresh
                version = None
                continue
            if _status(exc) in (401, 403, 404):
                failed(f"cannot watch EndpointSlices ({_describe(exc)})", _describe(exc))
                return
            now = time.monotonic()
            broken_since = now if broken_since is None else broken_since
            if now - broken_since > api_timeout_s:
                failed(
                    f"the EndpointSlice watch is broken ({_describe(exc)}) for "
                    f"{now - broken_since:.1f} s",
                    "the watch is broken",
                )
                return
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, _BACKOFF_MAX_S)


def _check(
    slices: Mapping[str, Mapping[str, Any]],
    name: str,
    ip: str | None,
    where: str,
    removed: Callable[[], None],
) -> bool:
    """``True``, logged and ``removed()`` called, once no slice routes to the pod."""
    state = endpoint_state(slices, pod_name=name, pod_ip=ip)
    if not state.removed:
        return False
    if state.listed:
        what = f"not ready in the {state.listed} EndpointSlice(s) that list it"
    else:
        what = "listed in no EndpointSlice"
    logger.info("kubernetes: pod %s is %s", where, what)
    removed()
    return True
