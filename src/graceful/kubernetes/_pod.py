"""What the pod's own fields say, with no API call: who the pod is, when SIGKILL lands,
and where it stands in its EndpointSlices.

Pure functions of values already read (``graceful.kubernetes._api`` reads them), so the
unit tests need no API server.  Two lines carry the reasoning:

* ``kill_deadline`` bounds the ``deletionTimestamp`` by our SIGTERM plus the pod's
  ``deletionGracePeriodSeconds``: the kubelet's timer started before our SIGTERM, so on
  the node's clock SIGKILL cannot come later than that, whatever the API server's clock
  says; ``clock_skew_s`` moves it earlier for an API server whose clock runs ahead.
* ``endpoint_state`` counts an endpoint whose ``conditions.ready`` is unset as ready, as
  the API defines it (KEP-1672): only ``ready=false`` or leaving the slice takes the pod
  out of traffic.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from typing_extensions import final

from .._core.policy import _check_bool, _check_optional_seconds, _check_seconds

#: The downward-API variable holding the pod's name (``fieldRef: metadata.name``).
POD_NAME_ENV: Final = "POD_NAME"
#: The downward-API variable holding the pod's namespace (``fieldRef: metadata.namespace``).
POD_NAMESPACE_ENV: Final = "POD_NAMESPACE"
_NAMESPACE_FILE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


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
