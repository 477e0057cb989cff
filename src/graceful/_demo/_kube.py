"""A real Kubernetes control plane and data path on one machine, for tests and the demo.

What is real and what is played
-------------------------------
Real: etcd, ``kube-apiserver`` (token auth, RBAC, the ``EndpointSliceTerminatingCondition``
gate), ``kube-controller-manager`` running the endpoint and endpointslice controllers, and
``kube-proxy`` in iptables mode — Kubernetes 1.20.2 built from Debian's source package
(``tools/kube/build.sh``, once; cached in ``~/.cache/kube-apiserver-1.20``).  Played: the
kubelet (``graceful._demo._kubelet``), for pods on the one node.

Where it runs
-------------
Everything lives in a network namespace of its own (``ip netns``): pod IPs are addresses
on its loopback (this kernel has no ``dummy`` link), the service range is routed to it so
that kube-proxy's OUTPUT rules see a client's packets, and nothing is routed out.  The
calling process stays where it is: ``Netns`` runs callables on a thread that
entered the namespace (``setns(2)`` is per thread), and whatever that thread starts — a
subprocess, another thread — is inside too.  So a test reaches the API server, the pods
and the ClusterIPs through ``Netns.call``, and the rest of the test process (other
tests' servers on 127.0.0.1) is untouched.

Needs root (``ip netns``, ``iptables``) and the built binaries; ``unavailable`` says
what is missing in one line.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from ._netns import Netns

__all__ = ("BUILD_HINT", "CACHE_DIR", "Cluster", "Netns", "unavailable")

CACHE_DIR: Final = Path(
    os.environ.get("KUBE_CACHE_DIR", Path.home() / ".cache" / "kube-apiserver-1.20")
)
BINARIES: Final = ("kube-apiserver", "kube-controller-manager", "kube-proxy")
BUILD_HINT: Final = "build them once (as root, 9-13 min): bash tools/kube/build.sh"
FEATURE_GATES: Final = "EndpointSliceTerminatingCondition=true,EndpointSliceNodeName=true"
SERVICE_RANGE: Final = "10.96.0.0/16"
NODE: Final = "node1"
API_PORT: Final = 6443


def unavailable() -> str | None:
    """Why the control plane cannot run here (one line), or ``None`` if it can."""
    if os.geteuid() != 0:
        return "the Kubernetes control plane needs root (ip netns, iptables)"
    missing = [name for name in BINARIES if not (CACHE_DIR / name).is_file()]
    if missing:
        return f"{', '.join(missing)} not built in {CACHE_DIR}: {BUILD_HINT}"
    for tool in ("etcd", "ip", "iptables", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: {BUILD_HINT} (installs it)"
    return None


class ApiError(Exception):
    """An API call answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:300]}")
        self.status = status


