"""``graceful demo --kubernetes``: the rollout table through the real control plane, and
one line saying how to build it where it is missing."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import ROOT


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "graceful", "demo", "--kubernetes", *args],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "160", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # its own CFS autogroup: see tests/demo/test_demo.py's _demo
    )


def test_demo_kubernetes_shows_stock_losses_and_graceful_none() -> None:
    # One client of each kind (the demo's default is two): at kube-proxy's 5 s sync,
    # stock still has dozens refused, and the run costs less CPU beside the other tests.
    result = demo("--sync-period", "5", "--keepalive-clients", "1", "--fresh-clients", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        line.split("│")[1].strip(): line
        for line in result.stdout.splitlines()
        if line.startswith("│") and line.split("│")[1].strip()
    }
    stock = rows["stock uvicorn"].split("│")
    assert int(stock[3].split()[0]) > 0, result.stdout  # refused while kube-proxy lagged
    graceful = rows["graceful run --kubernetes"].split("│")
    assert graceful[3].strip() == "0", result.stdout


def test_demo_kubernetes_without_the_binaries_says_how_to_build_them() -> None:
    result = demo(env={"KUBE_CACHE_DIR": "/nonexistent"})
    assert result.returncode == 2
    (line,) = result.stdout.splitlines()
    assert "not built" in line
    assert "bash tools/kube/build.sh" in line
