"""A Deployment-style rollout through the real control plane, with clients on the ClusterIP.

The sequence is a Deployment's with ``maxSurge: 1, maxUnavailable: 0``: the old pod
serves; the new pod starts and becomes Ready; once kube-proxy routes to it, the old pod
is deleted — the endpointslice controller marks it terminating, kube-proxy drops it at
its own pace (``--iptables-min-sync-period``) and the kubelet SIGTERMs it at once (no
preStop sleep).  Meanwhile clients inside the namespace use the Service's ClusterIP, as
in-cluster callers do:

* keep-alive clients reuse one connection (and open a new one when the server asks them
  to close it), a request every ``interval_s`` (20 ms);
* fresh-connection clients open a connection per request;
* one long request (``/slow?s=…``) is sent just before the deletion.

Every request is bounded (3 s) and counted as served, or failed by kind: ``refused`` (the
connection was refused: kube-proxy's REJECT or a closed listener), ``reset`` (the
connection broke before a full response), ``timeout``, ``5xx``.  The clients go on until
the old pod is gone and a second more.
"""

from __future__ import annotations

import collections
import datetime
import errno
import http.client
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ._kube import Cluster
from ._kubelet import Kubelet

__all__ = (
    "CLUSTER_IP",
    "RBAC_RULES",
    "RolloutResult",
    "grant",
    "graceful_run",
    "pod_manifest",
    "rollout",
    "service",
    "stock_granian",
    "stock_uvicorn",
)

CLUSTER_IP: Final = "10.96.0.100"
_REQUEST_TIMEOUT_S: Final = 3.0
_MAX_REQUESTS: Final = 5000  # per client: a bound, never reached in a normal run
_counter = iter(range(1, 1_000_000))


#: What graceful.kubernetes reads (examples/kubernetes/rbac.yaml's Role; a test keeps
#: the two equal).
RBAC_RULES: Final = (
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["list", "watch"],
    },
)


def grant(cluster: Cluster, account: str = "web") -> Path:
    """ServiceAccount ``account`` with ``RBAC_RULES`` and nothing more; its kubeconfig."""
    rbac = "/apis/rbac.authorization.k8s.io/v1/namespaces/default"
    cluster.api(
        "POST",
        f"{rbac}/roles",
        {"metadata": {"name": f"{account}-graceful-drain"}, "rules": list(RBAC_RULES)},
    )
    cluster.api(
        "POST",
        f"{rbac}/rolebindings",
        {
            "metadata": {"name": f"{account}-graceful-drain"},
            "subjects": [{"kind": "ServiceAccount", "name": account}],
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": f"{account}-graceful-drain",
            },
        },
    )
    return cluster.service_account_kubeconfig(account)


def pod_manifest(
    name: str,
    command: list[str],
    *,
    kubeconfig: Path | None,
    readiness_path: str = "/readyz",
    grace_s: int = 10,
    probe_period_s: int = 1,
    failure_threshold: int = 1,
    env: dict[str, str] | None = None,
    management_port: int | None = None,
    prestop_path: str | None = None,
) -> dict[str, Any]:
    """A pod of the ``web`` Service, its name, namespace and IP from the downward API;
    with ``management_port`` its probe (and its preStop ``httpGet`` on ``prestop_path``)
    go to that port, named ``management``."""
    variables: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if kubeconfig is not None:
        variables.append({"name": "KUBECONFIG", "value": str(kubeconfig)})
    variables += [{"name": k, "value": v} for k, v in (env or {}).items()]
    ports = [{"name": "http", "containerPort": 8000}]
    probed = "http"
    if management_port is not None:
        ports.append({"name": "management", "containerPort": management_port})
        probed = "management"
    container: dict[str, Any] = {
        "name": "web",
        "image": "none",
        "command": command,
        "env": variables,
        "ports": ports,
        "readinessProbe": {
            "httpGet": {"path": readiness_path, "port": probed},
            "periodSeconds": probe_period_s,
            "failureThreshold": failure_threshold,
        },
    }
    if prestop_path is not None:
        container["lifecycle"] = {"preStop": {"httpGet": {"path": prestop_path, "port": probed}}}
    return {
        "metadata": {"name": name, "labels": {"app": "web"}},
        "spec": {"terminationGracePeriodSeconds": grace_s, "containers": [container]},
    }


