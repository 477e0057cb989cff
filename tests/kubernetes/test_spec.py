"""What graceful reads of the pod's spec and status (``graceful.kubernetes._spec``), on
pod objects as a newer API server serves them: the control plane here is 1.20, which
drops ``lifecycle.preStop.sleep`` (1.29+), ``lifecycle.stopSignal`` (1.33+) and the
``DisruptionTarget`` condition (1.26+); the shapes below follow the API reference
(core/v1 ``Pod``, ``Lifecycle``, ``LifecycleHandler``, ``SleepAction``, ``PodCondition``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lightkube")

from lightkube.resources.core_v1 import Pod

from graceful.kubernetes import _spec


def pod(*containers: dict[str, Any], conditions: list[dict[str, Any]] | None = None) -> Pod:
    """A pod as ``GET /api/v1/namespaces/default/pods/web-1`` serves it (1.33)."""
    return Pod.from_dict(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "web-1",
                "namespace": "default",
                "deletionTimestamp": "2026-11-27T08:00:40Z",
                "deletionGracePeriodSeconds": 30,
            },
            "spec": {"containers": list(containers), "terminationGracePeriodSeconds": 30},
            "status": {"phase": "Running", "conditions": conditions or []},
        }
    )


def web(**fields: Any) -> dict[str, Any]:
    return {"name": "web", "image": "registry.example/web:1", **fields}


PROBE = {"httpGet": {"path": "/readyz", "port": "management"}}


def test_the_only_container_is_ours_with_its_probe_sleep_and_stop_signal() -> None:
    found = _spec.container(
        pod(
            web(
                readinessProbe={**PROBE, "periodSeconds": 2, "failureThreshold": 4},
                lifecycle={"preStop": {"sleep": {"seconds": 5}}, "stopSignal": "SIGTERM"},
            )
        ),
        environ={},
    )
    assert found == _spec.Container("web", (4, 2.0), 5.0, "SIGTERM")


def test_probe_defaults_are_the_api_references() -> None:
    found = _spec.container(pod(web(readinessProbe=PROBE)), environ={})
    assert isinstance(found, _spec.Container)
    assert found.readiness == (3, 10.0)


@pytest.mark.parametrize(
    "probe", [{"exec": {"command": ["true"]}}, {"tcpSocket": {"port": 8000}}, None]
)
def test_a_probe_that_never_asks_the_readiness_path_is_no_checker(probe: Any) -> None:
    fields = {} if probe is None else {"readinessProbe": probe}
    found = _spec.container(pod(web(**fields)), environ={})
    assert isinstance(found, _spec.Container)
    assert found.readiness is None


def test_several_containers_need_graceful_container() -> None:
    two = pod(web(), {"name": "envoy", "image": "envoy"})
    assert "set GRACEFUL_CONTAINER" in str(_spec.container(two, environ={}))
    chosen = _spec.container(two, environ={"GRACEFUL_CONTAINER": "web"})
    assert isinstance(chosen, _spec.Container)
    assert chosen.name == "web"
    wrong = _spec.container(two, environ={"GRACEFUL_CONTAINER": "app"})
    assert wrong == "GRACEFUL_CONTAINER='app' names no container of the pod (web, envoy)"


@pytest.mark.parametrize(
    ("hook", "seconds"),
    [
        ({"sleep": {"seconds": 5}}, 5.0),
        ({"exec": {"command": ["sleep", "5"]}}, 5.0),
        ({"exec": {"command": ["/bin/sleep", "2.5"]}}, 2.5),
        ({"exec": {"command": ["sh", "-c", "sleep 10"]}}, 10.0),
        ({"exec": {"command": ["/bin/sh", "-c", "exec sleep 3"]}}, 3.0),
        ({"exec": {"command": ["sh", "-c", "sleep 5 && kill -TERM 1"]}}, None),
        ({"exec": {"command": ["/app/drain.sh"]}}, None),
        ({"httpGet": {"path": "/prestop", "port": "management"}}, None),
    ],
)
def test_prestop_sleep(hook: dict[str, Any], seconds: float | None) -> None:
    found = _spec.container(pod(web(lifecycle={"preStop": hook})), environ={})
    assert isinstance(found, _spec.Container)
    assert found.prestop_sleep_s == seconds


@pytest.mark.parametrize(
    ("stop_signal", "gunicorn", "warned"),
    [
        (None, False, None),
        ("SIGTERM", True, None),
        ("SIGINT", False, None),
        ("SIGINT", True, "gunicorn's master stops at once on it"),
        ("SIGQUIT", False, "graceful and gunicorn stop at once on it"),
        ("SIGUSR1", False, "graceful does not stop on it"),
        ("SIGHUP", True, "graceful does not stop on it"),
    ],
)
def test_stop_signal_warning(stop_signal: str | None, gunicorn: bool, warned: str | None) -> None:
    found = _spec.container(pod(web(lifecycle={"stopSignal": stop_signal})), environ={})
    assert isinstance(found, _spec.Container)
    assert found.stop_signal == stop_signal
    warning = _spec.stop_signal_warning(found.stop_signal, under_gunicorn=gunicorn)
    if warned is None:
        assert warning is None
    else:
        assert warning is not None
        assert warning.startswith(f"the pod's lifecycle.stopSignal is {stop_signal}: {warned}")
        assert warning.endswith("use SIGTERM (or remove stopSignal) for a graceful drain")


@pytest.mark.parametrize(
    ("condition", "said"),
    [
        (
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "TerminationByKubelet",
                "message": "Pod was terminated in response to imminent node shutdown.",
                "lastTransitionTime": "2026-11-27T08:00:10Z",
            },
            "TerminationByKubelet: Pod was terminated in response to imminent node shutdown.",
        ),
        (
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},
            "EvictionByEvictionAPI",
        ),
        ({"type": "DisruptionTarget", "status": "False", "reason": "PreemptionByScheduler"}, None),
        ({"type": "Ready", "status": "False"}, None),
    ],
)
def test_disruption(condition: dict[str, Any], said: str | None) -> None:
    assert _spec.disruption(pod(web(), conditions=[condition])) == said


@pytest.mark.parametrize(
    ("sigterm_after_deletion_s", "expected"),
    [(5.2, (5.2, 5.0)), (4.1, (4.1, 5.0)), (3.9, None)],
)
def test_a_sigterm_after_the_prestop_sleep(
    sigterm_after_deletion_s: float, expected: tuple[float, float] | None
) -> None:
    """The pod's deletionTimestamp is 08:00:40Z with 30 s of grace: deleted at 08:00:10Z.
    A SIGTERM at least the sleep (less 1 s for clocks) after that came after it."""
    sleeping = pod(web(lifecycle={"preStop": {"sleep": {"seconds": 5}}}))
    ours = _spec.container(sleeping, environ={})
    assert isinstance(ours, _spec.Container)
    deleted = _spec.deleted_at(sleeping)
    assert deleted == _spec._timestamp("2026-11-27T08:00:10Z")
    found = _spec.after_prestop_sleep(ours, sleeping, deleted + sigterm_after_deletion_s)
    if expected is None:
        assert found is None
    else:
        assert found is not None
        assert found[0] == deleted
        assert found[1:] == pytest.approx(expected)
    assert _spec.after_prestop_sleep(None, sleeping, deleted + 10) is None
