"""Every public entry point rejects a wrong argument with a TypeError or ValueError whose
message names the argument and the value (and says what is allowed) — never an
AttributeError from deep inside, and never by accepting it and failing later.

The servers' run functions take graceful's command-line options by their Python names
(``grace_period_s`` for ``--grace-period``), checked by the same code as the command line
(``graceful._options``); what they build is checked here without serving (the server's
``run`` is replaced)."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable
from typing import Any

import pytest

import graceful
from graceful import AcceptUntilIdle, Phase, ServeUntilKilled, ShutdownCoordinator
from graceful._core import logging as _logging


async def asgi_app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
    pass


def C() -> Any:  # a fresh coordinator (Any: the tests pass it wrong arguments)
    return ShutdownCoordinator()


def uvicorn_config(m: object) -> Any:
    return importlib.import_module("uvicorn").Config(asgi_app)


def hypercorn_config() -> Any:
    return importlib.import_module("hypercorn.config").Config()


def aiohttp_app() -> Any:
    return importlib.import_module("aiohttp.web").Application()


#: (id, module, call with a wrong argument, the argument's name, the value as shown).
CASES: list[tuple[str, str, Callable[[Any], object], str, str]] = [
    # graceful
    ("policy_from_name-None", "graceful", lambda m: m.policy_from_name(None), "policy name",
     "None"),
    ("policy_from_name-int", "graceful", lambda m: m.policy_from_name(5), "policy name", "5"),
    ("policy_from_name-idle_s", "graceful",
     lambda m: m.policy_from_name("accept-until-idle", idle_s="2"), "idle_s", "'2'"),
    ("AcceptUntilIdle-idle_s", "graceful", lambda m: m.AcceptUntilIdle(idle_s=None), "idle_s",
     "None"),
    ("Coordinator-policy-str", "graceful",
     lambda m: m.ShutdownCoordinator(policy="serve-until-killed"), "policy",
     "'serve-until-killed'"),
    ("Coordinator-grace-str", "graceful", lambda m: m.ShutdownCoordinator(grace_period_s="5"),
     "grace_period_s", "'5'"),
    ("Coordinator-grace-negative", "graceful",
     lambda m: m.ShutdownCoordinator(grace_period_s=-1), "grace_period_s", "-1"),
    ("Coordinator-drain-None", "graceful", lambda m: m.ShutdownCoordinator(drain_timeout_s=None),
     "drain_timeout_s", "None"),
    ("subscribe-None", "graceful", lambda m: C().subscribe(None), "listener", "None"),
    ("add_hook-str", "graceful", lambda m: C().add_hook("x"), "hook", "'x'"),
    ("wait_for_phase-str", "graceful",
     lambda m: asyncio.run(C().wait_for_phase("draining", timeout_s=0)), "phase", "'draining'"),
    ("expect_relayed_signals", "graceful", lambda m: C().expect_relayed_signals(99999),
     "expect_relayed_signals", "99999"),
    ("exit_soon-str", "graceful", lambda m: C().exit_soon("1"), "within_s", "'1'"),
    ("run-shutdown_trigger", "graceful", lambda m: asyncio.run(C().run(shutdown_trigger=5)),
     "shutdown_trigger", "5"),
    # graceful.asgi
    ("GracefulMiddleware-app", "graceful.asgi",
     lambda m: m.GracefulMiddleware(None, coordinator=C()), "app", "None"),
    ("GracefulMiddleware-coordinator", "graceful.asgi",
     lambda m: m.GracefulMiddleware(asgi_app, coordinator="x"), "coordinator", "'x'"),
    ("GracefulMiddleware-readiness_on_shutdown", "graceful.asgi",
     lambda m: m.GracefulMiddleware(asgi_app, coordinator=C(), readiness_on_shutdown="maybe"),
     "readiness_on_shutdown", "'maybe'"),
    ("DrainSignal-None", "graceful.asgi", lambda m: m.DrainSignal(None), "coordinator", "None"),
    ("drain_signal-None", "graceful.asgi", lambda m: m.drain_signal(None), "scope", "None"),
    # graceful.uvicorn
    ("Server-config", "graceful.uvicorn", lambda m: m.Server(None), "config", "None"),
    ("Server-coordinator", "graceful.uvicorn",
     lambda m: m.Server(uvicorn_config(m), coordinator="x"), "coordinator", "'x'"),
    ("Server-wrap_app", "graceful.uvicorn",
     lambda m: m.Server(uvicorn_config(m), wrap_app="no"), "wrap_app", "'no'"),
    ("Server-quick_signals", "graceful.uvicorn",
     lambda m: m.Server(uvicorn_config(m), quick_signals=None), "quick_signals", "None"),
    ("Server-readiness_path", "graceful.uvicorn",
     lambda m: m.Server(uvicorn_config(m), readiness_path=5), "readiness_path", "5"),
    ("Server-unknown", "graceful.uvicorn", lambda m: m.Server(uvicorn_config(m), bogus=1),
     "bogus", "bogus"),
    ("run-app", "graceful.uvicorn", lambda m: m.run(None), "app", "None"),
    ("run-coordinator", "graceful.uvicorn", lambda m: m.run(asgi_app, coordinator="x"),
     "coordinator", "'x'"),
    ("run-policy", "graceful.uvicorn", lambda m: m.run(asgi_app, policy=5), "policy", "5"),
    ("run-policy-name", "graceful.uvicorn", lambda m: m.run(asgi_app, policy="idle"), "policy",
     "'idle'"),
    ("run-grace_period_s-str", "graceful.uvicorn", lambda m: m.run(asgi_app, grace_period_s="5"),
     "grace_period_s", "'5'"),
    ("run-grace_period_s-negative", "graceful.uvicorn",
     lambda m: m.run(asgi_app, grace_period_s=-1), "grace_period_s", "-1"),
    ("run-idle_s-nan", "graceful.uvicorn", lambda m: m.run(asgi_app, idle_s=float("nan")),
     "idle_s", "nan"),
    ("run-nudge_clients", "graceful.uvicorn", lambda m: m.run(asgi_app, nudge_clients="yes"),
     "nudge_clients", "'yes'"),
    ("run-readiness_on_shutdown", "graceful.uvicorn",
     lambda m: m.run(asgi_app, readiness_on_shutdown="maybe"), "readiness_on_shutdown",
     "'maybe'"),
    ("run-cli-name", "graceful.uvicorn", lambda m: m.run(asgi_app, grace_period=5),
     "grace_period", "grace_period_s"),
    ("run-workers", "graceful.uvicorn", lambda m: m.run(asgi_app, workers=2), "workers", "2"),
    ("run-coordinator-and-option", "graceful.uvicorn",
     lambda m: m.run(asgi_app, coordinator=C(), idle_s=1), "idle_s", "1"),
    ("serve-kill_margin_s", "graceful.uvicorn",
     lambda m: asyncio.run(m.serve(asgi_app, kill_margin_s="1")), "kill_margin_s", "'1'"),
    # graceful.hypercorn
    ("hypercorn-run-config", "graceful.hypercorn", lambda m: m.run(asgi_app, "config"), "config",
     "'config'"),
    ("hypercorn-run-coordinator", "graceful.hypercorn",
     lambda m: m.run(asgi_app, coordinator="x"), "coordinator", "'x'"),
    ("hypercorn-run-grace_period_s", "graceful.hypercorn",
     lambda m: m.run(asgi_app, grace_period_s="5"), "grace_period_s", "'5'"),
    ("hypercorn-run-unknown", "graceful.hypercorn", lambda m: m.run(asgi_app, bogus=1), "bogus",
     "bogus"),
    ("hypercorn-serve-config", "graceful.hypercorn",
     lambda m: asyncio.run(m.serve(asgi_app, None)), "config", "None"),
    ("hypercorn-serve-coordinator", "graceful.hypercorn",
     lambda m: asyncio.run(m.serve(asgi_app, hypercorn_config(), coordinator="x")),
     "coordinator", "'x'"),
    ("hypercorn-serve-middleware", "graceful.hypercorn",
     lambda m: asyncio.run(m.serve(asgi_app, hypercorn_config(), prestop_path="stop")),
     "prestop_path", "'stop'"),
    # graceful.aiohttp
    ("run_app-coordinator", "graceful.aiohttp",
     lambda m: m.run_app(aiohttp_app(), coordinator="x"), "coordinator", "'x'"),
    ("run_app-policy", "graceful.aiohttp", lambda m: m.run_app(aiohttp_app(), policy=5),
     "policy", "5"),
    ("run_app-grace_period_s", "graceful.aiohttp",
     lambda m: m.run_app(aiohttp_app(), grace_period_s=-1), "grace_period_s", "-1"),
    ("load_app-None", "graceful.aiohttp", lambda m: m.load_app(None), "target", "None"),
    ("setup-app", "graceful.aiohttp", lambda m: m.setup(None, coordinator=C()), "app", "None"),
    ("setup-coordinator", "graceful.aiohttp", lambda m: m.setup(aiohttp_app(), coordinator="x"),
     "coordinator", "'x'"),
    ("Middleware-coordinator", "graceful.aiohttp", lambda m: m.Middleware("x"), "coordinator",
     "'x'"),
    ("AppRunner-coordinator", "graceful.aiohttp",
     lambda m: m.AppRunner(aiohttp_app(), coordinator="x"), "coordinator", "'x'"),
    # graceful.asyncio
    ("create_server-coordinator", "graceful.asyncio",
     lambda m: asyncio.run(m.create_server(asyncio.Protocol, "127.0.0.1", 0, coordinator="x")),
     "coordinator", "'x'"),
    ("create_server-factory", "graceful.asyncio",
     lambda m: asyncio.run(m.create_server(None, "127.0.0.1", 0, coordinator=C())),
     "protocol_factory", "None"),
    ("start_server-callback", "graceful.asyncio",
     lambda m: asyncio.run(m.start_server(None, "127.0.0.1", 0, coordinator=C())),
     "client_connected_cb", "None"),
    ("Messages-server", "graceful.asyncio", lambda m: m.Messages(None, asgi_app), "server",
     "None"),
    # graceful.metrics
    ("metrics-register", "graceful.metrics", lambda m: m.register("x"), "coordinator", "'x'"),
    ("metrics-asgi_app", "graceful.metrics", lambda m: m.asgi_app(None), "coordinator", "None"),
    ("metrics-registry", "graceful.metrics", lambda m: m.register(C(), "x"), "registry", "'x'"),
    ("metrics-refresh", "graceful.metrics", lambda m: m.register(C(), refresh_interval_s=-1),
     "refresh_interval_s", "-1"),
    # graceful.kubernetes
    ("Kubernetes-pod_name", "graceful.kubernetes", lambda m: m.Kubernetes(pod_name=5),
     "pod_name", "5"),
    ("Kubernetes-client_factory", "graceful.kubernetes",
     lambda m: m.Kubernetes(pod_name="p", namespace="n", client_factory=5), "client_factory",
     "5"),
    ("Kubernetes-attach", "graceful.kubernetes",
     lambda m: m.Kubernetes(pod_name="p", namespace="n").attach("x"), "coordinator", "'x'"),
    ("endpoint_state-slices", "graceful.kubernetes",
     lambda m: m.endpoint_state(None, pod_name="p", pod_ip=None), "slices", "None"),
    ("pod_identity-environ", "graceful.kubernetes", lambda m: m.pod_identity(5), "environ", "5"),
    ("kill_deadline-timestamp", "graceful.kubernetes",
     lambda m: m.kill_deadline(deletion_timestamp_s="x", deletion_grace_s=None,
                               termination_grace_s=None, requested_at_s=0.0, clock_skew_s=1.0,
                               grace_period_known=False),
     "deletion_timestamp_s", "'x'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("module", "call", "argument", "shown"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_a_wrong_argument_is_named_with_its_value(
    module: str, call: Callable[[Any], object], argument: str, shown: str
) -> None:
    m = pytest.importorskip(module)
    with pytest.raises((TypeError, ValueError)) as info:
        call(m)
    assert not isinstance(info.value, AttributeError)
    message = str(info.value)
    assert argument in message, message
    assert shown in message, message


# ------------------------------------------------------------ the run functions


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The servers ``graceful.uvicorn.run`` would run, not run."""
    uv = pytest.importorskip("graceful.uvicorn")
    servers: list[Any] = []
    monkeypatch.setattr(uv.Server, "run", lambda self, sockets=None: servers.append(self))
    return servers


