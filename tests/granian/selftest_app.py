"""``examples.asgi_app:app`` under a granian whose application call changed in a way
the hot path's finder does not expect — the contract its self-test checks, broken on
purpose.  With ``SELFTEST_BREAK=watcher`` the coroutine granian runs each request in
is no longer ``granian._futures``' ``future_watcher`` holding the request's
``watcher``; unset, nothing is changed.

    graceful run --server granian tests.granian.selftest_app:app
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine
from typing import Any

import granian.server.embed

from examples.asgi_app import app

__all__ = ("app",)


def _future_watcher_wrapper(inner: Any) -> Callable[[Any], Coroutine[Any, Any, None]]:
    async def future_watcher(watcher: Any) -> None:
        scope, proto, done, err = watcher.scope, watcher.proto, watcher.done, watcher.err
        del watcher  # the change: the task's coroutine holds the scope, not the watcher
        try:
            await inner(scope, proto)
        except BaseException as exc:
            err(exc)
            return
        done()

    return future_watcher


if os.environ.get("SELFTEST_BREAK") == "watcher":
    granian.server.embed._future_watcher_wrapper = _future_watcher_wrapper  # type: ignore[attr-defined]