def graceful_run(*options: str) -> list[str]:
    """``graceful run`` of the demo app on the pod's IP."""
    return [
        sys.executable, "-m", "graceful", "run", "graceful._demo.app:app",
        "--host", "$(POD_IP)", "--port", "8000", *options,
    ]  # fmt: skip


def stock_uvicorn() -> list[str]:
    """Stock ``uvicorn`` serving the demo app on the pod's IP."""
    return [
        sys.executable, "-m", "uvicorn", "graceful._demo.app:app",
        "--host", "$(POD_IP)", "--port", "8000",
    ]  # fmt: skip


def stock_granian() -> list[str]:
    """Stock ``granian`` (ASGI, one worker) serving the demo app on the pod's IP."""
    return [
        sys.executable, "-m", "granian", "--interface", "asgi",
        "--host", "$(POD_IP)", "--port", "8000", "graceful._demo.app:app",
    ]  # fmt: skip


def service(cluster: Cluster, name: str = "web", *, target_port: int = 8000) -> None:
    """A ClusterIP Service ``name`` on ``CLUSTER_IP``:80 selecting ``app: name``."""
    cluster.api(
        "POST",
        "/api/v1/namespaces/default/services",
        {
            "metadata": {"name": name},
            "spec": {
                "clusterIP": CLUSTER_IP,
                "selector": {"app": name},
                "ports": [{"port": 80, "targetPort": target_port}],
            },
        },
    )


@dataclass
class ClientCounts:
    """What one kind of client saw."""

    served: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def failures(self) -> int:
        return sum(self.failed.values())


@dataclass
class RolloutResult:
    """What a rollout did to the clients and to the old pod (times from the deletion)."""

    clients: dict[str, ClientCounts]
    long_request: str
    exit_status: int | None
    killed: bool
    exited_after_s: float | None
    unproxied_after_s: float | None
    #: When the old pod stopped accepting (graceful's log), if it logs it.
    draining_after_s: float | None
    #: When the long request was answered (whichever pod served it).
    long_request_done_after_s: float | None
    deletion_timestamp_after_s: float | None
    timeline: dict[str, float]
    log: str
    kubelet_errors: list[str] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self.clients.values()) + (self.long_request != "200")

    @property
    def served(self) -> int:
        return sum(c.served for c in self.clients.values())

    def summary(self) -> str:
        parts = [
            f"{name}: {c.served} served, {c.failures} failed {dict(c.failed) or ''}".rstrip()
            for name, c in self.clients.items()
        ]
        return (
            "; ".join(parts)
            + f"; long request {self.long_request}; exit {self.exit_status}"
            + f"{' (SIGKILLed)' if self.killed else ''} at {self.exited_after_s or 0:.2f} s"
            + (
                ""
                if self.draining_after_s is None
                else f" (accepting until {self.draining_after_s:.2f} s)"
            )
            + ","
            + f" out of kube-proxy's rules at {self.unproxied_after_s or 0:.2f} s"
        )


