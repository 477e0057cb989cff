"""The WSGI fault app, imported slowly: ``importing app``, 1.5 s, then the app."""

from __future__ import annotations

import time

from . import log

log("importing app")
time.sleep(1.5)  # the behaviour under test: a slow import (a signal arrives meanwhile)

from .wsgi import app  # noqa: E402

__all__ = ("app",)