def test_uvicorn_run_splits_graceful_options_from_uvicorns(served: list[Any]) -> None:
    import graceful.uvicorn

    graceful.uvicorn.run(
        asgi_app,
        port=0,
        timeout_keep_alive=3,
        grace_period_s=12,
        kill_margin_s=2,
        drain_timeout_s=7,
        idle_s=0.5,
        readiness_path="/ready",
    )
    (server,) = served
    c = server.coordinator
    assert (c.grace_period_s, c.kill_margin_s, c.drain_timeout_s) == (12, 2, 7)
    assert c.policy == AcceptUntilIdle(idle_s=0.5)
    assert (server.config.port, server.config.timeout_keep_alive) == (0, 3)
    assert server._middleware_options == {"readiness_path": "/ready"}


def test_uvicorn_run_takes_a_policy_by_name_or_instance(served: list[Any]) -> None:
    import graceful.uvicorn

    graceful.uvicorn.run(asgi_app, policy="serve-until-killed", max_wait_s=4)
    graceful.uvicorn.run(asgi_app, policy=ServeUntilKilled(max_wait_s=5))
    graceful.uvicorn.run(asgi_app, timeout_graceful_shutdown=9)  # uvicorn's name, as the CLI
    assert [s.coordinator.policy for s in served[:2]] == [
        ServeUntilKilled(max_wait_s=4),
        ServeUntilKilled(max_wait_s=5),
    ]
    assert served[2].coordinator.drain_timeout_s == 9
    with pytest.raises(ValueError, match=r"idle_s=1 applies to a policy given by name"):
        graceful.uvicorn.run(asgi_app, policy=AcceptUntilIdle(), idle_s=1)
    with pytest.raises(ValueError, match=r"grace_period_s \(1 s\) must be greater than"):
        graceful.uvicorn.run(asgi_app, grace_period_s=1)  # the CLI's check between options


