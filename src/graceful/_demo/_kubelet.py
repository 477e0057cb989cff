"""The kubelet's part for pods on the one node of ``graceful._demo._kube.Cluster``.

Honestly and no more, what the kubelet does for a pod that matters to a shutdown:

* starts the container's command bound to the pod's IP, with the downward API's
  ``fieldRef`` variables (``metadata.name``, ``metadata.namespace``, ``status.podIP``)
  and ``$(VAR)`` expansion in ``command``, as the kubelet does;
* probes readiness as the pod spec says (``httpGet``, a new connection each time,
  ``User-Agent: kube-probe/1.20``, ``periodSeconds``, ``timeoutSeconds``,
  ``failureThreshold``) and sets the pod's ``Ready`` condition from it, which is what the
  endpointslice controller reads;
* at deletion (the pod's ``deletionTimestamp`` appears) runs the preStop hook
  (``httpGet`` or ``exec``), sends SIGTERM, keeps probing, SIGKILLs the process group at
  the ``deletionTimestamp`` if anything is left, then deletes the pod object for good
  (``gracePeriodSeconds: 0``, with its uid as precondition).

Not played: images, volumes, restarts, liveness probes, cgroups.  Every step is recorded
in ``Kubelet.timeline`` (wall-clock seconds) for the tests.
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Final

from ._kube import NODE, ApiError, Cluster

__all__ = ("Kubelet",)

USER_AGENT: Final = "kube-probe/1.20"


def _now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Kubelet:
    """Runs one pod (see the module docs).

    Args:
        cluster: The control plane.
        pod: The pod manifest (``metadata.name``, one container with ``command``, ``env``,
            ``ports``, ``readinessProbe``, ``lifecycle.preStop``;
            ``terminationGracePeriodSeconds``).
        namespace: Where the pod lives.
    """

    def __init__(self, cluster: Cluster, pod: dict[str, Any], namespace: str = "default") -> None:
        self.cluster = cluster
        self.manifest = pod
        self.namespace = namespace
        self.name: str = pod["metadata"]["name"]
        self.container: dict[str, Any] = pod["spec"]["containers"][0]
        self.log_path: Path = cluster.state / f"pod-{self.name}.log"
        self.timeline: dict[str, float] = {}
        #: What went wrong in the kubelet's own loops (empty in a good run).
        self.errors: list[str] = []
        self.exit_status: int | None = None
        self.killed = False
        self.deletion_timestamp: float | None = None
        self.ready = threading.Event()
        self.gone = threading.Event()
        self._deleting = threading.Event()
        self._stop = threading.Event()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ip = ""
        self.uid = ""

    # ----------------------------------------------------------------- start

    def start(self) -> Kubelet:
        """Create the pod object, start its process and the kubelet's loops."""
        spec = {**self.manifest["spec"], "nodeName": NODE}
        created = self.cluster.api(
            "POST",
            f"/api/v1/namespaces/{self.namespace}/pods",
            {**self.manifest, "apiVersion": "v1", "kind": "Pod", "spec": spec},
        )
        self.uid = created["metadata"]["uid"]
        self.ip = self.cluster.pod_ip()
        self._patch_status(ready=False, phase="Running")
        env = dict(os.environ)
        for item in self.container.get("env", []):
            if "value" in item:
                env[item["name"]] = str(item["value"])
            elif "valueFrom" in item:
                field = item["valueFrom"]["fieldRef"]["fieldPath"]
                env[item["name"]] = {
                    "metadata.name": self.name,
                    "metadata.namespace": self.namespace,
                    "status.podIP": self.ip,
                }[field]
        command = [
            re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), word)
            for word in [*self.container["command"], *self.container.get("args", [])]
        ]
        self.proc = self.cluster.ns.popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.timeline["started"] = time.time()
        self._log_copier = threading.Thread(
            target=self._copy_log, name=f"log-{self.name}", daemon=True
        )
        self._log_copier.start()
        for target in (self._probe_loop, self._watch_loop, self._reap):
            self._thread(target)
        return self

    def _copy_log(self) -> None:
        """The container runtime's part: each line of output to the pod's log with the
        time it was read, as ``kubectl logs --timestamps`` shows it (RFC 3339)."""
        assert self.proc is not None
        assert self.proc.stdout is not None
        with self.proc.stdout as output, open(self.log_path, "wb") as log:
            for line in output:
                stamp = datetime.datetime.now(datetime.timezone.utc).isoformat()
                log.write(stamp.encode() + b" " + line)
                log.flush()

    def _thread(self, target: Any) -> None:
        # Started from a thread inside the namespace, so it is inside the namespace too.
        name = f"kubelet-{self.name}"

        def guarded() -> None:
            try:
                target()
            except Exception as exc:  # the API server stopping under a watch, …
                if not self._stop.is_set():
                    self.errors.append(f"{target.__name__}: {exc!r}")

        self.cluster.ns.call(
            lambda: threading.Thread(target=guarded, daemon=True, name=name).start()
        )

    def _patch_status(self, *, ready: bool, phase: str | None = None) -> None:
        now = _now_rfc3339()
        status: dict[str, Any] = {
            "conditions": [
                {"type": kind, "status": str(ready), "lastTransitionTime": now}
                for kind in ("Ready", "ContainersReady")
            ]
        }
        if phase is not None:
            status.update(phase=phase, podIP=self.ip, podIPs=[{"ip": self.ip}], hostIP="10.0.0.1")
        with contextlib.suppress(ApiError):  # the pod may be gone already
            self.cluster.api(
                "PATCH",
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status",
                {"status": status},
                content_type="application/merge-patch+json",
            )

    # ---------------------------------------------------------------- probes

    def _port(self, port: int | str) -> int:
        if isinstance(port, int):
            return port
        for item in self.container.get("ports", []):
            if item.get("name") == port:
                return int(item["containerPort"])
        return int(port)

    def _get(self, action: dict[str, Any], timeout_s: float) -> int:
        conn = http.client.HTTPConnection(self.ip, self._port(action["port"]), timeout=timeout_s)
        try:
            conn.request("GET", action.get("path", "/"), headers={"User-Agent": USER_AGENT})
            return conn.getresponse().status
        finally:
            conn.close()

    def _probe_loop(self) -> None:
        probe = self.container.get("readinessProbe")
        if probe is None:  # no probe: ready once started
            self._set_ready(True)
            return
        period = float(probe.get("periodSeconds", 10))
        timeout = float(probe.get("timeoutSeconds", 1))
        failures_allowed = int(probe.get("failureThreshold", 3))
        time.sleep(float(probe.get("initialDelaySeconds", 0)))
        ready, failures = False, 0
        while not self._stop.is_set():
            try:
                ok = 200 <= self._get(probe["httpGet"], timeout) < 400
            except OSError:
                ok = False
            failures = 0 if ok else failures + 1
            if ok and not ready:
                ready = True
                self._set_ready(True)
            elif not ok and ready and failures >= failures_allowed:
                ready = False
                self._set_ready(False)
            self._stop.wait(period)

    def _set_ready(self, ready: bool) -> None:
        self._patch_status(ready=ready)
        key = "ready" if ready else "unready"
        self.timeline.setdefault(key, time.time())
        if ready:
            self.ready.set()

    # ---------------------------------------------------------------- deletion

    def _watch_loop(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods?fieldSelector=metadata.name%3D{self.name}"
        while not self._stop.is_set():
            try:
                for _, pod in self.cluster.watch(path, timeout_s=60):
                    stamp = pod["metadata"].get("deletionTimestamp")
                    if stamp and not self._deleting.is_set():
                        self.deletion_timestamp = _parse_time(stamp)
                        self.timeline["deletion_seen"] = time.time()
                        self._deleting.set()
                        self._thread(self._terminate)
                        return
            except (OSError, ValueError, http.client.HTTPException):  # reconnect
                if self._stop.wait(0.2):
                    return

    def _terminate(self) -> None:
        proc, deadline = self.proc, self.deletion_timestamp
        assert proc is not None
        assert deadline is not None
        hook = (self.container.get("lifecycle") or {}).get("preStop")
        if hook is not None:
            left = max(0.0, deadline - time.time())
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if "httpGet" in hook:
                    self._get(hook["httpGet"], left)
                elif "exec" in hook:
                    subprocess.run(hook["exec"]["command"], timeout=left, check=False)
            self.timeline["prestop_done"] = time.time()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            self.timeline["sigterm"] = time.time()
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            self.killed = True
            self.timeline["sigkill"] = time.time()
            proc.wait(timeout=10)
        self._stop.set()
        with contextlib.suppress(ApiError):
            self.cluster.api(
                "DELETE",
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
        self.timeline["deleted"] = time.time()
        self.gone.set()

    def _reap(self) -> None:
        proc = self.proc
        assert proc is not None
        self.exit_status = proc.wait()
        self.timeline["exited"] = time.time()
        # Kill what the process left in its group (a container's cgroup would go too).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ API

    def delete(self, grace_period_s: float | None = None) -> float:
        """Delete the pod as ``kubectl delete`` does; returns the wall time of the call."""
        body: dict[str, Any] = {}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        at = time.time()
        self.timeline["delete_requested"] = at
        self.cluster.api("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{self.name}", body)
        return at

    def log(self) -> str:
        """The pod's log so far, each line after its RFC 3339 time; once the container
        exited, all of it (the copy may lag behind the exit)."""
        copier = getattr(self, "_log_copier", None)
        if copier is not None and self.proc is not None and self.proc.poll() is not None:
            copier.join(5.0)
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Kill the process (whatever its state) and stop the loops; for cleanup."""
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
