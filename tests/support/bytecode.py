"""Compiled modules for a run under ``PYTHONDONTWRITEBYTECODE=1``, kept outside the tree.

With that setting (common in containers, and set on this project's CI machine) no
process caches what it compiles: each of the dozen pytest workers parses and rewrites
every test module's assertions again (2.2 of its 3.9 s of collection), and each server
interpreter the tests start compiles graceful and the test apps again (0.1 CPU-s).  The
setting is there to keep ``__pycache__`` out of the source tree, so the run honours it
there and caches in a directory of its own instead, ``$TMPDIR/graceful-tests-pycache-UID``:
pytest's process sets ``PYTHONPYCACHEPREFIX`` to it and lifts ``PYTHONDONTWRITEBYTECODE``
for itself and every process it starts (each then reads and writes its pycs there, and
nowhere else), and before the workers start it compiles graceful, the examples and the
tests' helper modules (``compileall``) and rewrites the test modules (pytest's own
rewriting, into the pyc pytest reads back), so that a dozen workers do not each do it at
once.  Without the setting, or with a ``PYTHONPYCACHEPREFIX`` of the user's, nothing
changes.
"""

from __future__ import annotations

import compileall
import hashlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What processes import from the tree without pytest's rewriting.
PLAIN = ("src", "examples", "tests")
#: Modules pytest imports through its assertion rewriting instead.
REWRITTEN = re.compile(r"(test_.*|conftest)\.py")


def cache(config: pytest.Config) -> Path | None:
    """Compile into the cache and point every later process at it; the cache's path, or
    ``None`` where nothing was done."""
    if not sys.dont_write_bytecode or os.environ.get("PYTHONPYCACHEPREFIX"):
        return None
    prefix = Path(tempfile.gettempdir()) / f"graceful-tests-pycache-{os.getuid()}"
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    _seed(prefix)
    skip = re.compile(r".*/(test_[^/]*|conftest)\.py$")
    for folder in PLAIN:
        compileall.compile_dir(ROOT / folder, quiet=2, rx=skip)
    _rewrite_tests(config)
    return prefix


#: Folders no test imports from (the standard library's own tests, its GUI).
_UNUSED = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip"})


def _seed(prefix: Path) -> None:
    """Once per cache: link the standard library's and the installed packages' pycs into
    it (a process with a cache prefix looks for every pyc there, never in ``__pycache__``:
    unseeded, a dozen workers would each compile pytest and its plugins at start)."""
    tag = sys.implementation.cache_tag
    folders = [
        p for p in sys.path if p and os.path.isdir(p) and not p.startswith(str(ROOT / "src"))
    ]
    marker = prefix / f".seeded-{tag}-{hashlib.sha1(repr(folders).encode()).hexdigest()[:12]}"
    if marker.exists():
        return
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d not in _UNUSED]
            if os.path.basename(root) != "__pycache__":
                continue
            target = prefix / os.path.dirname(root).lstrip(os.sep)
            for name in files:
                if not name.endswith(f".{tag}.pyc") or (target / name).exists():
                    continue
                target.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(os.path.join(root, name), target / name)
                except OSError:
                    shutil.copyfile(os.path.join(root, name), target / name)
    marker.touch()


def _rewrite_tests(config: pytest.Config) -> None:
    """What pytest's import hook would do for each test module and conftest, once: the
    rewritten code, in the pyc it looks for (pytest's private functions: if they change,
    the workers rewrite for themselves, as before)."""
    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc,
            assertstate_key,
            get_cache_dir,
        )

        state = config.stash[assertstate_key]
    except (ImportError, KeyError):
        return
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if not REWRITTEN.fullmatch(path.name):
            continue
        pyc = get_cache_dir(path) / (path.name[:-3] + PYC_TAIL)
        try:
            if _read_pyc(path, pyc) is not None:
                continue
            pyc.parent.mkdir(parents=True, exist_ok=True)
            source_hash, code = _rewrite_test(path, config)
            _write_pyc(state, code, source_hash, pyc)
        except Exception:  # private functions that changed: the workers rewrite instead
            return
