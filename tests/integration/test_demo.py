"""``graceful demo`` (the README's main job) as a real subprocess."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from graceful import Phase
from graceful._events import parse_event

from .servers import ROOT


def test_demo_shows_zero_failures_for_accept_until_idle(tmp_path: Path) -> None:
    plot = tmp_path / "timeline.svg"
    result = subprocess.run(
        [
            sys.executable, "-m", "graceful", "demo",
            "--servers", "uvicorn,graceful:accept-until-idle",
            "--keepalive-clients", "2", "--fresh-clients", "2", "--long-requests", "1",
            "--plot", str(plot),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {
        match.group(1): (int(match.group(2)), int(match.group(3)))
        for match in re.finditer(r"│ (\S+)\s+│\s+(\d+) │\s+(\d+) │", result.stdout)
    }
    assert set(rows) == {"uvicorn", "graceful:accept-until-idle"}, result.stdout
    requests, failed = rows["graceful:accept-until-idle"]
    assert requests > 100
    assert failed == 0, result.stdout
    assert rows["uvicorn"][1] > 0, result.stdout  # stock uvicorn refuses during propagation
    assert "exited 0 at" in result.stdout
    svg = ET.parse(plot).getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    text = plot.read_text()
    assert "graceful:accept-until-idle" in text
    assert "SIGTERM" in text
    assert "draining" in text  # A's phase marks: its events reached the demo


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
