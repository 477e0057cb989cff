"""Developer sessions: ``nox -s tests lint typing docs demo bench``."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typing", "tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Run the test suite against the built wheel (not the source tree)."""
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", "dist", ".", silent=True)
    wheel = sorted(__import__("glob").glob("dist/graceful_drain-*.whl"))[-1]
    session.install("--force-reinstall", "--no-deps", wheel)
    session.install(f"graceful-drain[test] @ file://{__import__('os').path.abspath(wheel)}")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "examples", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "examples", "benchmarks")


@nox.session(python="3.11")
def typing(session: nox.Session) -> None:
    session.install("mypy", "-e", ".[uvicorn,gunicorn,demo]")
    session.run("mypy", "--strict", "src/graceful")


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    session.install("-e", ".[demo]")
    session.run("python", "-m", "graceful", "demo", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("python", "benchmarks/run.py", *session.posargs)
