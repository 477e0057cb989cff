"""Kubernetes: the pod's own kill deadline and endpoint state (``graceful-drain[kubernetes]``).

A pod does not have to guess.  The API server knows when SIGKILL lands — the pod's
``metadata.deletionTimestamp`` is the deletion time plus the grace period, preStop time
included — and when the pod stopped being a target for new traffic — its endpoint in
every EndpointSlice that lists it turns ``ready=false`` (KEP-1672) or disappears.
``Kubernetes`` reads both and tells the coordinator::

    coordinator = graceful.ShutdownCoordinator(
        policy=graceful.AcceptUntilIdle(idle_s=2, wait_for_endpoint_removal=True)
    )
    graceful.kubernetes.Kubernetes().attach(coordinator)

``graceful run --kubernetes`` and the gunicorn workers (``GRACEFUL_KUBERNETES=1``) do
this for you.

What it does, and when
----------------------
* **At start** it finds its own pod — ``POD_NAME``/``POD_NAMESPACE`` from the downward
  API, else the hostname and the service account's namespace file — and checks, once,
  that it may read it (and list EndpointSlices, if the policy waits for them).  A
  problem is one warning now, not a surprise at shutdown.
* **At the shutdown request** it reads the pod.  With a ``deletionTimestamp`` that is the
  kill deadline (``graceful.ShutdownCoordinator.set_kill_deadline``): bounded above
  by the shutdown request plus the pod's ``deletionGracePeriodSeconds`` (the kubelet's
  timer started before our SIGTERM, so SIGKILL cannot come later than that on the
  node's clock) and moved earlier by ``clock_skew_s`` (an API server whose clock runs
  ahead of the node's would otherwise promise time that is not there).  Without one —
  the kubelet restarting the container after a failed liveness probe, a plain
  ``kill`` — the configured grace period stays, or, if none was configured, the pod's
  ``terminationGracePeriodSeconds`` replaces Kubernetes' assumed 30 s.
* **With** ``AcceptUntilIdle(wait_for_endpoint_removal=True)`` it lists the
  EndpointSlices of the pod's namespace and watches them from that ``resourceVersion``
  (a fresh list after ``410 Gone``; reconnects with a bounded backoff, never a tight
  poll).  Once every slice that lists the pod — by ``targetRef``, else by the pod's IP —
  shows it not ready, or dropped it, it calls
  ``graceful.ShutdownCoordinator.notify_endpoint_removed`` and accept-until-idle
  starts its idle window.  A pod that no slice lists (no Service selects it) is
  reported removed at once.

The API never delays a shutdown
-------------------------------
Everything runs on a daemon thread with its own event loop (so it works the same under
asyncio, uvloop and trio, and a slow API server cannot stall the server's loop); results
reach the coordinator through its loop's thread-safe scheduling.  The coordinator plans
with the configured grace period from the first instant and re-plans when the pod's
deadline arrives.  An unreachable API server, a missing RBAC permission or a watch that
stays broken longer than ``api_timeout_s`` gives one warning and the idle window alone,
as without this module.

Permissions: ``get`` on ``pods`` and ``list``/``watch`` on
``endpointslices.discovery.k8s.io`` in the pod's namespace (``examples/kubernetes/``).
Credentials are found as ``kubectl`` finds them: the in-cluster service account, else
``KUBECONFIG`` / ``~/.kube/config``.  EndpointSlices are read as
``discovery.k8s.io/v1``, else ``v1beta1`` (Kubernetes 1.17 to 1.20).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from typing_extensions import final

from ._core.coordinator import _check_coordinator
from ._core.engine import _check_callable
from ._core.policy import (
    AcceptUntilIdle,
    Phase,
    _check_bool,
    _check_optional_seconds,
    _check_seconds,
)

if TYPE_CHECKING:
    from ._core.coordinator import ShutdownCoordinator

__all__ = (
    "POD_NAMESPACE_ENV",
    "POD_NAME_ENV",
    "EndpointState",
    "Kubernetes",
    "PodIdentity",
    "endpoint_state",
    "kill_deadline",
    "pod_identity",
    "read_kill_deadline",
)

logger: Final = logging.getLogger("graceful")

#: The downward-API variable holding the pod's name (``fieldRef: metadata.name``).
POD_NAME_ENV: Final = "POD_NAME"
#: The downward-API variable holding the pod's namespace (``fieldRef: metadata.namespace``).
POD_NAMESPACE_ENV: Final = "POD_NAMESPACE"
_NAMESPACE_FILE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_DISCOVERY: Final = "discovery.k8s.io"
_BACKOFF_START_S: Final = 0.25
_BACKOFF_MAX_S: Final = 4.0
_WATCH_SERVER_TIMEOUT_S: Final = 60


# --------------------------------------------------------------------- identity


@final
@dataclass(frozen=True, slots=True)
class PodIdentity:
    """Which pod this process runs in.

    Attributes:
        name: The pod's name.
        namespace: Its namespace, or ``None`` for the client's default namespace.
        source: Where they came from, for the log.
    """

    name: str
    namespace: str | None
    source: str


def pod_identity(
    environ: Mapping[str, str] | None = None,
    *,
    hostname: str | None = None,
    namespace_file: Path = _NAMESPACE_FILE,
) -> PodIdentity:
    """The pod's name and namespace: ``POD_NAME``/``POD_NAMESPACE`` (the downward API),
    else the hostname (a pod's hostname is its name unless ``spec.hostname`` is set) and
    the service account's namespace file."""
    if environ is not None and not isinstance(environ, Mapping):
        raise TypeError(f"environ must be a mapping (os.environ) or None, got {environ!r}")
    _check_optional_str("hostname", hostname)
    environ = os.environ if environ is None else environ
    name = environ.get(POD_NAME_ENV, "").strip()
    namespace = environ.get(POD_NAMESPACE_ENV, "").strip() or None
    sources = []
    if name:
        sources.append(POD_NAME_ENV)
    else:
        name = hostname if hostname is not None else socket.gethostname()
        sources.append("the hostname")
    if namespace:
        sources.append(POD_NAMESPACE_ENV)
    else:
        with contextlib.suppress(OSError):
            namespace = namespace_file.read_text().strip() or None
        if namespace:
            sources.append(str(namespace_file))
    return PodIdentity(name, namespace, " and ".join(sources))


def _check_optional_str(name: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__} {value!r}")


# ---------------------------------------------------------------- the deadline


def _timestamp(value: object) -> float | None:
    """Seconds since the epoch from a Kubernetes timestamp (``datetime`` or RFC 3339)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return value.timestamp()
    raise TypeError(f"not a Kubernetes timestamp: {value!r}")


def kill_deadline(
    *,
    deletion_timestamp_s: float | None,
    deletion_grace_s: float | None,
    termination_grace_s: float | None,
    requested_at_s: float,
    clock_skew_s: float,
    grace_period_known: bool,
) -> tuple[float, str] | None:
    """When SIGKILL lands (wall-clock seconds) and a phrase saying why, or ``None`` to
    keep the configured grace period.

    Args:
        deletion_timestamp_s: The pod's ``deletionTimestamp``.
        deletion_grace_s: Its ``deletionGracePeriodSeconds``.
        termination_grace_s: Its ``spec.terminationGracePeriodSeconds``.
        requested_at_s: When shutdown was requested (our SIGTERM), wall clock.
        clock_skew_s: How far the API server's clock may run ahead of ours.
        grace_period_known: A grace period was configured (flag, variable, gunicorn).

    Raises:
        TypeError, ValueError: an argument that is not a number of seconds >= 0 (or
            ``None`` where allowed), naming it.
    """
    _check_optional_seconds("deletion_timestamp_s", deletion_timestamp_s)
    _check_optional_seconds("deletion_grace_s", deletion_grace_s)
    _check_optional_seconds("termination_grace_s", termination_grace_s)
    _check_seconds("requested_at_s", requested_at_s)
    _check_seconds("clock_skew_s", clock_skew_s)
    _check_bool("grace_period_known", grace_period_known)
    if deletion_timestamp_s is not None:
        at = deletion_timestamp_s - clock_skew_s
        stamp = datetime.datetime.fromtimestamp(deletion_timestamp_s, datetime.timezone.utc)
        why = f"the pod's deletionTimestamp {stamp:%Y-%m-%dT%H:%M:%SZ}"
        if clock_skew_s:
            why += f" less {clock_skew_s:g} s for clock skew"
        if deletion_grace_s is not None and requested_at_s + deletion_grace_s < at:
            # The kubelet's timer started before our SIGTERM: on the node's clock SIGKILL
            # comes no later than this, whatever the API server's clock says.
            at = requested_at_s + deletion_grace_s
            why = (
                f"SIGTERM + the pod's deletionGracePeriodSeconds ({deletion_grace_s:g} s; "
                f"its deletionTimestamp {stamp:%H:%M:%SZ} is later on this clock)"
            )
        return at, why
    if not grace_period_known and termination_grace_s is not None:
        return (
            requested_at_s + termination_grace_s,
            f"the pod's terminationGracePeriodSeconds ({termination_grace_s:g} s; "
            "no deletionTimestamp)",
        )
    return None


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


def _pod_deadline(
    pod: Any, requested_at_s: float, grace_period_known: bool, clock_skew_s: float
) -> tuple[float, str] | None:
    """``kill_deadline`` of a lightkube ``Pod``."""
    meta, spec = pod.metadata, pod.spec
    return kill_deadline(
        deletion_timestamp_s=_timestamp(meta.deletionTimestamp),
        deletion_grace_s=meta.deletionGracePeriodSeconds,
        termination_grace_s=None if spec is None else spec.terminationGracePeriodSeconds,
        requested_at_s=requested_at_s,
        clock_skew_s=clock_skew_s,
        grace_period_known=grace_period_known,
    )


# -------------------------------------------------------------- endpoint state


@final
@dataclass(frozen=True, slots=True)
class EndpointState:
    """Where the pod stands in its EndpointSlices.

    Attributes:
        listed: Slices that list the pod.
        ready: Of those, slices where it is ready (``conditions.ready`` unset counts as
            ready, as the API defines it).
    """

    listed: int
    ready: int

    @property
    def removed(self) -> bool:
        """``True`` when no slice routes new traffic to the pod."""
        return self.ready == 0


def _lists_pod(endpoint: Mapping[str, Any], pod_name: str, pod_ip: str | None) -> bool:
    ref = endpoint.get("targetRef") or {}
    if ref.get("kind") == "Pod" and ref.get("name"):
        return bool(ref.get("name") == pod_name)
    return pod_ip is not None and pod_ip in (endpoint.get("addresses") or ())


def endpoint_state(
    slices: Mapping[str, Mapping[str, Any]], *, pod_name: str, pod_ip: str | None
) -> EndpointState:
    """The pod's ``EndpointState`` in ``slices`` (EndpointSlice objects as dicts,
    by name), matched by ``targetRef`` (kind ``Pod``), else by address."""
    if not isinstance(slices, Mapping):
        raise TypeError(f"slices must be a mapping of EndpointSlices by name, got {slices!r}")
    if not isinstance(pod_name, str):
        raise TypeError(f"pod_name must be a str, got {type(pod_name).__name__} {pod_name!r}")
    _check_optional_str("pod_ip", pod_ip)
    listed = ready = 0
    for item in slices.values():
        mine = [e for e in item.get("endpoints") or () if _lists_pod(e, pod_name, pod_ip)]
        if mine:
            listed += 1
            if any((e.get("conditions") or {}).get("ready") is not False for e in mine):
                ready += 1
    return EndpointState(listed, ready)


# ---------------------------------------------------------------- the watcher


class _Unavailable(Exception):
    """The API cannot tell us this; the message says why (one warning)."""


@final
class Kubernetes:
    """Reads the pod's kill deadline and endpoint state for a coordinator.

    Args:
        pod_name: The pod's name (default: see ``pod_identity``).
        namespace: Its namespace (default: see ``pod_identity``, else the client's).
        clock_skew_s: How far the API server's clock may run ahead of this node's; the
            deadline from ``deletionTimestamp`` is moved this much earlier.
        api_timeout_s: The longest one API call may take, and the longest the endpoint
            watch may stay broken before falling back to the idle window alone.
        client_factory: Builds the ``lightkube.AsyncClient`` (default: lightkube's own
            configuration discovery); for tests and unusual credentials.
    """

    def __init__(
        self,
        *,
        pod_name: str | None = None,
        namespace: str | None = None,
        clock_skew_s: float = 1.0,
        api_timeout_s: float = 5.0,
        client_factory: Callable[[], Any] | None = None,
    ) -> None:
        if clock_skew_s != 0:
            _check_seconds("clock_skew_s", clock_skew_s)
        self.clock_skew_s: Final = clock_skew_s
        self.api_timeout_s: Final = _check_seconds("api_timeout_s", api_timeout_s)
        _check_optional_str("pod_name", pod_name)
        _check_optional_str("namespace", namespace)
        if client_factory is not None:
            _check_callable("client_factory", client_factory)
        identity = pod_identity()
        self.identity: Final = PodIdentity(
            pod_name or identity.name,
            namespace or identity.namespace,
            "arguments" if pod_name else identity.source,
        )
        self._client_factory = client_factory
        self._coordinator: ShutdownCoordinator | None = None
        self._schedule: Callable[[Callable[[], object]], object] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None
        self._requested_wall: float | None = None
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self._watching = False

    # ------------------------------------------------------------------ public

    @property
    def waits_for_endpoints(self) -> bool:
        """``True`` if the attached coordinator's policy waits for endpoint removal."""
        c = self._coordinator
        return (
            c is not None
            and isinstance(c.policy, AcceptUntilIdle)
            and c.policy.wait_for_endpoint_removal
        )

    def attach(self, coordinator: ShutdownCoordinator) -> None:
        """Report to ``coordinator``: its kill deadline from the pod and, if its policy
        is ``AcceptUntilIdle(wait_for_endpoint_removal=True)``, the endpoint removal.

        Starts with the coordinator's ``graceful.ShutdownCoordinator.run`` and
        stops with it.
        """
        _check_coordinator(coordinator)
        if self._coordinator is not None:
            raise RuntimeError("this Kubernetes integration is already attached")
        try:
            import lightkube  # noqa: F401
        except ImportError:
            raise ImportError(
                "graceful.kubernetes needs lightkube: pip install 'graceful-drain[kubernetes]'"
            ) from None
        # lightkube's HTTP client logs every request at INFO (a watch line each minute);
        # keep it to warnings unless the user chose a level for it.
        client_logger = logging.getLogger("httpx2")
        if client_logger.level == logging.NOTSET:
            client_logger.setLevel(logging.WARNING)
        self._coordinator = coordinator
        coordinator.expect_kill_deadline("the pod's deletionTimestamp")
        coordinator.subscribe(self._on_phase)
        coordinator.start_background(self._run)

    # ---------------------------------------------------- the coordinator's side

    async def _run(self) -> None:
        """Runs in the coordinator's task group: starts the thread, stops it on exit."""
        import anyio

        from ._core.signals import current_schedule

        self._schedule = current_schedule()
        thread = threading.Thread(target=self._thread_main, name="graceful-kubernetes", daemon=True)
        self._thread = thread
        thread.start()
        try:
            await anyio.sleep_forever()
        finally:
            self._stop_thread()

    def _on_phase(self, phase: Phase) -> None:
        if phase > Phase.SERVING and self._requested_wall is None:
            self._requested_wall = time.time()
            self._call_in_thread(self._trigger)

    def _trigger(self) -> None:
        if self._shutdown is not None:
            self._shutdown.set()

    def _call_in_thread(self, callback: Callable[[], None]) -> None:
        # Never blocks the caller's loop.  A thread still starting reads
        # ``_requested_wall`` and ``_stopped`` itself once its loop is ready.
        if not self._ready.is_set() or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop already closed
            self._loop.call_soon_threadsafe(callback)

    def _stop_thread(self) -> None:
        self._stopped.set()
        self._call_in_thread(self._cancel_all)

    def _cancel_all(self) -> None:
        for task in asyncio.all_tasks():
            task.cancel()

    def _report(self, callback: Callable[[ShutdownCoordinator], None]) -> None:
        """Run ``callback(coordinator)`` on the coordinator's loop (thread-safe)."""
        coordinator, schedule = self._coordinator, self._schedule
        if coordinator is None or schedule is None or self._stopped.is_set():
            return
        with contextlib.suppress(RuntimeError):  # the coordinator's loop is gone
            schedule(lambda: callback(coordinator))

    def _warn(self, message: str) -> None:
        """One warning; what follows falls back to the idle window."""
        if not self._warned:
            self._warned = True
            logger.warning("kubernetes: %s", message)

    # ------------------------------------------------------------- the thread

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException:  # never let the thread's end reach the server
            if not self._stopped.is_set():
                logger.exception("kubernetes: the integration failed")
                self._fall_back("the integration failed")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()
        self._ready.set()
        if self._stopped.is_set():
            return
        if self._requested_wall is not None:
            self._shutdown.set()
        try:
            client = await asyncio.wait_for(self._client(), self.api_timeout_s)
        except (_Unavailable, asyncio.TimeoutError) as exc:
            reason = str(exc) or "no answer from the API server"
            self._warn(f"{reason}; the kill deadline stays the grace period")
            await self._shutdown.wait()
            self._fall_back(reason)
            return
        try:
            pod, resource = await self._startup_check(client)
            await self._shutdown.wait()
            work = [self._deadline(client)]
            if self.waits_for_endpoints:
                work.append(self._endpoints(client, pod, resource))
            await asyncio.gather(*work)
        finally:
            with contextlib.suppress(Exception):
                await client.close()

    async def _client(self) -> Any:
        try:
            if self._client_factory is not None:
                return self._client_factory()
            import httpx2
            import lightkube

            return lightkube.AsyncClient(
                namespace=self.identity.namespace,
                timeout=httpx2.Timeout(self.api_timeout_s),
            )
        except Exception as exc:
            raise _Unavailable(f"no Kubernetes credentials ({exc})") from exc

    async def _get_pod(self, client: Any) -> Any:
        from lightkube.resources.core_v1 import Pod

        return await asyncio.wait_for(
            client.get(Pod, self.identity.name, namespace=self.identity.namespace),
            self.api_timeout_s,
        )

    async def _startup_check(self, client: Any) -> tuple[Any | None, Any | None]:
        """Read the pod (and list EndpointSlices) once now, so that a missing permission
        is a warning at start, not a surprise at shutdown."""
        try:
            pod = await self._get_pod(client)
        except Exception as exc:
            self._warn(
                f"cannot read pod {self._where()} ({_describe(exc)}); "
                "the kill deadline stays the grace period"
            )
            return None, None
        resource = None
        if self.waits_for_endpoints:
            try:
                resource = await self._slice_resource(client)
            except Exception as exc:
                self._warn(
                    f"cannot list EndpointSlices in {self.identity.namespace or 'the default'}"
                    f" namespace ({_describe(exc)}); accept-until-idle will use the idle "
                    "window alone"
                )
        logger.info(
            "kubernetes: pod %s (%s)%s",
            self._where(),
            self.identity.source,
            ", waiting for its endpoints at shutdown" if self.waits_for_endpoints else "",
        )
        return pod, resource

    def _where(self) -> str:
        return f"{self.identity.namespace or '(default namespace)'}/{self.identity.name}"

    async def _deadline(self, client: Any) -> None:
        requested = self._requested_wall
        coordinator = self._coordinator
        assert requested is not None
        assert coordinator is not None
        try:
            pod = await self._get_pod(client)
        except Exception as exc:
            self._warn(f"cannot read pod {self._where()} at shutdown ({_describe(exc)})")
            return
        found = _pod_deadline(
            pod, requested, coordinator.grace_period_s is not None, self.clock_skew_s
        )
        if found is None:
            logger.info(
                "kubernetes: pod %s has no deletionTimestamp (not being deleted: a "
                "container restart or a plain kill); the kill deadline stays the grace period",
                self._where(),
            )
            return
        at, why = found
        self._report(lambda c: c.set_kill_deadline(at, source=why))

    def _fall_back(self, reason: str) -> None:
        """Let accept-until-idle's window start now, as without this integration."""
        if self.waits_for_endpoints and self._requested_wall is not None:
            logger.info("kubernetes: endpoint state unknown (%s); using the idle window", reason)
            self._report(lambda c: c.notify_endpoint_removed())

    async def _endpoints(self, client: Any, pod: Any | None, resource: Any | None) -> None:
        """Watch the namespace's EndpointSlices until none routes to the pod."""
        try:
            if pod is None:
                pod = await self._get_pod(client)
            pod_ip = pod.status.podIP if pod.status is not None else None
            if resource is None:
                resource = await self._slice_resource(client)
        except Exception as exc:
            self._warn(f"cannot read the pod's endpoints ({_describe(exc)})")
            self._fall_back(_describe(exc))
            return
        slices: dict[str, Mapping[str, Any]] = {}
        version: str | None = None
        broken_since: float | None = None
        backoff = _BACKOFF_START_S
        name = pod.metadata.name
        while True:
            try:
                if version is None:
                    slices, version = await self._list(client, resource)
                    broken_since, backoff = None, _BACKOFF_START_S
                    if self._check(slices, name, pod_ip):
                        return
                    if not self._watching:
                        self._watching = True
                        state = endpoint_state(slices, pod_name=name, pod_ip=pod_ip)
                        logger.info(
                            "kubernetes: pod %s is ready in %d of the %d EndpointSlice(s) "
                            "that list it; watching them",
                            self._where(),
                            state.ready,
                            state.listed,
                        )
                events = client.watch(
                    resource,
                    namespace=self.identity.namespace,
                    resource_version=version,
                    server_timeout=_WATCH_SERVER_TIMEOUT_S,
                ).__aiter__()
                try:
                    while True:
                        try:
                            kind, obj = await asyncio.wait_for(
                                events.__anext__(), self.api_timeout_s
                            )
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
                        if self._check(slices, name, pod_ip):
                            return
                finally:
                    with contextlib.suppress(Exception):
                        await events.aclose()
            except Exception as exc:
                if _status(exc) == 410:  # the version expired: list afresh
                    version = None
                    continue
                if _status(exc) in (401, 403, 404):
                    self._warn(f"cannot watch EndpointSlices ({_describe(exc)})")
                    self._fall_back(_describe(exc))
                    return
                now = time.monotonic()
                broken_since = now if broken_since is None else broken_since
                if now - broken_since > self.api_timeout_s:
                    self._warn(
                        f"the EndpointSlice watch is broken ({_describe(exc)}) for "
                        f"{now - broken_since:.1f} s"
                    )
                    self._fall_back("the watch is broken")
                    return
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, _BACKOFF_MAX_S)

    async def _slice_resource(self, client: Any) -> Any:
        """``discovery.k8s.io/v1`` EndpointSlices, else ``v1beta1`` (Kubernetes < 1.21)."""
        from lightkube.generic_resource import create_namespaced_resource

        last: Exception | None = None
        for version in ("v1", "v1beta1"):
            resource = create_namespaced_resource(
                _DISCOVERY, version, "EndpointSlice", "endpointslices"
            )
            try:
                await self._list(client, resource, limit=1)
            except Exception as exc:
                if _status(exc) != 404:
                    raise
                last = exc
                continue
            return resource
        assert last is not None
        raise last

    async def _list(
        self, client: Any, resource: Any, *, limit: int | None = None
    ) -> tuple[dict[str, Mapping[str, Any]], str]:
        async def collect() -> tuple[dict[str, Mapping[str, Any]], str]:
            found = client.list(resource, namespace=self.identity.namespace, chunk_size=limit)
            items = {}
            async for item in found:
                items[item.metadata.name] = item
                if limit is not None:
                    break
            try:
                return items, found.resourceVersion
            except Exception:  # lightkube: none before the first chunk
                return items, ""

        return await asyncio.wait_for(collect(), self.api_timeout_s)

    def _check(self, slices: Mapping[str, Mapping[str, Any]], name: str, ip: str | None) -> bool:
        state = endpoint_state(slices, pod_name=name, pod_ip=ip)
        if not state.removed:
            return False
        if state.listed:
            what = f"not ready in the {state.listed} EndpointSlice(s) that list it"
        else:
            what = "listed in no EndpointSlice"
        logger.info("kubernetes: pod %s is %s", self._where(), what)
        self._report(lambda c: c.notify_endpoint_removed())
        return True


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    code = getattr(status, "code", None)
    if isinstance(code, int):
        return code
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    message = getattr(status, "message", None)
    code = _status(exc)
    if message:
        return f"{code}: {message}" if code else str(message)
    text = str(exc) or type(exc).__name__
    return f"{code}: {text}" if code else text