def test_uvicorn_run_with_a_coordinator_takes_the_middleware_options(served: list[Any]) -> None:
    import graceful.uvicorn

    c = ShutdownCoordinator(grace_period_s=20)
    graceful.uvicorn.run(asgi_app, coordinator=c, prestop_path="/stop")
    (server,) = served
    assert server.coordinator is c
    assert server._middleware_options == {"prestop_path": "/stop"}


def test_every_python_name_is_a_keyword_of_its_target() -> None:
    """The names the run functions take are the targets' keywords (``idle_s`` is
    ``AcceptUntilIdle``'s, ``grace_period_s`` ``ShutdownCoordinator``'s), so one name
    means one thing throughout the Python API."""
    import inspect

    from graceful._options import python_options
    from graceful.asgi import GracefulMiddleware

    targets = {
        "policy": set(inspect.signature(graceful.policy_from_name).parameters) | {"policy"},
        "coordinator": set(inspect.signature(ShutdownCoordinator).parameters),
        "middleware": set(inspect.signature(GracefulMiddleware).parameters),
        "run": {"kubernetes", "wait_for_endpoints"},
    }
    for opt in python_options():
        assert opt.python in targets[opt.target], opt


def test_hypercorn_run_takes_graceful_options(monkeypatch: pytest.MonkeyPatch) -> None:
    hc = pytest.importorskip("graceful.hypercorn")
    seen: list[dict[str, Any]] = []

    async def serve(app: Any, config: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    monkeypatch.setattr(hc, "serve", serve)
    hc.run(asgi_app, worker_class="asyncio", grace_period_s=8, idle_s=1, liveness_path=None)
    (kwargs,) = seen
    assert kwargs["coordinator"].grace_period_s == 8
    assert kwargs["coordinator"].policy == AcceptUntilIdle(idle_s=1)
    assert kwargs["liveness_path"] is None


def test_aiohttp_run_app_takes_graceful_options(monkeypatch: pytest.MonkeyPatch) -> None:
    aio = pytest.importorskip("graceful.aiohttp")
    seen: list[ShutdownCoordinator] = []

    async def serve(app: Any, coordinator: ShutdownCoordinator, **kwargs: Any) -> None:
        seen.append(coordinator)

    monkeypatch.setattr(aio, "_serve", serve)
    aio.run_app(aiohttp_app(), grace_period_s=8, policy="refuse-immediately", shutdown_timeout=4)
    (c,) = seen
    assert (c.grace_period_s, c.drain_timeout_s, c.policy.name) == (8, 4, "refuse-immediately")
    with pytest.raises(ValueError, match="shutdown_timeout and drain_timeout_s"):
        aio.run_app(aiohttp_app(), shutdown_timeout=4, drain_timeout_s=5)


# ------------------------------------------------------------------ logging


def test_a_coordinator_run_by_the_app_writes_through_uvicorns_handlers_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under plain uvicorn (its logging configured, graceful's not) graceful's lines go
    through uvicorn's handlers; if something configured graceful's logging already
    (``graceful run``), nothing is added: no line twice."""
    graceful_logger = logging.getLogger("graceful")
    uvicorn_logger = logging.getLogger("uvicorn")
    handler = logging.NullHandler()
    monkeypatch.setattr(graceful_logger, "handlers", [])
    monkeypatch.setattr(graceful_logger, "propagate", True)
    monkeypatch.setattr(graceful_logger, "level", logging.NOTSET)
    monkeypatch.setattr(uvicorn_logger, "handlers", [handler])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # no application logging
    assert _logging.through_server()
    assert len(graceful_logger.handlers) == 1
    assert not graceful_logger.propagate
    assert not _logging.through_server()  # configured now: nothing added
    assert len(graceful_logger.handlers) == 1


def test_without_a_configured_server_logger_nothing_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    graceful_logger = logging.getLogger("graceful")
    monkeypatch.setattr(graceful_logger, "handlers", [])
    monkeypatch.setattr(logging.getLogger("uvicorn"), "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    assert not _logging.through_server()
    assert graceful_logger.handlers == []


def test_phase_is_still_accepted() -> None:
    assert asyncio.run(C().wait_for_phase(Phase.SERVING, timeout_s=0)) is True
