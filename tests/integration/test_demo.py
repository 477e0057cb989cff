"""``graceful demo`` (the README's main job) as a real subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

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


def test_demo_rejects_unknown_server() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "graceful", "demo", "--servers", "nginx"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--servers: unknown ['nginx']" in result.stderr
