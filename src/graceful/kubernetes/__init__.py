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
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from typing_extensions import final

from .._core.coordinator import _check_coordinator
from .._core.engine import _check_callable
from .._core.policy import AcceptUntilIdle, Phase, _check_seconds
from . import _spec
from ._api import _describe, _Unavailable, get_pod, open_client, read_kill_deadline
from ._pod import (
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    EndpointState,
    PodIdentity,
    _check_optional_str,
    _pod_deadline,
    endpoint_state,
    kill_deadline,
    pod_identity,
)
from ._pod import _timestamp as _timestamp  # tests/kubernetes/test_pod.py
from ._watch import slice_resource, watch_endpoints

if TYPE_CHECKING:
    from .._core.coordinator import ShutdownCoordinator

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
        self._container: _spec.Container | None = None  # read at start

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

        from .._core.signals import current_schedule

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
            client = await asyncio.wait_for(
                open_client(self._client_factory, self.identity.namespace, self.api_timeout_s),
                self.api_timeout_s,
            )
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

    async def _get_pod(self, client: Any) -> Any:
        return await get_pod(client, self.identity, self.api_timeout_s)

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
                resource = await slice_resource(client, self.identity.namespace, self.api_timeout_s)
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
        if pod is not None:
            self._read_spec(pod)
        return pod, resource

    def _read_spec(self, pod: Any) -> None:
        """The container's readiness probe, preStop sleep and stop signal: one line each
        (see ``graceful.kubernetes._spec``)."""
        found = _spec.container(pod)
        if isinstance(found, str):
            logger.info("kubernetes: %s", found)
            return
        self._container = found
        if found.readiness is not None:
            failures, period = found.readiness
            logger.info(
                "kubernetes: the kubelet takes the pod out of its endpoints after %d failed "
                "readiness probes %g s apart; at a SIGTERM without a deletion, accepting "
                "waits for them",
                failures,
                period,
            )
            self._report(
                lambda c: c.health_checkers.expect(
                    _spec.KUBELET_AGENT, failures=failures, period_s=period
                )
            )
        warning = _spec.stop_signal_warning(
            found.stop_signal, under_gunicorn="gunicorn.arbiter" in sys.modules
        )
        if warning is not None:
            logger.warning("kubernetes: %s", warning)

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
            why = _spec.disruption(pod)
            logger.info(
                "kubernetes: pod %s has no deletionTimestamp (%s); the kill deadline stays "
                "the grace period",
                self._where(),
                f"DisruptionTarget {why}: its budget may be shorter than the grace period"
                if why
                else "not being deleted: a container restart, a node shutdown or a plain kill",
            )
            return
        at, why = found
        self._report(lambda c: c.set_kill_deadline(at, source=why))
        # Deleted: the endpoint controller drops the endpoint now, whatever the kubelet's
        # probes say; only a SIGTERM without a deletion waits for them.
        self._report(lambda c: c.health_checkers.release_declared())
        self._after_prestop_sleep(pod, requested)

    def _after_prestop_sleep(self, pod: Any, requested_wall: float) -> None:
        """A SIGTERM that came after the container's preStop sleep: the endpoint went at
        the deletion, so the idle window counts from then, not once more from now."""
        slept = _spec.after_prestop_sleep(self._container, pod, requested_wall)
        if slept is None or not self.waits_for_endpoints:
            return
        deleted, waited, sleep_s = slept
        logger.info(
            "kubernetes: SIGTERM came %.1f s after the pod's deletion, after its preStop "
            "sleep of %g s: its endpoint is gone already; the idle window counts from "
            "the deletion",
            waited,
            sleep_s,
        )
        self._report(lambda c: _removed(c, max(0.0, time.time() - deleted)))

    def _fall_back(self, reason: str) -> None:
        """Let accept-until-idle's window start now, as without this integration."""
        if self.waits_for_endpoints and self._requested_wall is not None:
            logger.info("kubernetes: endpoint state unknown (%s); using the idle window", reason)
            self._report(lambda c: c.notify_endpoint_removed())

    async def _endpoints(self, client: Any, pod: Any | None, resource: Any | None) -> None:
        """Watch the namespace's EndpointSlices until none routes to the pod."""
        namespace = self.identity.namespace
        try:
            if pod is None:
                pod = await self._get_pod(client)
            pod_ip = pod.status.podIP if pod.status is not None else None
            if resource is None:
                resource = await slice_resource(client, namespace, self.api_timeout_s)
        except Exception as exc:
            self._warn(f"cannot read the pod's endpoints ({_describe(exc)})")
            self._fall_back(_describe(exc))
            return
        await watch_endpoints(
            client,
            resource,
            namespace=namespace,
            pod_name=pod.metadata.name,
            pod_ip=pod_ip,
            api_timeout_s=self.api_timeout_s,
            where=self._where(),
            removed=lambda: self._report(_removed),
            failed=self._give_up,
        )

    def _give_up(self, warning: str, reason: str) -> None:
        """The endpoint watch cannot go on: one warning, and the idle window alone."""
        self._warn(warning)
        self._fall_back(reason)


def _removed(coordinator: ShutdownCoordinator, seconds_ago: float = 0.0) -> None:
    """The pod left its endpoints: the idle window may start, and the kubelet's readiness
    probe no longer needs to fail for traffic to stop."""
    coordinator.notify_endpoint_removed(seconds_ago=seconds_ago)
    coordinator.health_checkers.release_declared()
