"""graceful's log lines in the format of the server they run in.

graceful logs to the ``graceful`` logger (and its children, ``graceful.kubernetes``).
An application that configured logging — a handler on ``graceful`` or on the root
logger — decides where those lines go, and nothing here touches it.  Otherwise:

* under uvicorn (``graceful run``, ``graceful.uvicorn``) the lines go through
  uvicorn's own handler, so they read like uvicorn's (``INFO:     serving -> …``, colours
  on a terminal, a ``--log-config`` honoured) at the ``--log-level`` given;
* under hypercorn and aiohttp they get hypercorn's format
  (``[date] [pid] [INFO] message``), aiohttp having none of its own.

A coordinator the application runs itself (``coordinator.run()`` in the app's lifespan
under plain ``uvicorn app:app``) writes through the server's handlers too, if the
server configured its logging (``through_server``), so its phase lines are in the
server's log as they are under ``graceful run``.

The root logger is never configured: ``--log-level debug`` turns on graceful's debug
lines, not every library's.
"""

from __future__ import annotations

import logging
import sys
from typing import Final

__all__ = (
    "LOGGER",
    "PID_PREFIX",
    "SERVER_FORMAT",
    "SERVER_LOGGERS",
    "configured",
    "level_of",
    "through",
    "through_server",
    "to_gunicorn",
    "to_stderr",
)

LOGGER: Final = logging.getLogger("graceful")

#: hypercorn's format (``hypercorn.logging``), also used for aiohttp.
SERVER_FORMAT: Final = (
    "%(asctime)s [%(process)d] [%(levelname)s] %(message)s",
    "[%Y-%m-%d %H:%M:%S %z]",
)
#: uvicorn's line prefix with the process id, for the workers of ``graceful run --workers``.
PID_PREFIX: Final = "%(levelprefix)s [%(process)d] "


def configured() -> bool:
    """Whether the application configured where graceful's lines go."""
    return bool(LOGGER.handlers) or bool(logging.getLogger().handlers)


def level_of(name: str) -> int:
    """A ``--log-level`` name as a logging level (uvicorn's ``trace`` is below debug)."""
    level = {"trace": 5}.get(name, logging.getLevelName(name.upper()))
    return level if isinstance(level, int) else logging.INFO


class _Through(logging.Handler):
    """Hands each record to the handlers the server's logger has *now*: they follow a
    server that configures its logging again (uvicorn does, per ``Config``)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.target = logging.getLogger(name)
        self.fallback = _stderr_handler()

    def emit(self, record: logging.LogRecord) -> None:
        handlers = self.target.handlers or [self.fallback]
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def through(server_logger: str, level: int | None = None) -> bool:
    """Unless the application configured logging, write graceful's lines with the
    handlers of ``server_logger`` (``"uvicorn"``: its format, colours and
    ``--log-config``), at ``level`` (default: that of ``<server_logger>.error``).

    Returns:
        Whether graceful's lines now go through the server's handlers.
    """
    if configured():
        return False
    if level is None:
        level = logging.getLogger(f"{server_logger}.error").getEffectiveLevel()
    _install(_Through(server_logger), level)
    return True


#: The loggers servers configure for their own lines before the app's lifespan starts
#: (uvicorn's ``dictConfig``), in the order ``through_server`` looks at them.
SERVER_LOGGERS: Final = ("uvicorn",)


def through_server() -> bool:
    """For a coordinator the application runs itself: unless the application
    configured logging, write graceful's lines with the handlers of the first of
    ``SERVER_LOGGERS`` that has any (the server that runs this process configured it),
    at that server's level.

    Returns:
        Whether graceful's lines now go through a server's handlers.
    """
    if configured():
        return False
    for name in SERVER_LOGGERS:
        if logging.getLogger(name).handlers:
            return through(name)
    return False


def _stderr_handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(*SERVER_FORMAT))
    return handler


def _install(handler: logging.Handler, level: int) -> None:
    LOGGER.addHandler(handler)
    LOGGER.setLevel(level)
    LOGGER.propagate = False


def to_gunicorn(worker_log: logging.Logger) -> None:
    """In a gunicorn worker: graceful's lines go where gunicorn's error log goes, in its
    format, at INFO (``worker_log``: the worker's ``self.log.error_log``)."""
    LOGGER.handlers = worker_log.handlers
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def to_stderr(level: int = logging.INFO) -> bool:
    """Unless the application configured logging, write graceful's lines to standard
    error in hypercorn's format, at ``level``.

    Returns:
        Whether a handler was added.
    """
    if configured():
        return False
    _install(_stderr_handler(), level)
    return True
