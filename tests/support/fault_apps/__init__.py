"""ASGI apps for the fault suite, started by ``graceful run`` / gunicorn as subprocesses.

Every app writes one line per event (``started <id>``, ``handled <id>``, ``lifespan …``)
with a single ``os.write`` to stderr — which the harness reads — and, if the
``FAULTS_LOG`` environment variable names a file, appended to that file too.  Single
writes of a short line are atomic on a pipe and on an ``O_APPEND`` file, so lines of
several worker processes never interleave, and a line written before a hard exit is
never lost in a buffer.
"""

from __future__ import annotations

import os

LOG_ENV = "FAULTS_LOG"

_log_fd: int | None = None
if os.environ.get(LOG_ENV):
    _log_fd = os.open(os.environ[LOG_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def log(line: str) -> None:
    """Write ``line`` (one event) to stderr and to ``$FAULTS_LOG``, unbuffered."""
    data = (line.rstrip("\n") + "\n").encode()
    if _log_fd is not None:
        os.write(_log_fd, data)
    os.write(2, data)
