"""``graceful --version``: ours, the servers', Python's (below the command, which prints it
for ``graceful run --version``; ``graceful.__main__`` imports it from here)."""

from __future__ import annotations

__all__ = ("SERVER_DISTRIBUTIONS", "version_text")

SERVER_DISTRIBUTIONS = ("uvicorn", "hypercorn", "aiohttp", "granian", "gunicorn")


def version_text() -> str:
    """``graceful --version``, in uvicorn's style: ours, the servers', Python's."""
    import platform
    from importlib import metadata

    from .. import __version__

    parts = []
    for name in SERVER_DISTRIBUTIONS:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    parts.append(f"{platform.python_implementation()} {platform.python_version()}")
    return f"Running graceful-drain {__version__} with {', '.join(parts)} on {platform.system()}"
