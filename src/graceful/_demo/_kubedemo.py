"""``graceful demo --kubernetes``: the rollout through a real control plane.

Where ``graceful demo`` simulates the load balancer, this runs the real thing on one
machine (``graceful._demo._kube``): kube-apiserver, the endpointslice controller and
kube-proxy, pods started by a played kubelet, clients on a ClusterIP.  Stock uvicorn and
``graceful run`` with and without ``--kubernetes`` each go through one rollout
(``graceful._demo._kuberollout``).  Needs root and the binaries built once; without
them it prints one line saying how to build them.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ._kube import Cluster, unavailable
from ._kuberollout import (
    RolloutResult,
    graceful_run,
    grant,
    pod_manifest,
    rollout,
    service,
    stock_uvicorn,
)

__all__ = ("KINDS", "main")

#: The servers the demo replaces, by label: ``None`` is stock uvicorn, else the options
#: of ``graceful run``.
KINDS: dict[str, list[str] | None] = {
    "stock uvicorn": None,
    "graceful run": ["--policy", "accept-until-idle"],
    "graceful run --kubernetes": ["--policy", "accept-until-idle", "--kubernetes"],
}


def main(args: argparse.Namespace) -> int:
    """Run the rollouts and print their table; 2 when the control plane cannot run."""
    reason = unavailable()
    if reason is not None:
        print(f"graceful demo --kubernetes: {reason}")
        return 2
    from rich.console import Console
    from rich.table import Table

    console = Console()
    grace = max(2, round(args.grace_period))
    rows: list[tuple[str, RolloutResult]] = []
    with console.status(f"starting the control plane (kube-proxy sync {args.sync_period:g} s)"):
        started = time.monotonic()
        cluster = Cluster(sync_period_s=args.sync_period)
    try:
        service(cluster)
        kubeconfig = grant(cluster)
        console.print(f"control plane ready in {time.monotonic() - started:.1f} s")
        for label, options in KINDS.items():

            def pod(name: str, options: list[str] | None = options) -> dict[str, Any]:
                if options is None:
                    return pod_manifest(
                        name, stock_uvicorn(), kubeconfig=None, readiness_path="/", grace_s=grace
                    )
                extra = ["--idle", f"{args.idle:g}"]
                if "--kubernetes" not in options:
                    extra += ["--grace-period", str(grace)]  # repeated in the app's config
                return pod_manifest(
                    name, graceful_run(*options, *extra), kubeconfig=kubeconfig, grace_s=grace
                )

            with console.status(f"{label}: rolling out"):
                result = rollout(
                    cluster,
                    pod,
                    keepalive_clients=args.keepalive_clients,
                    fresh_clients=args.fresh_clients,
                    long_request_s=args.long_request_s,
                )
            rows.append((label, result))
            console.print(f"{label}: {result.failures} failed")
    finally:
        cluster.close()
    table = Table(
        title=f"A rollout through kube-apiserver and kube-proxy: sync period "
        f"{args.sync_period:g} s, grace period {grace} s, accept-until-idle, idle "
        f"{args.idle:g} s, probes every second, no preStop sleep",
        caption="exit: the old pod's, in seconds after its deletion; out of rules: when "
        "kube-proxy stopped routing to it",
    )
    for column in ("server", "served", "failed", "long request", "exit", "out of rules"):
        table.add_column(column, overflow="fold")
    for label, r in rows:
        failed: dict[str, int] = {}
        for counts in r.clients.values():
            for kind, n in counts.failed.items():
                failed[kind] = failed.get(kind, 0) + n
        detail = ", ".join(f"{n} {kind}" for kind, n in sorted(failed.items()))
        status = "SIGKILL" if r.killed else f"status {r.exit_status}"
        table.add_row(
            label,
            str(r.served),
            f"{r.failures}" + (f" ({detail})" if detail else ""),
            r.long_request,
            f"{r.exited_after_s or 0:.1f} s, {status}",
            f"{r.unproxied_after_s or 0:.1f} s",
        )
    console.print(table)
    return 0
