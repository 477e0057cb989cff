"""Fixtures for the tests against a real Kubernetes control plane.

The control plane (:mod:`graceful._demo._kube`) needs root and binaries built once by
``tools/kube/build.sh``.  Without them these tests are skipped with one reason naming the
command — except where ``GRACEFUL_REQUIRE_KUBERNETES=1`` (CI, ``nox -s kubernetes``):
there a missing control plane is an error, never a silent skip.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from graceful._demo._kube import Cluster, unavailable
from graceful._demo._kuberollout import service

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("GRACEFUL_REQUIRE_KUBERNETES") == "1"
#: The kubeconfig of ServiceAccount ``web`` (examples/kubernetes/rbac.yaml), by cluster.
SA_KUBECONFIG: dict[int, Path] = {}
#: A token user the API server knows and RBAC grants nothing.
NOBODY_TOKEN = "nobody-" + os.urandom(8).hex()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = unavailable()
    if reason is None:
        return
    here = Path(__file__).parent
    ours = [item for item in items if here in Path(item.path).parents]
    if ours and REQUIRED:
        raise pytest.UsageError(f"GRACEFUL_REQUIRE_KUBERNETES=1 but {reason}")
    for item in ours:
        item.add_marker(pytest.mark.skip(reason=reason))


def apply_rbac(cluster: Cluster) -> None:
    """examples/kubernetes/rbac.yaml's Role and RoleBinding (the ServiceAccount is made
    with its token)."""
    yaml = pytest.importorskip("yaml")
    for doc in yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "rbac.yaml").read_text()):
        kind = doc["kind"]
        if kind == "ServiceAccount":
            continue
        plural = {"Role": "roles", "RoleBinding": "rolebindings"}[kind]
        cluster.api("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/default/{plural}", doc)


@pytest.fixture(scope="session")
def clusters() -> Iterator[Callable[[float], Cluster]]:
    """One control plane per kube-proxy sync period, shared by the session: each with the
    ``web`` Service, the example RBAC and a ServiceAccount ``web`` bound to it."""
    made: dict[float, Cluster] = {}

    def get(sync_period_s: float) -> Cluster:
        if sync_period_s not in made:
            cluster = Cluster(sync_period_s=sync_period_s, users={"nobody": NOBODY_TOKEN})
            made[sync_period_s] = cluster
            service(cluster)
            apply_rbac(cluster)
            SA_KUBECONFIG[id(cluster)] = cluster.service_account_kubeconfig("web")
        return made[sync_period_s]

    yield get
    for cluster in made.values():
        cluster.close()


@pytest.fixture
def cluster(clusters: Callable[[float], Cluster]) -> Cluster:
    """The control plane with kube-proxy syncing every second."""
    return clusters(1.0)


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
) -> dict[str, Any]:
    """A pod of the ``web`` Service, its name, namespace and IP from the downward API."""
    variables: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if kubeconfig is not None:
        variables.append({"name": "KUBECONFIG", "value": str(kubeconfig)})
    variables += [{"name": k, "value": v} for k, v in (env or {}).items()]
    return {
        "metadata": {"name": name, "labels": {"app": "web"}},
        "spec": {
            "terminationGracePeriodSeconds": grace_s,
            "containers": [
                {
                    "name": "web",
                    "image": "none",
                    "command": command,
                    "env": variables,
                    "ports": [{"name": "http", "containerPort": 8000}],
                    "readinessProbe": {
                        "httpGet": {"path": readiness_path, "port": "http"},
                        "periodSeconds": probe_period_s,
                        "failureThreshold": failure_threshold,
                    },
                }
            ],
        },
    }


def graceful_run(*options: str) -> list[str]:
    """``graceful run`` of the demo app on the pod's IP."""
    return [
        sys.executable, "-m", "graceful", "run", "graceful._demo.app:app",
        "--host", "$(POD_IP)", "--port", "8000", *options,
    ]  # fmt: skip


def stock_uvicorn() -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", "graceful._demo.app:app",
        "--host", "$(POD_IP)", "--port", "8000",
    ]  # fmt: skip
