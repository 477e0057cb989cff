"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .servers import RawHTTP, ServerProcess


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """The servers a test started: each stopped at teardown, with the clients' sockets
    (a test module may define its own, checking more)."""
    started: list[ServerProcess] = []
    yield started
    RawHTTP.close_all()
    for server in started:
        server.stop()
