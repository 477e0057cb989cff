"""graceful.kubernetes against a real control plane: kube-apiserver 1.20, the
endpointslice controller and kube-proxy in a private network namespace, the kubelet's
part played by :mod:`graceful._demo._kubelet` (see :mod:`graceful._demo._kube`)."""

from __future__ import annotations

import datetime
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from graceful._demo._kube import ApiError, Cluster
from graceful._demo._kubelet import Kubelet
from graceful._demo._kuberollout import RBAC_RULES, graceful_run, pod_manifest
from graceful.kubernetes import endpoint_state

from .conftest import NOBODY_TOKEN, ROOT, SA_KUBECONFIG

pytestmark = pytest.mark.timeout(180)

_names = iter(range(1, 10_000))
#: How far apart the read-time stamps of two pod log lines may be from the moments
#: the lines were written (CI saw 0.97 s between lines written 1 s apart).
STAMP_JITTER_S = 0.1
#: A pod log line: its time (RFC 3339, as the kubelet stamps it), uvicorn's level prefix
#: (graceful's lines go through uvicorn's handler), the message.
LOG_TIME = re.compile(r"^(\S+) (?:[A-Z]+:\s+)?(.*)$", re.M)


def events(log: str) -> list[tuple[float, str]]:
    """graceful's log lines: (wall-clock time, message)."""
    return [
        (
            datetime.datetime.fromisoformat(stamp).timestamp(),
            message,
        )
        for stamp, message in LOG_TIME.findall(log)
    ]


def first(log: str, pattern: str) -> tuple[float, re.Match[str]]:
    for at, message in events(log):
        if (match := re.search(pattern, message)) is not None:
            return at, match
    raise AssertionError(f"no line matching {pattern!r} in:\n{log[-4000:]}")


def start(cluster: Cluster, *options: str, kubeconfig: Path | None, **kw: Any) -> Kubelet:
    name = f"web-{next(_names)}"
    pod = Kubelet(cluster, pod_manifest(name, graceful_run(*options), kubeconfig=kubeconfig, **kw))
    pod.start()
    assert pod.ready.wait(30), pod.log()
    return pod


def wait_routed(cluster: Cluster, pod: Kubelet, timeout_s: float = 20) -> None:
    """Until an EndpointSlice routes to ``pod``: the endpointslice controller follows the
    pod's Ready condition a moment later (under load, more), and a test that signals the
    pod before then sees it 'not ready' from the start."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = cluster.api(
            "GET", "/apis/discovery.k8s.io/v1beta1/namespaces/default/endpointslices"
        )
        slices = {item["metadata"]["name"]: item for item in found.get("items", [])}
        if endpoint_state(slices, pod_name=pod.name, pod_ip=None).ready:
            return
        assert time.monotonic() < deadline, f"no EndpointSlice routes to {pod.name}"
        time.sleep(0.05)  # polls the API server, bounded by the deadline above


def wait_exit(pod: Kubelet, timeout_s: float = 30) -> None:
    assert pod.gone.wait(timeout_s) or pod.proc is None or pod.proc.poll() is not None, pod.log()


def contains(got: Any, want: Any) -> bool:
    """``got`` has everything ``want`` has (dicts: each key; lists: item by item)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(
            k in got and contains(got[k], v) for k, v in want.items()
        )
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(contains, got, want))
    return bool(got == want)


