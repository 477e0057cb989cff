"""graceful.kubernetes without an API server: who the pod is, the kill deadline from its
fields, its state in EndpointSlices, and the options that turn it on.  The same code
against a real control plane: ``tests/kubernetes/``."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from graceful import AcceptUntilIdle, RefuseImmediately
from graceful import _options as _config
from graceful._options import ConfigError
from graceful.kubernetes import (
    EndpointState,
    _timestamp,
    endpoint_state,
    kill_deadline,
    pod_identity,
)

T0 = 1_800_000_000.0  # a wall-clock time


def test_identity_from_the_downward_api(tmp_path: Path) -> None:
    found = pod_identity({"POD_NAME": "web-1", "POD_NAMESPACE": "shop"}, hostname="h")
    assert (found.name, found.namespace) == ("web-1", "shop")
    assert found.source == "POD_NAME and POD_NAMESPACE"


def test_identity_from_hostname_and_the_service_account(tmp_path: Path) -> None:
    ns = tmp_path / "namespace"
    ns.write_text("shop\n")
    found = pod_identity({}, hostname="web-2", namespace_file=ns)
    assert (found.name, found.namespace) == ("web-2", "shop")
    assert found.source == f"the hostname and {ns}"


def test_identity_without_a_namespace_leaves_it_to_the_client(tmp_path: Path) -> None:
    found = pod_identity({"POD_NAME": " "}, hostname="web-3", namespace_file=tmp_path / "x")
    assert (found.name, found.namespace) == ("web-3", None)


def deadline(**overrides: object) -> tuple[float, str] | None:
    kwargs: dict[str, object] = {
        "deletion_timestamp_s": T0 + 30,
        "deletion_grace_s": 30.0,
        "termination_grace_s": 30.0,
        "requested_at_s": T0 + 0.2,
        "clock_skew_s": 1.0,
        "grace_period_known": True,
    }
    kwargs.update(overrides)
    return kill_deadline(**kwargs)  # type: ignore[arg-type]


def test_deadline_is_the_deletion_timestamp_less_the_skew() -> None:
    found = deadline()
    assert found is not None
    assert found[0] == T0 + 29
    assert "deletionTimestamp 2027-01-15T08:00:30Z less 1 s for clock skew" in found[1]


def test_deadline_is_bounded_by_sigterm_plus_the_grace_period() -> None:
    # The API server's clock runs 10 s ahead: its deletionTimestamp promises time the
    # node's kubelet will not give.
    found = deadline(deletion_timestamp_s=T0 + 40)
    assert found is not None
    assert found[0] == T0 + 0.2 + 30
    assert "deletionGracePeriodSeconds (30 s" in found[1]


def test_without_deletion_timestamp_the_configured_grace_period_stays() -> None:
    assert deadline(deletion_timestamp_s=None) is None


def test_without_deletion_timestamp_the_pods_grace_period_replaces_the_assumed_one() -> None:
    found = deadline(deletion_timestamp_s=None, grace_period_known=False, termination_grace_s=45)
    assert found is not None
    assert found[0] == T0 + 0.2 + 45
    assert "terminationGracePeriodSeconds (45 s" in found[1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2027-01-15T08:00:30Z", T0 + 30),
        ("2027-01-15T08:00:30+00:00", T0 + 30),
        (datetime.datetime.fromtimestamp(T0, datetime.timezone.utc), T0),
        (None, None),
    ],
)
def test_timestamps(text: object, expected: float | None) -> None:
    assert _timestamp(text) == expected


def test_a_timestamp_of_another_type_is_an_error() -> None:
    with pytest.raises(TypeError, match="not a Kubernetes timestamp: 12"):
        _timestamp(12)


def endpoint(name: str | None, ip: str, ready: bool | None) -> dict[str, object]:
    e: dict[str, object] = {"addresses": [ip]}
    if name is not None:
        e["targetRef"] = {"kind": "Pod", "name": name, "namespace": "shop"}
    if ready is not None:
        e["conditions"] = {"ready": ready, "serving": ready, "terminating": not ready}
    return e


@pytest.mark.parametrize(
    ("slices", "expected"),
    [
        ({}, EndpointState(0, 0)),
        ({"a": {"endpoints": None}}, EndpointState(0, 0)),
        ({"a": {"endpoints": [endpoint("web-1", "10.0.0.1", True)]}}, EndpointState(1, 1)),
        # ready unset counts as ready, as the API defines it
        ({"a": {"endpoints": [endpoint("web-1", "10.0.0.1", None)]}}, EndpointState(1, 1)),
        ({"a": {"endpoints": [endpoint("web-1", "10.0.0.1", False)]}}, EndpointState(1, 0)),
        # another pod that happens to reuse the IP is not us: targetRef wins
        ({"a": {"endpoints": [endpoint("web-9", "10.0.0.1", True)]}}, EndpointState(0, 0)),
        # no targetRef: matched by address
        ({"a": {"endpoints": [endpoint(None, "10.0.0.1", True)]}}, EndpointState(1, 1)),
        (
            {
                "a": {"endpoints": [endpoint("web-1", "10.0.0.1", False)]},
                "b": {"endpoints": [endpoint("web-1", "10.0.0.1", True)]},
                "c": {"endpoints": [endpoint("web-2", "10.0.0.2", True)]},
            },
            EndpointState(2, 1),
        ),
    ],
)
def test_endpoint_state(slices: dict[str, dict[str, object]], expected: EndpointState) -> None:
    found = endpoint_state(slices, pod_name="web-1", pod_ip="10.0.0.1")
    assert found == expected
    assert found.removed == (expected.ready == 0)


def test_kubernetes_with_accept_until_idle_waits_for_endpoints() -> None:
    values = _config.from_environment({"GRACEFUL_KUBERNETES": "1"})
    policy = _config.coordinator_kwargs(values)["policy"]
    assert policy == AcceptUntilIdle(wait_for_endpoint_removal=True)


def test_no_wait_for_endpoints_keeps_only_the_deadline() -> None:
    values = _config.from_environment(
        {"GRACEFUL_KUBERNETES": "yes", "GRACEFUL_WAIT_FOR_ENDPOINTS": "no"}
    )
    assert _config.coordinator_kwargs(values)["policy"] == AcceptUntilIdle()


def test_kubernetes_with_another_policy_changes_no_policy() -> None:
    values = _config.from_environment(
        {"GRACEFUL_KUBERNETES": "on", "GRACEFUL_POLICY": "refuse-immediately"}
    )
    assert _config.coordinator_kwargs(values)["policy"] == RefuseImmediately()


def test_wait_for_endpoints_without_kubernetes_is_an_error() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^GRACEFUL_WAIT_FOR_ENDPOINTS applies only with --kubernetes "
        r"\(or GRACEFUL_KUBERNETES=1\)$",
    ):
        _config.from_environment({"GRACEFUL_WAIT_FOR_ENDPOINTS": "0"})


def test_the_command_line_switches() -> None:
    from graceful._cli import run as _run

    inv = _run.parse(["app:app", "--kubernetes", "--no-wait-for-endpoints"], environ={})
    assert inv.values["kubernetes"] is True
    assert inv.values["wait_for_endpoints"] is False
    with pytest.raises(ConfigError, match=r"^--no-wait-for-endpoints applies only with"):
        _run.parse(["app:app", "--no-wait-for-endpoints"], environ={})
    inv = _run.parse(["app:app", "--no-kubernetes"], environ={"GRACEFUL_KUBERNETES": "1"})
    assert inv.values["kubernetes"] is False
