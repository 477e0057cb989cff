"""Fixtures of the fault suite and its report, ``tests/faults/.results.json``.

Each test calls ``record("what the clients saw")`` (several calls are joined with
``; ``).  After each test the case name, that summary and the outcome (``pass``,
``xfail`` with its reason, ``fail``, ``skip``) are merged into ``.results.json`` by node
id; ``python tests/faults/render.py`` turns the file into ``docs/reliability.md``.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import Harness, close_all_clients

RESULTS = Path(__file__).with_name(".results.json")
_KEY = pytest.StashKey[list[str]]()
_results: dict[str, dict[str, Any]] = {}
_collected: dict[str, int] = {}  # node id -> position in its module, before deselection


def pytest_itemcollected(item: pytest.Item) -> None:
    module = item.nodeid.split("::")[0]
    position = sum(1 for k in _collected if k.split("::")[0] == module)
    _collected.setdefault(item.nodeid, position)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        close_all_clients()
        h.stop_all()


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``record(text)``: what the clients (or the operator) saw, for the report."""
    notes = request.node.stash.setdefault(_KEY, [])
    return notes.append


def _case(item: pytest.Item) -> tuple[str, str, str]:
    """(section, about, case): the module docstring's first line and first paragraph
    after it, and the test's docstring's first line (its parameters appended)."""
    module = getattr(item, "module", None)
    paragraphs = (module.__doc__ or item.path.stem).strip().split("\n\n")
    section = paragraphs[0].splitlines()[0].rstrip(".")
    about = " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else ""
    function = getattr(item, "function", None)
    doc = " ".join((function.__doc__ or item.name).split()) if function else item.name
    doc = doc.rstrip(".")
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.id:
        doc = f"{doc} [{callspec.id}]"
    return section, about, doc


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        if hasattr(report, "wasxfail"):
            result = "xfail" if report.outcome == "skipped" else "xpass"
        else:
            result = {"passed": "pass", "failed": "fail", "skipped": "skip"}[report.outcome]
        xfail = item.get_closest_marker("xfail")
        evidence = ""
        if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
            message = str(call.excinfo.value).strip().splitlines()
            evidence = f"{call.excinfo.typename}: {message[0] if message else ''}"[:300]
        section, about, case = _case(item)
        _results[item.nodeid] = {
            "section": section,
            "about": about,
            "case": case,
            "module": item.path.stem,
            "index": _collected.get(item.nodeid, len(_collected)),
            "saw": "; ".join(item.stash.get(_KEY, [])),
            "outcome": result,
            "reason": xfail.kwargs.get("reason", "") if xfail is not None else "",
            "evidence": evidence,
            "duration_s": round(report.duration, 2),
            "python": ".".join(map(str, sys.version_info[:3])),
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        }


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _results:
        return
    # Other runs (another checkout's pytest, CI jobs) may merge at the same time.
    fd = os.open(RESULTS.parent, os.O_RDONLY)  # a lock on the directory: no lock file
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _merge()
    finally:
        os.close(fd)


def _merge() -> None:
    existing: dict[str, Any] = {}
    if RESULTS.exists():
        try:
            existing = json.loads(RESULTS.read_text())
        except ValueError:
            existing = {}
    # Tests that no longer exist (renamed, removed) leave the report; tests that were
    # collected but not run this time (-k, a single module) keep their last result.
    modules = {nodeid.split("::")[0] for nodeid in _collected}
    merged = {
        k: v for k, v in existing.items() if k in _collected or k.split("::")[0] not in modules
    }
    merged.update(_results)
    merged = dict(sorted(merged.items(), key=lambda kv: (kv[0].split("::")[0], kv[1]["index"])))
    tmp = RESULTS.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=False) + "\n")
    tmp.replace(RESULTS)