def test_manifests_apply_and_read_back(cluster: Cluster) -> None:
    """examples/kubernetes/ is accepted by a real API server and reads back unchanged."""
    yaml = pytest.importorskip("yaml")
    paths = {
        "Deployment": "/apis/apps/v1/namespaces/default/deployments",
        "Service": "/api/v1/namespaces/default/services",
        # Kubernetes 1.20 serves PodDisruptionBudget as policy/v1beta1 only (v1 from 1.21,
        # the same fields): the one translation this test makes.
        "PodDisruptionBudget": "/apis/policy/v1beta1/namespaces/default/poddisruptionbudgets",
        "ServiceAccount": "/api/v1/namespaces/default/serviceaccounts",
        "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles",
        "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings",
    }
    seen = set()
    for path in sorted((ROOT / "examples" / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kind = doc["kind"]
            seen.add(kind)
            if kind == "PodDisruptionBudget":
                assert doc["apiVersion"] == "policy/v1"
                doc["apiVersion"] = "policy/v1beta1"
            doc["metadata"]["name"] = "example-" + doc["metadata"]["name"]
            if kind == "Service":
                doc["spec"].pop("clusterIP", None)
            sent = dict(doc)
            created = cluster.api("POST", paths[kind], sent)
            back = cluster.api("GET", f"{paths[kind]}/{doc['metadata']['name']}")
            assert back["metadata"]["uid"] == created["metadata"]["uid"]
            if kind == "Deployment":
                want = doc["spec"]["template"]["spec"]["containers"][0]
                got = back["spec"]["template"]["spec"]["containers"][0]
                # What was sent reads back, plus the server's defaults.
                assert contains(got, want)
                # The preStop hook is graceful's endpoint on the management port (it
                # drains), never a sleep.
                assert got["lifecycle"]["preStop"]["httpGet"]["port"] == "management"
            if kind == "Role":
                assert back["rules"] == doc["rules"]
            cluster.api("DELETE", f"{paths[kind]}/{doc['metadata']['name']}")
    assert seen == set(paths)


def test_the_demo_grants_what_the_example_role_grants() -> None:
    yaml = pytest.importorskip("yaml")
    docs = yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "rbac.yaml").read_text())
    (role,) = (doc for doc in docs if doc["kind"] == "Role")
    assert role["rules"] == list(RBAC_RULES)


def test_kill_deadline_is_the_deletion_timestamp(cluster: Cluster) -> None:
    """No grace period configured: the deadline comes from the pod (grace 8 s), and the
    log line names the deletionTimestamp the API server set."""
    pod = start(
        cluster,
        "--kubernetes",
        "--policy",
        "serve-until-killed",
        kubeconfig=SA_KUBECONFIG[id(cluster)],
        grace_s=8,
    )
    pod.delete()
    wait_exit(pod)
    log = pod.log()
    assert pod.deletion_timestamp is not None
    stamp = datetime.datetime.fromtimestamp(pod.deletion_timestamp, datetime.timezone.utc)
    at, match = first(log, r"kill deadline from (.*): SIGKILL in ([\d.]+) s")
    assert match[1] == (
        f"the pod's deletionTimestamp {stamp:%Y-%m-%dT%H:%M:%SZ} less 1 s for clock skew"
    )
    assert float(match[2]) == pytest.approx(pod.deletion_timestamp - 1 - at, abs=0.2)
    # serve-until-killed planned against that deadline (with nothing measured it keeps
    # half of what is left to drain), not against the assumed 30 s, and left in time.
    assert pod.exit_status == 0
    assert not pod.killed
    assert pod.timeline["exited"] < pod.deletion_timestamp - 1
    assert pod.timeline["exited"] - pod.timeline["delete_requested"] < 8 / 2 + 1


def test_accepting_ends_after_the_endpoint_update_plus_idle_and_not_before(
    cluster: Cluster,
) -> None:
    """SIGTERM without a deletion (what ``kubectl exec … kill 1`` does): the endpoint
    stays ready until the readiness probe has failed three times (3 s), and accepting
    waits for that, then the idle window (without ``--kubernetes`` the window starts at
    SIGTERM and would end after 1 s, while kube-proxy still routes here)."""
    pod = start(
        cluster,
        "--kubernetes",
        "--idle",
        "1",
        "--grace-period",
        "20",
        kubeconfig=SA_KUBECONFIG[id(cluster)],
        failure_threshold=3,
    )
    sigterm_waits_for_the_endpoint_then_idle(cluster, pod, idle_s=1.0, at_most_s=1.5)
    log = pod.log()
    # The pod's readinessProbe, read at start: the kubelet is a declared health checker.
    first(log, r"the kubelet takes the pod out of its endpoints after 3 failed readiness probes")
    first(log, r"has no deletionTimestamp \(not being deleted: a container restart, a node")


