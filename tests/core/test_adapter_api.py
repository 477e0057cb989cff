"""The adapter API is the only way adapters talk to the coordinator.

Adapters (the servers, the middleware, the CLI, the integrations) report through public
methods and obey through subscriptions; the coordinator's private attributes are its
own, so that its internals can change without touching every adapter.  This file checks
that statically (``ast``: no ``coordinator._x``), that the public adapter API exists and
is documented, and that ``request_shutdown`` is safe to call from another thread.
"""

from __future__ import annotations

import ast
import inspect
import threading
from pathlib import Path

import anyio
import pytest

import graceful
from graceful import Phase, ServeUntilKilled, ShutdownCoordinator

PACKAGE = Path(graceful.__file__).parent

#: The coordinator itself and the pure parts it is made of: private access is theirs.
CORE = {
    "__init__.py",
    "_core/__init__.py",
    "_core/coordinator.py",
    "_core/engine.py",
    "_core/machine.py",
    "_core/timetable.py",
    "_core/owner.py",
    "_core/tracking.py",
    "_core/sessions.py",
    "_core/statistics.py",
    "_core/checks.py",
    "_core/phases.py",
    "_core/deadlines.py",
    "_core/hooks.py",
    "_core/signals.py",
    "_core/policy.py",
}
#: Adapters that must exist; any other non-core module found is checked too.
REQUIRED_ADAPTERS = (
    "asgi.py",
    "asyncio.py",
    "uvicorn/__init__.py",
    "gunicorn/__init__.py",
    "_cli/run.py",
    "_cli/command.py",
    "_cli/servers.py",
    "_cli/address.py",
    "_cli/workers.py",
    "_cli/tasks.py",
)
OPTIONAL_ADAPTERS = (
    "hypercorn/__init__.py",
    "hypercorn/_server.py",
    "hypercorn/_connection.py",
    "hypercorn/_asyncio.py",
    "hypercorn/_trio.py",
    "hypercorn/_hot.py",
    "aiohttp/__init__.py",
    "aiohttp/_middleware.py",
    "aiohttp/_setup.py",
    "aiohttp/_hot.py",
    "aiohttp/_runner.py",
    "kubernetes/__init__.py",
    "kubernetes/_api.py",
    "kubernetes/_pod.py",
    "kubernetes/_watch.py",
    "metrics/__init__.py",
    "metrics/_collector.py",
    "metrics/_exposition.py",
    "metrics/_multiprocess.py",
    "metrics/_prometheus.py",
    "metrics/_registry.py",
)

#: Expressions bound to a coordinator: these names, and any ``<x>.<attribute>`` below.
COORDINATOR_NAMES = {"coordinator", "c"}
COORDINATOR_ATTRIBUTES = {"coordinator", "_coordinator", "_c"}

ADAPTER_API = (
    "connection_opened",
    "connection_closed",
    "request_started",
    "request_finished",
    "track_request",
    "track_session",
    "report_activity",
    "classify_connections",
    "first_request",
    "add_request_source",
    "measure_requests_always",
    "add_stopping_step",
    "subscribe",
    "start_background",
    "request_shutdown",
    "signal_received",
    "expect_relayed_signals",
    "report_pod_serving",
    "pod_still_serving",
    "set_kill_deadline",
    "expect_kill_deadline",
    "notify_endpoint_removed",
    "deadlines",
    "cutting",
    "nudging",
    "draining",
)


def adapter_modules() -> list[Path]:
    return sorted(
        path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).as_posix() not in CORE
    )


