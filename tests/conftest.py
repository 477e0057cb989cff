from __future__ import annotations

import os
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import pytest
from hypothesis import settings

from tests.support import bytecode, zygote
from tests.support.servers import RawHTTP, ServerProcess

# gunicorn 27 gives every master a control socket, by default at one path per user
# (~/.gunicorn/gunicorn.ctl): masters started at once by parallel tests race to bind it
# and log "Control server error".  No test uses it; every gunicorn the tests start
# inherits this.
try:
    if int(metadata.version("gunicorn").split(".")[0]) >= 27:
        os.environ.setdefault("GUNICORN_CMD_ARGS", "--no-control-socket")
except metadata.PackageNotFoundError:
    pass

# Hypothesis's per-example deadline (200 ms) is a timed assertion: on a loaded CI
# machine a slow example failed it.  Examples are bounded by count, not by the clock.
settings.register_profile("graceful", deadline=None)
settings.load_profile("graceful")


def pytest_configure(config: pytest.Config) -> None:
    # Before the workers start: they and every process they start read what this compiled.
    bytecode.cache(config)
    # Before any test changes it: the environment the zygote's children are compared with.
    zygote.remember_environment()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep ``--dist loadgroup`` working on pytest 9.2+: pytest-xdist (3.8) sends a group
    whole to one worker by the ``@group`` it appends to each test's ``_nodeid``, which
    pytest 9.2 no longer reads (the id is ``_id``).  Without it every worker ran some of
    tests/kubernetes and started control planes of its own: 12 API servers, not 6."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = {
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        }
        nodeid = item.nodeid
        if not names or nodeid.rfind("@") > nodeid.rfind("]"):
            continue  # no group, or xdist named it
        from _pytest.nodeid import NodeId  # pytest 9.2+: before it, xdist's own works

        item._id = NodeId.parse(f"{nodeid}@{'_'.join(sorted(names))}")  # type: ignore[attr-defined]


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param("trio", id="trio-mockclock"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """Every async test runs on asyncio and on trio; trio with a virtual clock that
    jumps ahead whenever all tasks are blocked, so a 30 s deadline takes milliseconds."""
    if request.param == "trio":
        from trio.testing import MockClock

        return ("trio", {"clock": MockClock(autojump_threshold=0)})
    return "asyncio"


@pytest.fixture
def virtual_time(anyio_backend: Any) -> bool:
    """Whether the test runs on the virtual clock (exact timings can be asserted)."""
    return isinstance(anyio_backend, tuple)


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """The servers a test started: each stopped at teardown, with the clients' sockets
    (a test module may define its own, checking more)."""
    started: list[ServerProcess] = []
    yield started
    RawHTTP.close_all()
    for server in started:
        server.stop()
