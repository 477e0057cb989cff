"""Developer sessions: ``nox -s tests lint typing docs demo bench tests_floor kubernetes``."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import nox
import tomllib

nox.options.sessions = ["lint", "typing", "tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

#: Every Python the package supports (pyenv's are found too).
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
#: The tests that depend most on the server's version.
SERVER_TESTS = [
    "tests/gunicorn/test_gunicorn.py",
    "tests/uvicorn/test_uvicorn.py",
    "tests/uvicorn/test_uvicorn_hot_path.py",
    "tests/matrix/test_server_matrix.py",
    "tests/cli/test_cli.py",
]


def _find_pyenv_pythons() -> None:
    """Let nox find pyenv's Pythons that are installed but not active: nox resolves
    pyenv's shims (``python3.12``) through ``PYENV_VERSION``."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    if "PYENV_VERSION" in os.environ or not (root / "versions").is_dir():
        return
    newest: dict[str, tuple[int, ...]] = {}
    for path in (root / "versions").iterdir():
        if re.fullmatch(r"3\.\d+\.\d+", path.name):
            version = tuple(int(part) for part in path.name.split("."))
            minor = f"{version[0]}.{version[1]}"
            if minor in PYTHONS and version > newest.get(minor, ()):
                newest[minor] = version
    if newest:
        os.environ["PYENV_ROOT"] = str(root)
        os.environ["PYENV_VERSION"] = ":".join(".".join(map(str, v)) for v in newest.values())


_find_pyenv_pythons()


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """Run the test suite against the built wheel (not the source tree)."""
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", "dist", ".", silent=True)
    wheel = sorted(glob.glob("dist/graceful_drain-*.whl"))[-1]
    session.install("--force-reinstall", "--no-deps", wheel)
    session.install(f"graceful-drain @ file://{os.path.abspath(wheel)}", "--group", "test")
    session.run("python", "-m", "pytest", *session.posargs)


def floors() -> dict[str, str]:
    """The lowest uvicorn and gunicorn that pyproject's extras allow (they must agree)."""
    pyproject = tomllib.loads(Path("pyproject.toml").read_text())
    found: dict[str, set[str]] = {}
    for requirements in pyproject["project"]["optional-dependencies"].values():
        for requirement in requirements:
            match = re.match(r"(uvicorn|gunicorn)(?:\[[^\]]*\])?>=([\w.]+)", requirement)
            if match:
                found.setdefault(match[1], set()).add(match[2])
    for name, versions in found.items():
        if len(versions) != 1:
            raise ValueError(f"the extras disagree on the lowest {name}: {sorted(versions)}")
    return {name: versions.pop() for name, versions in found.items()}


@nox.session(python="3.11")
def kubernetes(session: nox.Session) -> None:
    """The tests against a real control plane (kube-apiserver, the endpointslice
    controller, kube-proxy) and the rollouts through it; root.  Builds Kubernetes once
    (tools/kube/build.sh, 9-13 min, cached); a missing control plane fails, never skips."""
    session.run("bash", "tools/kube/build.sh", external=True)
    session.install("-e", ".", "--group", "test")
    session.run(
        "python", "-m", "pytest", "tests/kubernetes", *session.posargs,
        env={"GRACEFUL_REQUIRE_KUBERNETES": "1"},
    )  # fmt: skip


@nox.session(python="3.11")
def tests_floor(session: nox.Session) -> None:
    """The server tests against the lowest uvicorn and gunicorn the extras declare."""
    session.install("-e", ".", "--group", "test")
    lowest = floors()
    session.install(f"uvicorn[standard]=={lowest['uvicorn']}", f"gunicorn=={lowest['gunicorn']}")
    session.run("python", "-m", "pytest", *(session.posargs or SERVER_TESTS))


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "examples", "benchmarks", "tools", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "examples", "benchmarks", "tools")


@nox.session(python="3.11")
def typing(session: nox.Session) -> None:
    session.install("mypy", "-e", ".[uvicorn,gunicorn,demo]")
    session.run("mypy", "--strict", "src/graceful")


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    session.install("-e", ".", "--group", "docs")
    session.run("python", "tools/gen_configuration.py", "--check")  # generated pages current
    session.run("zensical", "build", "--strict", "--clean", "-f", "mkdocs.yml")


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    session.install("-e", ".[demo]")
    session.run("python", "-m", "graceful", "demo", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    session.install("-e", ".", "--group", "test")
    session.run("python", "benchmarks/run.py", *session.posargs)


#: docs/img/NAME.svg <- ``graceful demo --servers SERVER`` (docs/policies.md shows them),
#: all on one time axis (PLOT_RANGE, seconds from SIGTERM) so that they compare.
PLOTS = {
    "uvicorn": "uvicorn",
    "accept-until-idle": "graceful:accept-until-idle",
    "serve-until-killed": "graceful:serve-until-killed",
    "refuse-immediately": "graceful:refuse-immediately",
}
PLOT_RANGE = "-1.5,3.5"


@nox.session(python="3.11")
def plots(session: nox.Session) -> None:
    """Regenerate docs/img/*.svg: a rolling restart's timeline per policy and stock uvicorn
    (the demo's defaults; extra arguments go to each ``graceful demo``)."""
    session.install("-e", ".[demo]")
    Path("docs/img").mkdir(exist_ok=True)
    for name, server in PLOTS.items():
        session.run(
            "python", "-m", "graceful", "demo", "--servers", server,
            "--plot", f"docs/img/{name}.svg", "--plot-range", PLOT_RANGE, *session.posargs,
        )  # fmt: skip
