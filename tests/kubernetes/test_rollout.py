"""A Deployment-style rollout through the real control plane and kube-proxy, clients on
the ClusterIP (:mod:`graceful._demo._kuberollout`), for stock uvicorn and each policy
with and without ``--kubernetes``, and for stock granian beside ``graceful run --server
granian``, at kube-proxy sync periods of 1 s and 5 s, the kubelet probing readiness every
second, no preStop sleep anywhere.

``GRACEFUL_ROLLOUT_RESULTS=FILE`` appends each run's outcome to FILE as a JSON line (the
figures in docs/kubernetes.md come from there)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from graceful._demo._kube import Cluster
from graceful._demo._kuberollout import (
    RolloutResult,
    graceful_run,
    pod_manifest,
    rollout,
    stock_granian,
    stock_uvicorn,
)

from .conftest import SA_KUBECONFIG

pytestmark = pytest.mark.timeout(240)

IDLE_S = 1.0
#: Each client's pace: a request every 50 ms (the demo's is 20 ms).  Fresh connections
#: still arrive every ~25 ms, far inside the 1 s idle window, and a closed listener still
#: refuses dozens within kube-proxy's 5 s; the suite's 21 rollouts spend about 20 CPU-s
#: less (the machine is shared by the other tests meanwhile).
INTERVAL_S = 0.05
#: Long enough for kube-proxy's 5 s sync and a 3 s request to drain (with 10 s, a
#: policy that keeps half of what is left for draining stops accepting at ~3.5 s).
GRACE_S = 20
#: graceful's default ``idle_grace_s``: granian's ``stop()`` comes that far into draining.
IDLE_GRACE_S = 1.0
#: Each rollout's server: a stock server's command, or graceful's (server, policy,
#: ``--kubernetes``).
SERVERS: dict[str, Callable[[], list[str]] | tuple[str, str, bool]] = {
    "uvicorn": stock_uvicorn,
    **{
        f"graceful {policy}{' --kubernetes' if kube else ''}": ("uvicorn", policy, kube)
        for policy in ("accept-until-idle", "serve-until-killed", "refuse-immediately")
        for kube in (False, True)
    },
    "granian": stock_granian,
    **{
        f"graceful --server granian {policy}{' --kubernetes' if kube else ''}": (
            "granian",
            policy,
            kube,
        )
        for policy, kube in (("accept-until-idle", False), ("accept-until-idle", True))
    },
}


def _record(sync: float, server: str, result: RolloutResult) -> None:
    path = os.environ.get("GRACEFUL_ROLLOUT_RESULTS")
    if not path:
        return
    row = {
        "sync_s": sync,
        "server": server,
        "served": result.served,
        "failed": {name: dict(c.failed) for name, c in result.clients.items()},
        "long_request": result.long_request,
        "exit_status": result.exit_status,
        "killed": result.killed,
        "exited_after_s": result.exited_after_s,
        "unproxied_after_s": result.unproxied_after_s,
        "draining_after_s": result.draining_after_s,
        "long_request_done_after_s": result.long_request_done_after_s,
    }
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("sync", [1.0, 5.0], ids=lambda s: f"sync {s:g} s")
@pytest.mark.parametrize("server", list(SERVERS))
def test_rollout(clusters: Callable[[float], Cluster], sync: float, server: str) -> None:
    if "granian" in server:
        pytest.importorskip("granian")
    cluster = clusters(sync)
    choice = SERVERS[server]

    def pod(name: str) -> dict[str, Any]:
        if callable(choice):
            return pod_manifest(
                name, choice(), kubeconfig=None, readiness_path="/", grace_s=GRACE_S
            )
        server_name, policy, kube = choice
        options = [] if server_name == "uvicorn" else ["--server", server_name]
        options += ["--policy", policy]
        if policy == "accept-until-idle":
            options += ["--idle", f"{IDLE_S:g}"]
        # Without the API the grace period must be repeated in the app's config.
        options += ["--kubernetes"] if kube else ["--grace-period", str(GRACE_S)]
        return pod_manifest(
            name,
            graceful_run(*options),
            kubeconfig=SA_KUBECONFIG[id(cluster)],
            grace_s=GRACE_S,
        )

    result = rollout(cluster, pod, interval_s=INTERVAL_S)
    _record(sync, server, result)
    summary = f"{server}, sync {sync:g} s: {result.summary()}"
    print(summary)
    assert not result.kubelet_errors, result.kubelet_errors
    assert result.served > 0, summary
    if callable(choice):
        if sync >= 5:  # kube-proxy routes to a closed listener for seconds
            assert result.failures > 0, summary
        return
    server_name, policy, kube = choice
    # Every graceful policy finishes the long request and leaves before SIGKILL.
    assert result.long_request == "200", summary
    assert result.exit_status == 0, (summary, result.log[-3000:])
    assert not result.killed, summary
    if policy != "refuse-immediately":
        # Kept accepting while kube-proxy still routed here: nothing refused or cut.
        assert result.failures == 0, (summary, result.log[-3000:])
    if policy == "accept-until-idle" and kube:
        assert "kill deadline from the pod's deletionTimestamp" in result.log
        exited, unproxied = result.exited_after_s, result.unproxied_after_s
        draining, long_done = result.draining_after_s, result.long_request_done_after_s
        assert exited is not None
        assert unproxied is not None
        assert draining is not None
        assert long_done is not None
        # Accepting ends within a second of (gone from kube-proxy's rules + the idle
        # window), and the pod leaves as soon as that and the long request allow —
        # granian's idle grace later: graceful cannot see granian's idle connections, so
        # its stop() comes idle_grace_s into draining whether any are left or not.
        assert draining <= unproxied + IDLE_S + 1.0, summary
        idle_grace_s = IDLE_GRACE_S if server_name == "granian" else 0.0
        assert exited <= max(unproxied + IDLE_S, long_done) + idle_grace_s + 1.0, summary


def test_rollout_with_probes_and_prestop_on_the_management_port(
    clusters: Callable[[float], Cluster],
) -> None:
    """examples/kubernetes' way: the readiness probe and a preStop ``httpGet`` on
    ``--management-port``, the Service on the app's port: the kubelet's preStop starts
    the drain there and is answered once drained; nothing is lost."""
    cluster = clusters(1.0)

    def pod(name: str) -> dict[str, Any]:
        options = ["--policy", "accept-until-idle", "--idle", f"{IDLE_S:g}", "--kubernetes"]
        options += ["--management-port", "9000", "--prestop-path", "/prestop"]
        return pod_manifest(
            name,
            graceful_run(*options),
            kubeconfig=SA_KUBECONFIG[id(cluster)],
            grace_s=GRACE_S,
            management_port=9000,
            prestop_path="/prestop",
        )

    result = rollout(cluster, pod, interval_s=INTERVAL_S)
    summary = f"management port, sync 1 s: {result.summary()}"
    print(summary)
    assert not result.kubelet_errors, result.kubelet_errors
    assert result.served > 0, summary
    assert "management listener on" in result.log, result.log[-3000:]
    assert "serving -> accepting: preStop" in result.log, result.log[-3000:]
    assert "answered on the app's port" not in result.log
    assert result.long_request == "200", summary
    assert (result.exit_status, result.killed) == (0, False), (summary, result.log[-3000:])
    assert result.failures == 0, (summary, result.log[-3000:])
