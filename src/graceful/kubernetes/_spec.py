"""What the pod's spec and status say about how it will be stopped.

Kubernetes has grown ways to stop a pod that change what graceful should do at SIGTERM;
each is read from the pod (a lightkube ``Pod``, fields the API server of the cluster
serves — an older one drops the newer fields, which then read as unset) and is one log
line:

* ``readinessProbe`` (``httpGet``): the kubelet marks the pod unready after
  ``failureThreshold`` failed probes ``periodSeconds`` apart — the only way its endpoint
  goes when the SIGTERM came without a deletion.  Declared to the coordinator as a
  health checker (``graceful._core.checkers``).
* ``lifecycle.preStop.sleep`` (KEP-3960, 1.29+) or an ``exec`` that only sleeps: the
  kubelet sends SIGTERM after it, when the endpoint has long been removed — the idle
  window counts from the deletion, not once more from the SIGTERM.
* ``lifecycle.stopSignal`` (KEP-4960, 1.33+): a stop signal that graceful (or gunicorn)
  takes for a quick stop, or not for a stop at all, is warned of at start-up.
* ``status.conditions`` ``DisruptionTarget`` (1.26+): why a pod is being stopped without
  a deletion of its own yet (node shutdown, preemption, eviction, taint) — said in the
  log; the budget may be shorter than the grace period, so the conservative deadline
  stays.

Which container is ours: the only one, or the one ``GRACEFUL_CONTAINER`` names.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .._core.checkers import KUBELET_AGENT as KUBELET_AGENT
from ._pod import _timestamp

__all__ = (
    "Container",
    "after_prestop_sleep",
    "container",
    "deleted_at",
    "disruption",
    "prestop_sleep_s",
    "stop_signal_warning",
)

#: The variable naming graceful's container in a pod of several.
CONTAINER_ENV: Final = "GRACEFUL_CONTAINER"
#: The kubelet's probe defaults (the API reference's).
FAILURE_THRESHOLD: Final = 3
PERIOD_S: Final = 10.0
_SLEEP: Final = re.compile(r"^(?:exec\s+)?(?:/usr)?(?:/bin/)?sleep\s+(\d+(?:\.\d+)?)s?$")


@dataclass(frozen=True, slots=True)
class Container:
    """What graceful reads of its container's spec.

    Attributes:
        name: The container's name.
        readiness: ``(failureThreshold, periodSeconds)`` of its ``httpGet`` readiness
            probe, or ``None`` (no probe, or one that does not ask this process).
        prestop_sleep_s: How long its preStop hook only sleeps, or ``None``.
        stop_signal: ``lifecycle.stopSignal`` (``"SIGINT"``), or ``None`` (SIGTERM).
    """

    name: str
    readiness: tuple[int, float] | None
    prestop_sleep_s: float | None
    stop_signal: str | None


def container(pod: Any, environ: Mapping[str, str] | None = None) -> Container | str:
    """Our container in ``pod``, or why it cannot be told (a phrase for the log)."""
    environ = os.environ if environ is None else environ
    spec = getattr(pod, "spec", None)
    containers = list(getattr(spec, "containers", None) or ())
    wanted = environ.get(CONTAINER_ENV)
    if wanted:
        chosen = [c for c in containers if c.name == wanted]
        if not chosen:
            names = ", ".join(c.name for c in containers) or "none"
            return f"{CONTAINER_ENV}={wanted!r} names no container of the pod ({names})"
    elif len(containers) == 1:
        chosen = containers
    else:
        return (
            f"the pod has {len(containers)} containers; set {CONTAINER_ENV} to this one's "
            "name to have its probe, preStop hook and stop signal read"
        )
    c = chosen[0]
    lifecycle = getattr(c, "lifecycle", None)
    return Container(
        name=c.name,
        readiness=_readiness(getattr(c, "readinessProbe", None)),
        prestop_sleep_s=prestop_sleep_s(getattr(lifecycle, "preStop", None)),
        stop_signal=getattr(lifecycle, "stopSignal", None),
    )


def _readiness(probe: Any) -> tuple[int, float] | None:
    if probe is None or getattr(probe, "httpGet", None) is None:
        return None  # exec, tcpSocket or grpc probes never reach the readiness path
    threshold = probe.failureThreshold
    period = probe.periodSeconds
    return (
        FAILURE_THRESHOLD if threshold is None else int(threshold),
        PERIOD_S if period is None else float(period),
    )


def prestop_sleep_s(handler: Any) -> float | None:
    """How long a preStop ``handler`` only sleeps: ``sleep.seconds``, or an ``exec`` of
    ``sleep N`` (also ``/bin/sleep``, or through ``sh -c``); ``None`` for anything else."""
    if handler is None:
        return None
    sleep = getattr(handler, "sleep", None)
    if sleep is not None and getattr(sleep, "seconds", None) is not None:
        return float(sleep.seconds)
    action = getattr(handler, "exec", None)
    command = list(getattr(action, "command", None) or ())
    shell = bool(command) and command[0].rsplit("/", 1)[-1] in ("sh", "bash", "ash", "dash")
    through_shell = shell and len(command) >= 3 and command[1] == "-c"
    text = command[2] if through_shell else " ".join(command)
    try:
        text = " ".join(shlex.split(text))
    except ValueError:
        return None
    match = _SLEEP.match(text.strip())
    return float(match.group(1)) if match else None


#: What each stop signal does to graceful's servers, and to gunicorn's master.
_QUICK: Final = {
    "SIGQUIT": "graceful and gunicorn stop at once on it (no drain)",
    "SIGINT": "gunicorn's master stops at once on it (no drain); graceful run drains",
}
_SHUTDOWN: Final = frozenset({"SIGTERM", "SIGINT", "SIGQUIT"})


def stop_signal_warning(stop_signal: str | None, *, under_gunicorn: bool) -> str | None:
    """The start-up warning for the pod's ``lifecycle.stopSignal``, or ``None``."""
    if stop_signal is None:
        return None
    name = stop_signal.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    if name == "SIGTERM" or (name == "SIGINT" and not under_gunicorn):
        return None
    what = _QUICK.get(name)
    if what is None and name not in _SHUTDOWN:
        what = "graceful does not stop on it: the process dies at once or ignores it until SIGKILL"
    return (
        f"the pod's lifecycle.stopSignal is {stop_signal}: {what}; "
        "use SIGTERM (or remove stopSignal) for a graceful drain"
    )


