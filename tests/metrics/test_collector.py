"""graceful.metrics in process: the collector, the multiprocess writer, the ASGI app.

The coordinator runs on asyncio and trio (virtual clock); scrapes are direct registry
reads, ASGI calls or a scrape from a plain thread.  Multiprocess mode points
``PROMETHEUS_MULTIPROC_DIR`` at a temporary directory and gives prometheus_client a
multiprocess value class with a made-up process id per coordinator, so two "workers" live
in one test process.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest, values
from prometheus_client.parser import text_string_to_metric_families

import graceful.metrics
from graceful import AcceptUntilIdle, Phase, ShutdownCoordinator

pytestmark = pytest.mark.anyio

PHASES = [str(p) for p in Phase]


async def never() -> None:
    await anyio.sleep_forever()


async def start(tg: anyio.abc.TaskGroup, c: ShutdownCoordinator) -> None:
    await tg.start(lambda task_status: c.run(shutdown_trigger=never, task_status=task_status))


def phase_of(registry: CollectorRegistry) -> dict[str, float | None]:
    return {p: registry.get_sample_value("graceful_phase", {"phase": p}) for p in PHASES}


def value(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name)


# ------------------------------------------------------------------ single process


async def test_scrape_reads_the_coordinator_as_it_drains(virtual_time: bool) -> None:
    c = ShutdownCoordinator(policy=AcceptUntilIdle(idle_s=1), grace_period_s=30)
    registry = CollectorRegistry()
    graceful.metrics.register(c, registry)
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        assert phase_of(registry) == {
            "serving": 1.0, "accepting": 0.0, "draining": 0.0, "stopping": 0.0, "stopped": 0.0
        }  # fmt: skip
        assert value(registry, "graceful_kill_deadline_seconds") == math.inf
        assert value(registry, "graceful_since_last_connection_seconds") == math.inf
        c.connection_opened()
        held = c.request_started()
        assert value(registry, "graceful_open_connections") == 1
        assert value(registry, "graceful_requests_in_flight") == 1
        assert value(registry, "graceful_connections_total") == 1

        c.request_shutdown("SIGTERM")
        assert phase_of(registry)["accepting"] == 1.0
        assert phase_of(registry)["serving"] == 0.0
        kill = value(registry, "graceful_kill_deadline_seconds")
        assert kill is not None
        assert 29 < kill <= 30
        left = value(registry, "graceful_phase_time_left_seconds")
        assert left is not None
        assert 0 < left < 30
        for _ in range(3):  # connections and requests after SIGTERM
            c.connection_opened()
            c.request_finished(c.request_started())
        assert value(registry, "graceful_connections_after_shutdown_total") == 3
        assert value(registry, "graceful_requests_after_shutdown_total") == 3
        assert value(registry, "graceful_requests_total") == 4
        assert value(registry, "graceful_open_connections") == 4

        assert await c.wait_for_phase(Phase.DRAINING)
        assert phase_of(registry)["draining"] == 1.0
        for _ in range(3):
            c.connection_closed()
        assert value(registry, "graceful_connections_closed_draining_total") == 3
        assert value(registry, "graceful_drain_duration_seconds_count") == 0
        if virtual_time:
            await anyio.sleep(2)
        c.request_finished(held)
        c.connection_closed()
        assert await c.wait_for_phase(Phase.STOPPED)
        assert phase_of(registry)["stopped"] == 1.0
        assert value(registry, "graceful_cut_at_stopping_total") == 0
        assert value(registry, "graceful_drain_duration_seconds_count") == 1
        duration = value(registry, "graceful_drain_duration_seconds_sum")
        assert duration is not None
        if virtual_time:
            assert duration == pytest.approx(2)
            assert registry.get_sample_value(
                "graceful_drain_duration_seconds_bucket", {"le": "1.0"}
            ) == 0  # fmt: skip
        assert (
            registry.get_sample_value("graceful_drain_duration_seconds_bucket", {"le": "+Inf"}) == 1
        )
        # The loop still runs, but the coordinator stopped: the numbers stay readable.
        assert value(registry, "graceful_open_connections") == 0


async def test_work_cut_at_the_deadline_is_counted() -> None:
    c = ShutdownCoordinator(grace_period_s=30)
    registry = CollectorRegistry()
    graceful.metrics.register(c, registry)
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        c.request_started()
        c.request_started()
        with c.track_session():
            c.request_shutdown("SIGTERM", immediate=True)
            assert value(registry, "graceful_cut_at_stopping_total") == 3
            assert value(registry, "graceful_sessions") == 1
        tg.cancel_scope.cancel()


async def test_scrape_from_another_thread() -> None:
    """prometheus_client's start_http_server scrapes from its own thread: the snapshot
    is taken on the event-loop thread."""
    c = ShutdownCoordinator()
    registry = CollectorRegistry()
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        graceful.metrics.register(c, registry)
        c.connection_opened()
        scraped: list[bytes] = []
        thread = threading.Thread(target=lambda: scraped.append(generate_latest(registry)))
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        assert b"graceful_open_connections 1.0" in scraped[0]
        tg.cancel_scope.cancel()


def test_registering_outside_the_loop_then_scraping_before_it_runs() -> None:
    """A registry that describes at registration (the default one does) gets the names;
    a scrape before the coordinator runs has no snapshot and shows no samples."""
    c = ShutdownCoordinator()
    registry = CollectorRegistry(auto_describe=True)
    collector = graceful.metrics.register(c, registry)
    assert graceful.metrics.register(c, registry) is collector  # idempotent
    assert list(collector.collect()) == []
    assert b"graceful_" not in generate_latest(registry)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await start(tg, c)
            assert phase_of(registry)["serving"] == 1.0
            tg.cancel_scope.cancel()

    anyio.run(main)


def test_bad_input_is_named() -> None:
    c = ShutdownCoordinator()
    with pytest.raises(TypeError, match=r"registry must be a prometheus_client.Collector.*'nope'"):
        graceful.metrics.register(c, "nope")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"coordinator must be a graceful.ShutdownCoordinator"):
        graceful.metrics.register(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"refresh_interval_s"):
        graceful.metrics.register(c, CollectorRegistry(), refresh_interval_s=-1)
    with pytest.raises(TypeError, match=r"registry must be .* got 42"):
        graceful.metrics.asgi_app(c, 42)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    graceful.metrics.register(c, registry)
    with pytest.raises(ValueError, match=r"another ShutdownCoordinator"):
        graceful.metrics.register(ShutdownCoordinator(), registry)
    with pytest.raises(TypeError, match=r"pid must be a positive int, got 'x'"):
        graceful.metrics.mark_process_dead("x")  # type: ignore[arg-type]
    graceful.metrics.mark_process_dead(os.getpid())  # not multiprocess: nothing to do


# ------------------------------------------------------------------------- ASGI


async def call(app: Any, method: str = "GET", path: str = "/metrics", **scope: Any) -> Any:
    messages: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        messages.append(message)

    full = {"type": "http", "method": method, "path": path, "headers": [], **scope}
    await app(full, receive, send)
    start, body = messages
    return start["status"], dict(start["headers"]), body["body"]


async def test_asgi_app_serves_the_exposition() -> None:
    c = ShutdownCoordinator()
    registry = CollectorRegistry()
    app = graceful.metrics.asgi_app(c, registry)
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        c.request_started()
        status, headers, body = await call(app)
        assert status == 200
        assert headers[b"content-type"].startswith(b"text/plain; version=0.0.4")
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        assert families["graceful_requests_in_flight"].samples[0].value == 1
        assert int(headers[b"content-length"]) == len(body)

        status, headers, body = await call(app, "HEAD")
        assert (status, body) == (200, b"")
        assert int(headers[b"content-length"]) > 0

        status, headers, _ = await call(app, "POST")
        assert (status, headers[b"allow"]) == (405, b"GET, HEAD")

        _, _, body = await call(app, query_string=b"name[]=graceful_sessions")
        assert b"graceful_sessions 0.0" in body
        assert b"graceful_phase" not in body

        accept = [(b"accept", b"application/openmetrics-text; version=1.0.0")]
        _, headers, body = await call(app, headers=accept)
        assert headers[b"content-type"].startswith(b"application/openmetrics-text")
        assert body.endswith(b"# EOF\n")
        tg.cancel_scope.cancel()


async def test_asgi_app_closes_websockets_and_ignores_lifespan() -> None:
    app = graceful.metrics.asgi_app(ShutdownCoordinator(), CollectorRegistry())
    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def receive() -> MutableMapping[str, Any]:
        raise AssertionError("not read")

    await app({"type": "websocket", "path": "/metrics"}, receive, send)
    await app({"type": "lifespan"}, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]


# ----------------------------------------------------------------- multiprocess


@pytest.fixture
def multiproc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    yield tmp_path
    values.close_all_multiprocess_files()


def files(directory: Path, pattern: str) -> list[Path]:
    return list(directory.glob(pattern))


def as_worker(monkeypatch: pytest.MonkeyPatch, pid: int) -> None:
    """Metrics created from now on write the files of process ``pid``."""
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda: pid))


async def test_multiprocess_values_are_aggregated(
    multiproc_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = ShutdownCoordinator(), ShutdownCoordinator()
    as_worker(monkeypatch, 1001)
    exposition = graceful.metrics.Exposition(first, refresh_interval_s=0.05)
    as_worker(monkeypatch, 1002)
    graceful.metrics.register(second, refresh_interval_s=0.05)
    # Every process's metrics, not the default registry.
    assert isinstance(exposition.registry, CollectorRegistry)

    def scrape() -> dict[str, float]:
        text = exposition.render()[0].decode()
        return {
            s.name + ("" if "phase" not in s.labels else f"[{s.labels['phase']}]"): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    async with anyio.create_task_group() as tg:
        await start(tg, first)
        await start(tg, second)
        first.connection_opened()
        second.connection_opened()
        second.request_started()
        second.request_shutdown("SIGTERM")  # a phase change writes at once
        first_values = scrape()  # the scraped process refreshes its own values first
        assert first_values["graceful_phase[serving]"] == 1
        assert first_values["graceful_phase[accepting]"] == 1
        assert first_values["graceful_open_connections"] == 2
        assert first_values["graceful_requests_in_flight"] == 1
        assert first_values["graceful_connections_total"] == 2
        assert first_values["graceful_kill_deadline_seconds"] < 31  # livemin: the soonest
        second.connection_opened()  # written within refresh_interval_s
        for _ in range(500):  # written within refresh_interval_s (0.05 s)
            if scrape()["graceful_connections_after_shutdown_total"] == 1:
                break
            await anyio.sleep(0.01)
        else:
            pytest.fail("the second process's counter was not written")
        assert scrape()["graceful_connections_total"] == 3  # counters are incremented

        graceful.metrics.mark_process_dead(1002)  # what gunicorn's child_exit hook does
        left = scrape()
        assert left["graceful_phase[accepting]"] == 0  # gone with its live gauges
        assert left["graceful_open_connections"] == 1
        assert left["graceful_connections_total"] == 3  # counters stay
        tg.cancel_scope.cancel()
    assert files(multiproc_dir, "counter_*.db")


async def test_multiprocess_process_removes_its_live_gauges_when_stopped(
    multiproc_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = ShutdownCoordinator(grace_period_s=10)
    exposition = graceful.metrics.Exposition(c)
    async with anyio.create_task_group() as tg:
        await start(tg, c)
        assert b'graceful_phase{phase="serving"} 1.0' in exposition.render()[0]
        c.request_shutdown("SIGTERM", drain_now=True)
        assert await c.wait_for_phase(Phase.STOPPED)
        text = exposition.render()[0].decode()
        assert "graceful_drain_duration_seconds_count 1.0" in text
        assert "graceful_phase{" not in text
        assert "graceful_open_connections " not in text
        tg.cancel_scope.cancel()
    assert not files(multiproc_dir, f"gauge_live*_{os.getpid()}.db")


def test_multiprocess_misconfiguration_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "missing"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(missing))
    with pytest.raises(ValueError, match=rf"PROMETHEUS_MULTIPROC_DIR .* got '{missing}'"):
        graceful.metrics.register(ShutdownCoordinator())
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert not getattr(values.ValueClass, "_multiprocess", False)
    with pytest.raises(RuntimeError, match=r"set after prometheus_client was imported"):
        graceful.metrics.register(ShutdownCoordinator())


async def _scrape(app: Any) -> tuple[int, bytes]:
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": []}
    await app(scope, receive, send)
    return sent[0]["status"], sent[1]["body"]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_scrape_that_catches_a_file_being_created_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In multiprocess mode a worker's file can be read in the instant between its
    creation and its first bytes (``struct.error``, a 500 under load in CI): the scrape
    collects again a moment later; if it still fails, 503 with the reason."""
    import struct

    failures = [struct.error("unpack_from requires a buffer of at least 4 bytes")]
    render = graceful.metrics.Exposition.render

    def flaky(self: Any, *args: Any) -> tuple[bytes, str]:
        if failures:
            raise failures.pop()
        return render(self, *args)

    monkeypatch.setattr(graceful.metrics.Exposition, "render", flaky)
    app = graceful.metrics.asgi_app(ShutdownCoordinator(), CollectorRegistry())
    status, body = await _scrape(app)
    assert status == 200
    assert b"graceful_phase" in body

    def broken(self: Any, *args: Any) -> tuple[bytes, str]:
        raise struct.error("still half-written")

    monkeypatch.setattr(graceful.metrics.Exposition, "render", broken)
    status, body = await _scrape(app)
    assert (status, body) == (503, b"metrics unavailable: error('still half-written')\n")