def module_id(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


class PrivateAccess(ast.NodeVisitor):
    """Finds ``X._name`` where X is bound to a coordinator (dunders allowed)."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.aliases: set[str] = set()

    def is_coordinator(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in COORDINATOR_NAMES or node.id in self.aliases
        if isinstance(node, ast.Attribute):
            return node.attr in COORDINATOR_ATTRIBUTES
        return False

    def visit_Assign(self, node: ast.Assign) -> None:
        # coord = self.coordinator  →  coord is a coordinator too
        if self.is_coordinator(node.value):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.aliases.add(target.id)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = node.attr
        dunder = name.startswith("__") and name.endswith("__")
        if name.startswith("_") and not dunder and self.is_coordinator(node.value):
            self.found.append(f"line {node.lineno}: {ast.unparse(node)}")
        self.generic_visit(node)


def private_accesses(source: str) -> list[str]:
    visitor = PrivateAccess()
    tree = ast.parse(source)
    visitor.visit(tree)  # first pass collects aliases assigned anywhere in the module
    visitor.found.clear()
    visitor.visit(tree)
    return visitor.found


def test_the_checker_flags_what_it_should() -> None:
    source = """
def f(coordinator, c, self):
    coordinator._phase
    c._requests += 1
    self.coordinator._notify()
    self._c._zero_waiters
    self._coordinator._table
    server.coordinator._draining
    coord = self.coordinator
    coord._reason
    coordinator.__class__
    coordinator.request_started()
    self._handovers.pending
    other._phase
"""
    assert private_accesses(source) == [
        "line 3: coordinator._phase",
        "line 4: c._requests",
        "line 5: self.coordinator._notify",
        "line 6: self._c._zero_waiters",
        "line 7: self._coordinator._table",
        "line 8: server.coordinator._draining",
        "line 10: coord._reason",
    ]


def test_every_required_adapter_is_checked() -> None:
    checked = {module_id(path) for path in adapter_modules()}
    assert set(REQUIRED_ADAPTERS) <= checked
    assert not checked & CORE
    for name in OPTIONAL_ADAPTERS:
        assert ((PACKAGE / name).exists()) == (name in checked)


@pytest.mark.parametrize("path", adapter_modules(), ids=module_id)
def test_adapters_use_no_private_attribute_of_the_coordinator(path: Path) -> None:
    assert private_accesses(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("name", ADAPTER_API)
def test_adapter_api_exists_and_is_documented(name: str) -> None:
    assert not name.startswith("_")
    member = inspect.getattr_static(ShutdownCoordinator, name)
    if isinstance(member, property):
        doc = inspect.getdoc(member)
    else:
        assert callable(getattr(ShutdownCoordinator, name)), name
        doc = inspect.getdoc(getattr(ShutdownCoordinator, name))
    assert doc, f"ShutdownCoordinator.{name} has no docstring"
    assert len(doc.split()) >= 4, f"ShutdownCoordinator.{name}: {doc!r} says too little"


@pytest.mark.anyio
async def test_adapter_api_works_before_run() -> None:
    """The reporting half needs no running coordinator (adapters start first)."""
    c = ShutdownCoordinator()
    c.connection_opened()
    started = c.request_started()
    with c.track_request(), c.track_session() as session:
        assert not session.drain_requested
        s = c.statistics()
        assert (s.connections, s.requests, s.sessions) == (1, 2, 1)
    c.request_finished(started)
    c.report_activity()
    c.connection_closed()
    s = c.statistics()
    assert (s.connections, s.requests, s.sessions) == (0, 0, 0)
    assert (s.connections_total, s.requests_total) == (1, 2)
    assert (c.cutting, c.nudging, c.draining, c.deadlines) == (False, False, False, None)
    unsubscribe = c.subscribe(lambda phase: None)
    unsubscribe()
    unsubscribe()  # twice is harmless


@pytest.mark.anyio
async def test_probes_are_not_activity() -> None:
    """With classify_connections, a new connection counts as activity only once its first
    request is seen and is not a probe; later requests on it do not count again."""
    c = ShutdownCoordinator()
    c.classify_connections()
    c.connection_opened()  # while serving: a connection is activity at once
    before = c.statistics().since_last_connection_s
    assert before is not None
    c.request_shutdown("test")
    stamp = c._last_activity_at
    c.connection_opened()  # accepting: not yet
    assert c._last_activity_at == stamp
    c.first_request(("10.0.0.1", 1111), probe=True)  # the kubelet's probe
    assert c._last_activity_at == stamp
    c.first_request(("10.0.0.1", 2222), probe=False)  # traffic
    traffic = c._last_activity_at
    assert traffic is not None
    assert stamp is None or traffic >= stamp
    c.first_request(("10.0.0.1", 2222), probe=False)  # the same connection again
    c.first_request(("10.0.0.1", 1111), probe=False)  # a probe connection's 2nd request
    assert c._last_activity_at == traffic
    c.first_request(None, probe=False)  # no connection identity: every request counts
    assert c._last_activity_at is not None
    assert c._last_activity_at >= traffic


@pytest.mark.anyio
async def test_without_classification_connections_are_activity() -> None:
    c = ShutdownCoordinator()
    c.request_shutdown("test")
    stamp = c._last_activity_at
    c.connection_opened()
    assert c._last_activity_at is not None
    assert c._last_activity_at != stamp


@pytest.mark.anyio
async def test_request_shutdown_from_another_thread_runs_on_the_loop_thread(
    virtual_time: bool,
) -> None:
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    threads: list[tuple[Phase, int]] = []
    c.subscribe(lambda phase: threads.append((phase, threading.get_ident())))
    loop_thread = threading.get_ident()
    called: list[int] = []

    def from_thread() -> None:
        called.append(threading.get_ident())
        c.request_shutdown("from a thread")

    async def never() -> None:
        await anyio.sleep_forever()

    # No deadline on the virtual clock: it would jump ahead while the thread runs.
    with anyio.fail_after(None if virtual_time else 10):
        async with anyio.create_task_group() as tg:
            await tg.start(
                lambda task_status: c.run(shutdown_trigger=never, task_status=task_status)
            )
            thread = threading.Thread(target=from_thread)
            thread.start()
            assert await c.wait_for_phase(Phase.ACCEPTING)
            thread.join(10)
            assert c.statistics().reason == "from a thread"
            c.request_shutdown("test", immediate=True)
            assert await c.wait_for_phase(Phase.STOPPED)
    assert called
    assert called[0] != loop_thread
    assert threads[0] == (Phase.ACCEPTING, loop_thread)
    assert {ident for _, ident in threads} == {loop_thread}


@pytest.mark.anyio
async def test_a_request_source_adds_to_the_counts_until_its_requests_are_reported() -> None:
    """A server that counts its own requests while nothing shuts down (graceful's uvicorn
    server): the coordinator adds them, and the server reports them itself at the
    shutdown request (adopted, they leave the source)."""
    c = ShutdownCoordinator(policy=ServeUntilKilled())
    own = {"in_flight": 2, "started": 5}
    c.add_request_source(lambda: (own["in_flight"], own["started"]))
    s = c.statistics()
    assert (s.requests, s.requests_total) == (2, 5)
    assert not c.drained
    with pytest.raises(RuntimeError, match="request source already"):
        c.add_request_source(lambda: (0, 0))

    def adopt(phase: Phase) -> None:  # what the server does at the first phase change
        for _ in range(own["in_flight"]):
            c.request_started()
        own["started"] -= own["in_flight"]
        own["in_flight"] = 0

    c.subscribe(adopt)
    c.request_shutdown("test")
    s = c.statistics()
    assert (s.requests, s.requests_total, s.requests_after_shutdown) == (2, 5, 0)
    c.request_finished()
    c.request_finished()
    assert c.drained
