"""``graceful demo`` (the README's main job) as a real subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from graceful import Phase
from graceful._core.events import parse_event
from tests.support.servers import ROOT

SVG = "{http://www.w3.org/2000/svg}"
#: Traffic enough that "none failed" means something: a floor, not a throughput claim
#: (the demo runs for a set time, and this machine is shared; benchmarks/ measure rates).
MIN_REQUESTS = 30


def _demo(*options: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``graceful demo`` in a session of its own, so in a CFS autogroup of its own (as its
    backends are): its clients and balancer then get the CPU share of one process group,
    not a share of the pytest workers' one.  In a loaded run graceful-sync's A refused 4
    connections during the propagation delay; the likely cause is clients starved
    there for a second, sending no new connection for A's idle window while the balancer
    still routed to A (not reproduced outside the suite: 10 runs under busy loops lost 0)."""
    return subprocess.run(
        [sys.executable, "-m", "graceful", "demo", *options],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, start_new_session=True,
    )  # fmt: skip


def _panels(plot: Path) -> dict[str, ET.Element]:
    """The timeline's panels by server name, after checking the document is an SVG."""
    svg = ET.parse(plot).getroot()  # well-formed, or this raises
    assert svg.tag == f"{SVG}svg"
    return {g.attrib["data-server"]: g for g in svg.iter(f"{SVG}g") if g.get("class") == "panel"}


def _series(panel: ET.Element) -> dict[str, list[tuple[float, float]]]:
    """Each backend's requests/s polyline in ``panel``, as (x, y) points."""
    return {
        line.attrib["data-backend"]: [
            (float(px), float(py))
            for px, py in (point.split(",") for point in line.attrib["points"].split())
        ]
        for line in panel.iter(f"{SVG}polyline")
        if line.get("class") == "series"
    }


def _marks(panel: ET.Element) -> list[str]:
    return [g.attrib["data-label"] for g in panel.iter(f"{SVG}g") if g.get("class") == "mark"]


def test_demo_shows_zero_failures_for_accept_until_idle(tmp_path: Path) -> None:
    plot = tmp_path / "timeline.svg"
    result = _demo(
        "--servers", "uvicorn,graceful:accept-until-idle",
        "--keepalive-clients", "2", "--fresh-clients", "2", "--long-requests", "1",
        "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {
        match.group(1): (int(match.group(2)), int(match.group(3)))
        for match in re.finditer(r"│ (\S+)\s+│\s+(\d+) │\s+(\d+) │", result.stdout)
    }
    assert set(rows) == {"uvicorn", "graceful:accept-until-idle"}, result.stdout
    requests, failed = rows["graceful:accept-until-idle"]
    assert requests > MIN_REQUESTS
    assert failed == 0, result.stdout
    assert rows["uvicorn"][1] > 0, result.stdout  # stock uvicorn refuses during propagation
    assert "exited 0 at" in result.stdout
    panels = _panels(plot)
    assert set(panels) == {"uvicorn", "graceful:accept-until-idle"}
    # A's phase marks: its events reached the demo; stock uvicorn has only the SIGTERM.
    marks = _marks(panels["graceful:accept-until-idle"])
    assert marks[0] == "SIGTERM: accepting", marks
    assert {"draining", "stopping", "stopped", "exited 0"} <= set(marks), marks
    assert _marks(panels["uvicorn"]) == ["SIGTERM", "died of SIGTERM"]


