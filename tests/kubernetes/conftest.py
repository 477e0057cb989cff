"""Fixtures for the tests against a real Kubernetes control plane.

The control plane (:mod:`graceful._demo._kube`) needs root and binaries built once by
``tools/kube/build.sh``.  Without them these tests are skipped with one reason naming the
command — except where ``GRACEFUL_REQUIRE_KUBERNETES=1`` (CI, ``nox -s kubernetes``):
there a missing control plane is an error, never a silent skip.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from graceful._demo._kube import Cluster, unavailable
from graceful._demo._kuberollout import service

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("GRACEFUL_REQUIRE_KUBERNETES") == "1"
#: The kubeconfig of ServiceAccount ``web`` (examples/kubernetes/rbac.yaml), by cluster.
SA_KUBECONFIG: dict[int, Path] = {}
#: A token user the API server knows and RBAC grants nothing.
NOBODY_TOKEN = "nobody-" + os.urandom(8).hex()


#: The rollouts at a 5 s kube-proxy sync, in two groups of about the same length.
_SLOW_SYNC_B = ("serve-until-killed", "refuse-immediately --kubernetes", "granian")


def _xdist_group(item: pytest.Item) -> str:
    """Under pytest-xdist (``--dist loadgroup``) the tests of a group share a worker and
    so its control planes (one per sync period, started once per worker): the demo
    (which runs its own), the other tests, the rollouts at a 1 s sync, and the slower
    rollouts at a 5 s sync in two parts — five groups of one to two minutes each, instead
    of one of seven (each group starts its control planes: fewer is less CPU at the
    start, when every worker starts)."""
    if Path(item.path).name == "test_demo.py":
        return "kubernetes-demo"
    callspec = getattr(item, "callspec", None)
    if callspec is None or "sync" not in callspec.params:
        return "kubernetes"
    if callspec.params["sync"] == 1.0:
        return "kubernetes-rollout-sync-1"
    server = str(callspec.params.get("server", ""))
    half = "b" if any(part in server for part in _SLOW_SYNC_B) else "a"
    return f"kubernetes-rollout-sync-5-{half}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    # test_pod.py and test_spec.py need no API server: the pod's arithmetic and fields on
    # objects as the API serves them.
    pure = ("test_pod.py", "test_spec.py")
    ours = [
        item
        for item in items
        if here in Path(item.path).parents and Path(item.path).name not in pure
    ]
    for item in ours:
        group = _xdist_group(item)
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[_GROUP_KEY] = group
    reason = unavailable()
    if reason is None:
        return
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


#: This process's control planes, by kube-proxy sync period (``clusters``).
_MADE: dict[float, Cluster] = {}
#: The tests of each group of ours this session runs, and how many have run here.
_GROUP_SIZE: dict[str, int] = {}
_GROUP_RUN: dict[str, int] = {}
_GROUP_KEY = pytest.StashKey[str]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Count the tests of each group this session runs (after ``-k`` and the like)."""
    for item in session.items:
        group = item.stash.get(_GROUP_KEY, None)
        if group is not None:
            _GROUP_SIZE[group] = _GROUP_SIZE.get(group, 0) + 1


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Close this process's control planes as soon as every group of ours it began is
    over: an idle API server and etcd cost CPU for the rest of the session (under
    xdist's ``loadgroup`` a group runs whole on one worker, which may still have minutes
    of other tests).  A group that comes later starts them again (``clusters``)."""
    group = item.stash.get(_GROUP_KEY, None)
    if group is None:
        return
    _GROUP_RUN[group] = _GROUP_RUN.get(group, 0) + 1
    if any(_GROUP_RUN[g] < _GROUP_SIZE.get(g, 0) for g in _GROUP_RUN):
        return
    while _MADE:
        _MADE.popitem()[1].close()


@pytest.fixture(scope="session")
def clusters() -> Iterator[Callable[[float], Cluster]]:
    """One control plane per kube-proxy sync period, shared by the session's tests while
    a group of ours runs here: each with the ``web`` Service, the example RBAC and a
    ServiceAccount ``web`` bound to it."""
    made = _MADE

    def get(sync_period_s: float) -> Cluster:
        if sync_period_s not in made:
            cluster = Cluster(sync_period_s=sync_period_s, users={"nobody": NOBODY_TOKEN})
            made[sync_period_s] = cluster
            service(cluster)
            apply_rbac(cluster)
            SA_KUBECONFIG[id(cluster)] = cluster.service_account_kubeconfig("web")
        return made[sync_period_s]

    yield get
    while made:
        made.popitem()[1].close()


@pytest.fixture
def cluster(clusters: Callable[[float], Cluster]) -> Cluster:
    """The control plane with kube-proxy syncing every second."""
    return clusters(1.0)
