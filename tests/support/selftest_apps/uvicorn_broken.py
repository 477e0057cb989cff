"""``examples.asgi_app:app`` under a uvicorn whose request handling changed in a way the
hot path's finder does not expect — the contract its self-test checks, broken on
purpose.  ``SELFTEST_BREAK`` picks how (unset: nothing is changed):

* ``task``: the app runs in a task of its own that uvicorn's ``server_state.tasks``
  does not hold (the task uvicorn tracks ends at once);
* ``scope``: the app gets a copy of the request's scope, not the one its connection's
  request cycle holds.

    graceful run tests.support.selftest_apps.uvicorn_broken:app --http httptools
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from examples.asgi_app import app

__all__ = ("app",)

_run_asgi = RequestResponseCycle.run_asgi
_detached: set[asyncio.Task[None]] = set()


async def _in_own_task(self: RequestResponseCycle, app: Any) -> None:
    task = asyncio.ensure_future(_run_asgi(self, app))
    _detached.add(task)
    task.add_done_callback(_detached.discard)


async def _scope_copied(self: RequestResponseCycle, app: Any) -> None:
    await _run_asgi(self, lambda scope, receive, send: app(dict(scope), receive, send))


_BREAKS = {"task": _in_own_task, "scope": _scope_copied}

if os.environ.get("SELFTEST_BREAK"):
    RequestResponseCycle.run_asgi = _BREAKS[os.environ["SELFTEST_BREAK"]]  # type: ignore[method-assign]
