"""``examples.asgi_app:app`` under a hypercorn whose application call changed in a way
the hot path's finder does not expect — the contract its self-test checks, broken on
purpose.  With ``SELFTEST_BREAK=config`` hypercorn's ``_handle`` (asyncio's and trio's)
no longer holds the worker's ``Config`` while the application runs; unset, nothing is
changed.

    python tests/support/hypercorn_apps/launch.py \\
        --app tests.support.selftest_apps.hypercorn_broken:app
"""

from __future__ import annotations

import os
from typing import Any

import hypercorn.asyncio.task_group
import hypercorn.trio.task_group

from examples.asgi_app import app

__all__ = ("app",)


async def _handle(app: Any, config: Any, scope: Any, receive: Any, send: Any, *spawn: Any) -> None:
    log = config.log
    del config  # the change: the call's frame holds the scope, not the Config
    try:
        await app(scope, receive, send, *spawn)
    except Exception:
        await log.exception("Error in ASGI Framework")
    finally:
        await send(None)


if os.environ.get("SELFTEST_BREAK") == "config":
    hypercorn.asyncio.task_group._handle = _handle  # type: ignore[assignment]
    hypercorn.trio.task_group._handle = _handle  # type: ignore[assignment]