def test_a_sigterm_after_the_prestop_sleep_does_not_wait_the_idle_window_again(
    cluster: Cluster,
) -> None:
    """preStop ``exec: sleep 4`` (1.20 keeps ``exec``; ``sleep:``, 1.29+, is read the same
    way: tests/kubernetes/test_spec.py): the kubelet sends SIGTERM after it, when the
    endpoint went at the deletion already — the idle window (6 s) counts from the
    deletion, so accepting ends about 2 s after SIGTERM, not 6 s after it."""
    name = f"web-{next(_names)}"
    # The probes on the management port: before SIGTERM a probe's connection to the
    # app's port counts as activity (its request is not looked at until SIGTERM).
    options = ("--kubernetes", "--idle", "6", "--grace-period", "20", "--management-port", "8081")
    manifest = pod_manifest(
        name,
        graceful_run(*options),
        kubeconfig=SA_KUBECONFIG[id(cluster)],
        grace_s=20,
        management_port=8081,
    )
    manifest["spec"]["containers"][0]["lifecycle"] = {
        "preStop": {"exec": {"command": ["sleep", "4"]}}
    }
    pod = Kubelet(cluster, manifest)
    pod.start()
    assert pod.ready.wait(30), pod.log()
    wait_routed(cluster, pod)
    pod.delete()
    wait_exit(pod)
    log = pod.log()
    sigterm, _ = first(log, r"serving -> accepting: SIGTERM")
    first(log, r"SIGTERM came [\d.]+ s after the pod's deletion, after its preStop sleep of 4 s")
    draining, _ = first(log, r"accepting -> draining: no new connection for")
    print(f"preStop sleep 4 s, idle 6 s: accepting ended {draining - sigterm:.2f} s after SIGTERM")
    assert draining - sigterm < 6.0 - 1.5, log  # ~2 s; 6 s counted from SIGTERM
    assert pod.exit_status == 0
    assert not pod.killed


def sigterm_waits_for_the_endpoint_then_idle(
    cluster: Cluster, pod: Kubelet, *, idle_s: float, at_most_s: float | None = None
) -> None:
    """SIGTERM to the pod's process (no deletion): the endpoint goes not-ready after
    three failed probes, accepting ends ``idle_s`` after that (within ``at_most_s``
    more), and the process exits 0."""
    wait_routed(cluster, pod)
    assert pod.proc is not None
    term = time.time()
    pod.proc.send_signal(signal.SIGTERM)
    pod.proc.wait(30)
    log = pod.log()
    removed, _ = first(log, r"pod default/\S+ is not ready in the 1 EndpointSlice")
    draining, _ = first(log, r"accepting -> draining: no new connection for")
    assert removed - term > 2.0  # three failed probes, a second apart
    # The idle window, from the endpoint update.  The stamps are the log copier's read
    # times (as a container runtime's are): each may lag its line by tens of ms.
    assert draining - removed >= idle_s - STAMP_JITTER_S
    if at_most_s is not None:
        assert draining - removed < idle_s + at_most_s
    assert pod.proc.returncode == 0


def test_no_rbac_permission_warns_once_and_falls_back(cluster: Cluster) -> None:
    kubeconfig = cluster.kubeconfig("nobody", token=NOBODY_TOKEN)
    options = ("--kubernetes", "--idle", "1", "--grace-period", "10")
    pod = start(cluster, *options, kubeconfig=kubeconfig)
    pod.delete()
    wait_exit(pod)
    log = pod.log()
    warnings = [m for _, m in events(log) if m.startswith("kubernetes: cannot")]
    assert len(warnings) == 1, log
    assert 'pods \\"' in warnings[0] or "forbidden" in warnings[0], warnings
    assert "endpoint state unknown" in log  # the idle window alone
    assert "kill deadline from the pod" not in log
    assert pod.exit_status == 0
    assert pod.timeline["exited"] - pod.timeline["delete_requested"] < 10 - 1