class Cluster:
    """etcd, kube-apiserver, kube-controller-manager and kube-proxy in a namespace.

    Args:
        sync_period_s: kube-proxy's ``--iptables-min-sync-period``: how slowly the data
            path follows endpoint changes (1 s and 5 s in the rollout tests).
        users: Extra token users (name to token), for RBAC tests; ``admin`` is always
            there (``system:masters``).
    """

    def __init__(self, *, sync_period_s: float = 1.0, users: dict[str, str] | None = None) -> None:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        self.sync_period_s = sync_period_s
        self.state = Path(tempfile.mkdtemp(prefix="graceful-kube-"))
        self.url = f"https://127.0.0.1:{API_PORT}"
        self.admin_token = "admin-" + os.urandom(12).hex()
        self.users = {"admin": self.admin_token, **(users or {})}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._ip_octets = itertools.count(1)
        self.ns = Netns()
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        ns = self.ns
        ns.run("ip", "link", "set", "lo", "up")
        ns.run("ip", "route", "add", SERVICE_RANGE, "dev", "lo")
        ns.run("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1", check=False)
        self._certificates()
        d = self.state
        self._spawn(
            "etcd",
            [
                "etcd", "--name", "kube", "--data-dir", str(d / "etcd"),
                "--listen-client-urls", "http://127.0.0.1:2379",
                "--advertise-client-urls", "http://127.0.0.1:2379",
                "--listen-peer-urls", "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                "--initial-cluster", "kube=http://127.0.0.1:2380",
            ],
        )  # fmt: skip
        self._spawn(
            "apiserver",
            [
                str(CACHE_DIR / "kube-apiserver"),
                "--etcd-servers", "http://127.0.0.1:2379",
                "--bind-address", "127.0.0.1", "--secure-port", str(API_PORT),
                "--advertise-address", "127.0.0.1", "--endpoint-reconciler-type", "none",
                "--tls-cert-file", str(d / "apiserver.crt"),
                "--tls-private-key-file", str(d / "apiserver.key"),
                "--cert-dir", str(d / "certs"),
                "--token-auth-file", str(d / "tokens.csv"),
                "--authorization-mode", "RBAC",
                "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                "--service-account-key-file", str(d / "sa.pub"),
                "--service-account-signing-key-file", str(d / "sa.key"),
                "--service-cluster-ip-range", SERVICE_RANGE,
                "--feature-gates", FEATURE_GATES,
                "--disable-admission-plugins", "ServiceAccount",
            ],
        )  # fmt: skip
        self._wait_ready()
        kubeconfig = self.kubeconfig("admin")
        self._spawn(
            "controller-manager",
            [
                str(CACHE_DIR / "kube-controller-manager"), "--kubeconfig", str(kubeconfig),
                "--leader-elect=false", "--controllers=endpointslice,endpoint",
                "--port", "0", "--secure-port", "0", "--feature-gates", FEATURE_GATES,
            ],
        )  # fmt: skip
        self._spawn(
            "proxy",
            [
                str(CACHE_DIR / "kube-proxy"), "--kubeconfig", str(kubeconfig),
                "--hostname-override", NODE, "--proxy-mode", "iptables",
                "--cluster-cidr", "10.244.0.0/16", "--conntrack-max-per-core", "0",
                "--metrics-bind-address", "127.0.0.1:10249",
                "--healthz-bind-address", "127.0.0.1:10256",
                "--iptables-min-sync-period", f"{self.sync_period_s:g}s",
                "--feature-gates", FEATURE_GATES,
            ],
        )  # fmt: skip
        self.api("POST", "/api/v1/nodes", {"metadata": {"name": NODE}})

    def _certificates(self) -> None:
        d = self.state

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
        openssl(
            "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "30",
            "-subj", "/CN=graceful-test-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        openssl("req", *ec, "-keyout", "apiserver.key", "-out", "apiserver.csr",
                "-subj", "/CN=kube-apiserver")  # fmt: skip
        (d / "apiserver.ext").write_text(
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
        )
        openssl(
            "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "apiserver.crt", "-days", "30",
            "-extfile", "apiserver.ext",
        )  # fmt: skip
        openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key")
        openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        rows = [
            f"{token},{name},uid-{name}" + (',"system:masters"' if name == "admin" else "")
            for name, token in self.users.items()
        ]
        (d / "tokens.csv").write_text("\n".join(rows) + "\n")
        self.context = ssl.create_default_context(cafile=str(d / "ca.crt"))

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.state / f"{name}.log", "wb")  # noqa: SIM115 (the process owns it)
        # Go's collector at a quarter of its default pace (unless GOGC is set): the API
        # server's start allocates heavily, and this cut its CPU by about 12 % (2.7 ->
        # 2.4 CPU-s a start) for a few hundred MB more, on a machine the demo or the
        # tests share with everything else.
        env = {**os.environ, "GOGC": os.environ.get("GOGC", "400")}
        self.processes[name] = self.ns.popen(
            args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
        )
        log.close()

    def _wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError, ApiError):
                # Ready, and the bootstrap controller made the default namespace.
                if self.api("GET", "/readyz", raw=True) == "ok" and self.api(
                    "GET", "/api/v1/namespaces/default"
                ):
                    return
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({proc.returncode}): {self.log(name)[-2000:]}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API server was not ready in {timeout_s:g} s")
            time.sleep(0.1)

    # -------------------------------------------------------------------- API

    def api(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
        raw: bool = False,
        timeout_s: float = 10.0,
    ) -> Any:
        """One API call from inside the namespace; the decoded JSON answer."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {token or self.admin_token}")
        if data is not None:
            request.add_header("Content-Type", content_type)

        def send() -> Any:
            try:
                with urllib.request.urlopen(
                    request, context=self.context, timeout=timeout_s
                ) as response:
                    text = response.read().decode()
            except urllib.error.HTTPError as exc:
                raise ApiError(exc.code, exc.read().decode(errors="replace")) from None
            return text if raw else json.loads(text)

        return self.ns.call(send, timeout_s=timeout_s + 5)

    def watch(self, path: str, *, timeout_s: float) -> Iterator[tuple[str, dict[str, Any]]]:
        """Watch events of a collection (``?watch=1``), for at most ``timeout_s``; must be
        iterated on the namespace's thread or a thread it started."""
        sep = "&" if "?" in path else "?"
        request = urllib.request.Request(
            f"{self.url}{path}{sep}watch=1&timeoutSeconds={max(1, int(timeout_s))}"
        )
        request.add_header("Authorization", f"Bearer {self.admin_token}")
        with urllib.request.urlopen(request, context=self.context, timeout=timeout_s + 5) as r:
            for line in r:
                event = json.loads(line)
                yield event["type"], event["object"]

    def service_account_kubeconfig(self, name: str, namespace: str = "default") -> Path:
        """A kubeconfig with a token of ServiceAccount ``name`` (created if missing),
        from the TokenRequest API: what a pod running as that account presents."""
        try:
            self.api(
                "POST",
                f"/api/v1/namespaces/{namespace}/serviceaccounts",
                {"metadata": {"name": name}},
            )
        except ApiError as exc:
            if exc.status != 409:  # 409: it exists already
                raise
        answer = self.api(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": 3600}},
        )  # fmt: skip
        return self.kubeconfig(f"sa-{namespace}-{name}", namespace, token=answer["status"]["token"])

    def kubeconfig(
        self, user: str, namespace: str = "default", *, token: str | None = None
    ) -> Path:
        """A kubeconfig file for one of the token users (or for ``token``)."""
        token = token or self.users[user]
        path = self.state / f"kubeconfig-{user}"
        ca = base64.b64encode((self.state / "ca.crt").read_bytes()).decode()
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "local", "cluster": {"server": self.url,
                                                      "certificate-authority-data": ca}}
                    ],
                    "users": [{"name": user, "user": {"token": token}}],
                    "contexts": [
                        {"name": user, "context": {"cluster": "local", "user": user,
                                                   "namespace": namespace}}
                    ],
                    "current-context": user,
                }
            )
        )  # fmt: skip
        path.chmod(0o600)
        return path

    def pod_ip(self) -> str:
        """A new pod IP on the namespace's loopback."""
        ip = f"10.244.0.{next(self._ip_octets)}"
        self.ns.run("ip", "addr", "add", f"{ip}/32", "dev", "lo")
        return ip

    def proxied(self, ip: str) -> bool:
        """``True`` while kube-proxy's rules send traffic to ``ip``."""
        return f"{ip}/32" in self.ns.run("iptables", "-t", "nat", "-S").stdout

    def log(self, name: str) -> str:
        return (self.state / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        """Stop everything, delete the namespace and the state."""
        self.ns.close()
        for proc in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        shutil.rmtree(self.state, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