#: A SIGTERM this much earlier than deletion + the preStop sleep still came after the
#: sleep (the API server's and the node's clocks differ; the kubelet rounds).
PRESTOP_TOLERANCE_S: Final = 1.0


def after_prestop_sleep(
    ours: Container | None, pod: Any, requested_wall: float
) -> tuple[float, float, float] | None:
    """``(deleted, waited, sleep_s)`` when the SIGTERM (at ``requested_wall``) came
    after ``ours``'s preStop sleep of ``sleep_s`` (``waited`` seconds after the pod's
    deletion at ``deleted``, wall clock), else ``None``."""
    sleep_s = None if ours is None else ours.prestop_sleep_s
    deleted = deleted_at(pod)
    if sleep_s is None or deleted is None:
        return None
    waited = requested_wall - deleted
    if waited < sleep_s - PRESTOP_TOLERANCE_S:
        return None
    return deleted, waited, sleep_s


def deleted_at(pod: Any) -> float | None:
    """When the pod was deleted (wall clock): its ``deletionTimestamp`` less its
    ``deletionGracePeriodSeconds``."""
    meta = pod.metadata
    stamp = _timestamp(meta.deletionTimestamp)
    grace = meta.deletionGracePeriodSeconds
    if stamp is None or grace is None:
        return None
    return stamp - float(grace)


def disruption(pod: Any) -> str | None:
    """Why the pod is being disrupted, from its ``DisruptionTarget`` condition (reason
    and message), or ``None``."""
    status = getattr(pod, "status", None)
    for condition in getattr(status, "conditions", None) or ():
        if condition.type == "DisruptionTarget" and condition.status == "True":
            reason = condition.reason or "unknown reason"
            return f"{reason}: {condition.message}" if condition.message else reason
    return None