def test_apiserver_stopped_mid_watch_does_not_hang_the_shutdown(cluster: Cluster) -> None:
    """The API server freezes (SIGSTOP: no error, no data) while the pod waits for its
    endpoint: a warning after the API timeout, then the idle window; exit long before
    max-wait.  The group's own control plane (its tests run one at a time): resumed, the
    pod deleted and out of kube-proxy's rules before the next test."""
    pod = start(
        cluster,
        "--kubernetes",
        "--idle",
        "1",
        "--grace-period",
        "60",
        "--max-wait",
        "40",
        # About the API, not the kubelet: graceful would wait for the 100 failed
        # probes the kubelet needs to drop the endpoint (up to max-wait) otherwise.
        "--readiness-failures",
        "0",
        kubeconfig=SA_KUBECONFIG[id(cluster)],
        failure_threshold=100,  # the endpoint stays ready: the watch waits
    )
    assert pod.proc is not None
    try:
        wait_routed(cluster, pod)  # else the watch may find the endpoint not ready at once
        apiserver = cluster.processes["apiserver"]
        term = time.time()
        pod.proc.send_signal(signal.SIGTERM)
        try:
            deadline = time.monotonic() + 10
            while "watching them" not in pod.log():  # the watch is established
                assert time.monotonic() < deadline, pod.log()
                time.sleep(0.02)
            apiserver.send_signal(signal.SIGSTOP)
            pod.proc.wait(30)
        finally:
            apiserver.send_signal(signal.SIGCONT)
        log = pod.log()
        assert pod.proc.returncode == 0, log
        # a quiet watch re-lists after 5 s; that list times out (5 s); then the idle window
        assert time.time() - term < 5 + 5 + 5 + 1 + 3, log
        assert "kubernetes: " in log
        assert "endpoint state unknown" in log, log
    finally:
        # Its endpoint stays ready for 100 failed probes: gone before the next test
        # sends traffic to the Service (the API answers again once resumed).
        pod.delete(0)
        deadline = time.monotonic() + 30
        while cluster.proxied(pod.ip) and time.monotonic() < deadline:
            time.sleep(0.05)  # polls kube-proxy's rules, bounded by the deadline above
        pod.stop()


def test_the_pods_namespace_file_and_hostname_are_used_without_the_downward_api(
    cluster: Cluster,
) -> None:
    """Only POD_NAME comes from the downward API: the namespace falls back to the
    kubeconfig's (a pod's service-account file is not there outside a real kubelet)."""
    name = f"web-{next(_names)}"
    manifest = pod_manifest(
        name, graceful_run("--kubernetes"), kubeconfig=SA_KUBECONFIG[id(cluster)]
    )
    env = manifest["spec"]["containers"][0]["env"]
    manifest["spec"]["containers"][0]["env"] = [e for e in env if e["name"] != "POD_NAMESPACE"]
    pod = Kubelet(cluster, manifest).start()
    assert pod.ready.wait(30), pod.log()
    pod.delete()
    wait_exit(pod)
    assert f"kubernetes: pod (default namespace)/{name} (POD_NAME)" in pod.log()
    assert "kill deadline from the pod's deletionTimestamp" in pod.log()


def test_a_pod_in_no_service_is_not_waited_for(cluster: Cluster) -> None:
    name = f"lonely-{next(_names)}"
    manifest = pod_manifest(
        name, graceful_run("--kubernetes", "--idle", "1"), kubeconfig=SA_KUBECONFIG[id(cluster)]
    )
    manifest["metadata"]["labels"] = {"app": "nothing-selects-this"}
    pod = Kubelet(cluster, manifest).start()
    assert pod.ready.wait(30), pod.log()
    pod.delete()
    wait_exit(pod)
    assert "is listed in no EndpointSlice" in pod.log()
    assert pod.exit_status == 0


def test_api_errors_are_reported_with_their_status(cluster: Cluster) -> None:
    with pytest.raises(ApiError) as caught:
        cluster.api("GET", "/api/v1/namespaces/default/pods", token=NOBODY_TOKEN)
    assert caught.value.status == 403


def wsgi_command(worker: str) -> list[str]:
    """gunicorn with one of graceful's WSGI workers serving the demo's Flask app."""
    threads = ["--threads", "4"] if worker == "ThreadWorker" else []
    return [
        sys.executable, "-m", "gunicorn", "graceful._demo.wsgi_app:app",
        "-k", f"graceful.gunicorn.{worker}", *threads,
        "-b", "$(POD_IP):8000", "--graceful-timeout", "20",
    ]  # fmt: skip


@pytest.mark.parametrize("worker", ["SyncWorker", "ThreadWorker"])
def test_wsgi_worker_waits_for_the_endpoint_update_plus_idle(cluster: Cluster, worker: str) -> None:
    """The same with gunicorn's WSGI workers (``GRACEFUL_KUBERNETES=1``, a Flask app):
    accepting ends only after the endpoint update plus the idle window."""
    pod = Kubelet(
        cluster,
        pod_manifest(
            f"web-{next(_names)}",
            wsgi_command(worker),
            kubeconfig=SA_KUBECONFIG[id(cluster)],
            failure_threshold=3,
            env={"GRACEFUL_KUBERNETES": "1", "GRACEFUL_IDLE": "1"},
        ),
    )
    pod.start()
    assert pod.ready.wait(30), pod.log()
    sigterm_waits_for_the_endpoint_then_idle(cluster, pod, idle_s=1.0)