def _classify(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED:
        return "refused"
    return "reset"


def _client(
    keep_alive: bool, stop: threading.Event, counts: ClientCounts, interval_s: float
) -> None:
    conn: http.client.HTTPConnection | None = None
    for _ in range(_MAX_REQUESTS):
        if stop.is_set():
            break
        if conn is None:
            conn = http.client.HTTPConnection(CLUSTER_IP, 80, timeout=_REQUEST_TIMEOUT_S)
        try:
            conn.request("GET", "/")
            response = conn.getresponse()
            response.read()
            if response.status >= 500:
                counts.failed["5xx"] += 1
            else:
                counts.served += 1
            if not keep_alive or response.will_close:
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as exc:
            counts.failed[_classify(exc)] += 1
            if conn is not None:
                conn.close()
            conn = None
        stop.wait(interval_s)
    if conn is not None:
        conn.close()


def _long_request(
    seconds: float, outcome: list[str], done_at: list[float], sent: threading.Event
) -> None:
    conn = http.client.HTTPConnection(CLUSTER_IP, 80, timeout=seconds + 10)
    try:
        conn.request("GET", f"/slow?s={seconds:g}")
        sent.set()
        response = conn.getresponse()
        response.read()
        outcome.append(str(response.status))
    except (OSError, http.client.HTTPException) as exc:
        outcome.append(_classify(exc))
    finally:
        done_at.append(time.time())
        sent.set()
        conn.close()


_DRAINING: Final = re.compile(r"^(\S+) .*\baccepting -> draining", re.M)


def _draining_at(log: str) -> float | None:
    """When graceful's log says accepting ended (wall clock: the pod log's time), if it does."""
    match = _DRAINING.search(log)
    if match is None:
        return None
    return datetime.datetime.fromisoformat(match[1]).timestamp()


def _wait(
    condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05
) -> float:
    """Poll ``condition`` (bounded); the monotonic time it became true (to ``poll_s``:
    each poll of kube-proxy's rules runs ``iptables``)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)
    return time.monotonic()


def rollout(
    cluster: Cluster,
    pod: Callable[[str], dict[str, Any]],
    *,
    keepalive_clients: int = 2,
    fresh_clients: int = 2,
    long_request_s: float = 3.0,
    interval_s: float = 0.02,
    timeout_s: float = 60.0,
) -> RolloutResult:
    """Replace pod ``old`` by pod ``new`` (both from ``pod(name)``) under load: each
    client sends a request every ``interval_s``."""
    run = next(_counter)
    old = Kubelet(cluster, pod(f"web-old-{run}")).start()
    new: Kubelet | None = None
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        if not old.ready.wait(timeout_s):
            raise TimeoutError(f"the old pod never became ready:\n{old.log()[-3000:]}")
        _wait(lambda: cluster.proxied(old.ip), timeout_s, "old pod in kube-proxy's rules")
        counts = {"keep-alive": ClientCounts(), "fresh connection": ClientCounts()}
        outcome: list[str] = []
        long_done: list[float] = []
        sent = threading.Event()

        def start_clients() -> None:
            for keep_alive, n in ((True, keepalive_clients), (False, fresh_clients)):
                for _ in range(n):
                    key = "keep-alive" if keep_alive else "fresh connection"
                    t = threading.Thread(
                        target=_client, args=(keep_alive, stop, counts[key], interval_s)
                    )
                    t.start()
                    threads.append(t)

        cluster.ns.call(start_clients)
        new = Kubelet(cluster, pod(f"web-new-{run}")).start()
        if not new.ready.wait(timeout_s):
            raise TimeoutError(f"the new pod never became ready:\n{new.log()[-3000:]}")
        _wait(lambda: cluster.proxied(new.ip), timeout_s, "new pod in kube-proxy's rules")

        def start_long() -> None:
            t = threading.Thread(
                target=_long_request, args=(long_request_s, outcome, long_done, sent)
            )
            t.start()
            threads.append(t)

        cluster.ns.call(start_long)
        sent.wait(5)
        time.sleep(0.1)  # the request reaches a backend (it may be either pod)
        deleted_at = old.delete()
        unproxied = _wait(
            lambda: not cluster.proxied(old.ip), timeout_s, "old pod out of kube-proxy's rules"
        )
        unproxied_after = time.time() - deleted_at - (time.monotonic() - unproxied)
        if not old.gone.wait(timeout_s):
            raise TimeoutError(f"the old pod was not gone in {timeout_s:g} s")
        time.sleep(1.0)  # a second of traffic after: the new pod serves it all
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=_REQUEST_TIMEOUT_S + long_request_s + 10)
        old.stop()
        if new is not None:
            new.delete(1)  # the kubelet SIGKILLs what is left a second later
            new.gone.wait(10)
            new.stop()
    exited = old.timeline.get("exited")
    log = old.log()
    draining = _draining_at(log)
    return RolloutResult(
        clients=counts,
        long_request=outcome[0] if outcome else "not sent",
        exit_status=old.exit_status,
        killed=old.killed,
        exited_after_s=None if exited is None else exited - deleted_at,
        unproxied_after_s=unproxied_after,
        draining_after_s=None if draining is None else draining - deleted_at,
        long_request_done_after_s=long_done[0] - deleted_at if long_done else None,
        deletion_timestamp_after_s=None
        if old.deletion_timestamp is None
        else old.deletion_timestamp - deleted_at,
        timeline={k: v - deleted_at for k, v in old.timeline.items()},
        log=log,
        kubelet_errors=old.errors + ([] if new is None else new.errors),
    )