def test_demo_plot_draws_each_backend_and_the_phases(tmp_path: Path) -> None:
    """The timeline of a graceful restart: a series per backend, each with some traffic;
    A served before SIGTERM, C only after it; the marks in the order A went through its
    phases; the propagation band; no failure ticks."""
    plot = tmp_path / "timeline.svg"
    result = _demo(
        "--servers", "graceful:accept-until-idle", "--warmup", "1", "--tail", "0.3",
        "--keepalive-clients", "1", "--fresh-clients", "2", "--long-requests", "0",
        "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert plot.stat().st_size < 30_000  # small enough for docs/img
    (panel,) = _panels(plot).values()
    series = _series(panel)
    assert set(series) == {"A", "B", "C"}
    marks = {
        g.attrib["data-label"]: float(g.attrib["data-t"])
        for g in panel.iter(f"{SVG}g")
        if g.get("class") == "mark"
    }
    assert list(marks) == ["SIGTERM: accepting", "draining", "stopping", "stopped", "exited 0"]
    assert marks["SIGTERM: accepting"] == 0  # times are counted from SIGTERM
    assert 0 < marks["draining"] <= marks["stopping"] <= marks["stopped"] <= marks["exited 0"]
    zero = max(y for points in series.values() for _, y in points)  # the y of 0 requests/s
    for name in ("A", "B", "C"):
        assert any(y < zero for _, y in series[name]), f"{name} served nothing"
    sigterm_x = next(
        float(line.attrib["x1"])
        for g in panel.iter(f"{SVG}g")
        if g.get("data-label") == "SIGTERM: accepting"
        for line in g.iter(f"{SVG}line")
    )
    half_bin = (series["C"][1][0] - series["C"][0][0]) / 2  # points are at bins' centres
    assert any(y < zero for x, y in series["A"] if x + half_bin <= sigterm_x)
    assert all(y == zero for x, y in series["C"] if x + half_bin <= sigterm_x)  # C: new pod
    (band,) = (r for r in panel.iter(f"{SVG}rect") if r.get("class") == "propagation")
    assert float(band.attrib["x"]) == sigterm_x
    assert not [line for line in panel.iter(f"{SVG}line") if line.get("class") == "failure"]


def test_demo_runs_hypercorn_and_aiohttp_stock_and_graceful(tmp_path: Path) -> None:
    """Issues 10 and 11: stock and graceful rows for hypercorn and aiohttp, the graceful
    ones with A's phases from its own events, and zero failed requests."""
    servers = [
        "hypercorn", "graceful-hypercorn:accept-until-idle",
        "aiohttp", "graceful-aiohttp:accept-until-idle",
    ]  # fmt: skip
    report, plot = tmp_path / "demo.json", tmp_path / "timeline.svg"
    result = _demo(
        "--servers", ",".join(servers), "--warmup", "1", "--tail", "0.3",
        "--keepalive-clients", "1", "--fresh-clients", "1", "--long-requests", "1",
        "--long-request-s", "1", "--websockets", "1",
        "--json", str(report), "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outcomes = {o["server"]: o for o in json.loads(report.read_text())["outcomes"]}
    assert list(outcomes) == servers
    for name in servers:
        assert name in result.stdout  # the table has a row for it
        outcome = outcomes[name]
        assert outcome["requests"] > MIN_REQUESTS, outcome
        assert outcome["a_ended"] == "exited 0", outcome
        if outcome["policy"] is None:  # stock: the listener closes at SIGTERM
            assert outcome["failed"] > 0, outcome
            assert outcome["results"]["refused"] > 0, outcome
            assert outcome["a_phases"] == []
        else:
            assert outcome["failed"] == 0, (outcome["results"], outcome)
            phases = [mark["phase"] for mark in outcome["a_phases"]]
            assert phases == ["accepting", "draining", "stopping", "stopped"], outcome
    assert set(_panels(plot)) == set(servers)


def test_demo_runs_granian_stock_and_graceful(tmp_path: Path) -> None:
    """Issue 31: stock granian (``python -m granian --interface asgi``) refuses
    connections during the propagation delay; graceful's granian, every policy but
    refuse-immediately, loses nothing, with A's phases from its own events, and exits
    before SIGKILL."""
    pytest.importorskip("granian")
    servers = [
        "granian", "graceful-granian:accept-until-idle", "graceful-granian:serve-until-killed",
    ]  # fmt: skip
    report, plot = tmp_path / "demo.json", tmp_path / "timeline.svg"
    result = _demo(
        "--servers", ",".join(servers), "--warmup", "1", "--tail", "0.3",
        "--keepalive-clients", "1", "--fresh-clients", "1", "--long-requests", "1",
        "--long-request-s", "1", "--websockets", "1",
        "--json", str(report), "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outcomes = {o["server"]: o for o in json.loads(report.read_text())["outcomes"]}
    assert list(outcomes) == servers
    for name in servers:
        assert name in result.stdout  # the table has a row for it
        outcome = outcomes[name]
        assert outcome["requests"] > MIN_REQUESTS, outcome
        assert outcome["a_ended"] == "exited 0", outcome
        if outcome["policy"] is None:  # stock: granian's listener closes at SIGTERM
            assert outcome["results"]["refused"] > 0, outcome
            assert outcome["a_phases"] == []
        else:
            assert outcome["failed"] == 0, (outcome["results"], outcome)
            phases = [mark["phase"] for mark in outcome["a_phases"]]
            assert phases == ["accepting", "draining", "stopping", "stopped"], outcome
    assert set(_panels(plot)) == set(servers)


@pytest.mark.parametrize("worker", ["sync", "gthread"])
def test_demo_runs_gunicorn_sync_and_gthread_stock_and_graceful(
    tmp_path: Path, worker: str
) -> None:
    """Issue 22: the rolling restart with a 1.5 s propagation delay loses requests with
    stock ``sync`` and ``gthread`` and none with graceful's workers; the long request
    completes and graceful's A exits before SIGKILL.  A grace period of 10 s, not the
    demo's 6: A's four workers accept until 1 s after the balancer forgets A (2.5 s), then
    drain (3.4 s on an idle machine), and under the suite's load graceful's master was once
    SIGKILLed at 6 s (not investigated; perhaps its workers planned from their own
    SIGTERM, which the master relays late on a loaded machine).  Stock's A may still be
    SIGKILLed (seen once at 6 s: its graceful timeout is the grace period, and the two
    race)."""
    pytest.importorskip("flask")
    servers = [f"gunicorn-{worker}", f"graceful-{worker}:accept-until-idle"]
    report = tmp_path / "demo.json"
    result = _demo(
        "--servers", ",".join(servers), "--propagation-delay", "1.5", "--grace-period", "10",
        "--warmup", "1",
        "--tail", "0.3", "--keepalive-clients", "2", "--fresh-clients", "2",
        "--long-requests", "1", "--long-request-s", "1", "--websockets", "1",
        "--json", str(report),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outcomes = {o["server"]: o for o in json.loads(report.read_text())["outcomes"]}
    assert list(outcomes) == servers
    for name in servers:
        outcome = outcomes[name]
        assert outcome["requests"] > MIN_REQUESTS, outcome
        if outcome["policy"] is None:
            assert outcome["a_ended"] in ("exited 0", "killed"), outcome
            assert outcome["failed"] > 0, outcome
        else:
            assert outcome["a_ended"] == "exited 0", outcome  # not SIGKILLed
            assert outcome["failed"] == 0, (outcome["results"], outcome)


def test_demo_rejects_unknown_server() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "graceful", "demo", "--servers", "nginx"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--servers: unknown ['nginx']" in result.stderr


def test_demo_backend_writes_its_phase_changes_to_the_events_pipe() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "graceful._demo._backend", "--port", str(port),
            "--policy", "refuse-immediately", "--grace-period", "5",
            "--events-fd", str(write_fd),
        ],
        cwd=ROOT, pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    os.close(write_fd)
    try:
        deadline = time.monotonic() + 20
        while True:  # listening: nothing to read from (uvicorn logs warnings only)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "the backend did not start"
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        with os.fdopen(read_fd, encoding="utf-8") as pipe:
            lines = pipe.read().splitlines()  # until end-of-file: the backend is gone
        assert proc.wait(15) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.communicate()
    events = [event for event in map(parse_event, lines) if event is not None]
    assert [e.phase for e in events] == [
        Phase.ACCEPTING,
        Phase.DRAINING,
        Phase.STOPPING,
        Phase.STOPPED,
    ], lines
    assert events[0].reason == "SIGTERM"
    assert {e.pid for e in events} == {proc.pid}
