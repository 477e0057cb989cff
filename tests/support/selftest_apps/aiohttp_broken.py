"""The aiohttp test app (``tests/support/aiohttp_apps/app.py``) under an aiohttp whose
request handling changed in a way the hot path's finder does not expect — the contract
its self-test checks, broken on purpose.  ``SELFTEST_BREAK`` picks how (unset: nothing
is changed):

* ``await``: each connection awaits its request handler's coroutine through an awaitable
  of its own, so the request's task no longer shows the handler among the coroutines
  it awaits;
* ``clone``: the request handler gets a copy of the request, not the one the connection
  serves (and its task holds).

    python -m tests.support.selftest_apps.aiohttp_broken run_app --port 0
    gunicorn tests.support.selftest_apps.aiohttp_broken:app \\
        -k graceful.gunicorn.AiohttpWorker
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from tests.support.aiohttp_apps.app import app, main

__all__ = ("app",)

_Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class _Opaque:
    """An awaitable that is no coroutine: the coroutine it awaits is hidden behind the
    coroutine wrapper ``__await__`` returns."""

    __slots__ = ("awaitable",)

    def __init__(self, awaitable: Awaitable[web.StreamResponse]) -> None:
        self.awaitable = awaitable

    def __await__(self) -> Generator[Any, None, web.StreamResponse]:
        return self.awaitable.__await__()


def _opaque(handler: _Handler) -> _Handler:
    return lambda request: _Opaque(handler(request))


def _cloned(handler: _Handler) -> _Handler:
    return lambda request: handler(request.clone())


_BREAKS = {"await": _opaque, "clone": _cloned}
_init = RequestHandler.__init__


def _broken_init(self: RequestHandler, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    handler = self._request_handler
    if handler is not None:
        self._request_handler = _BREAKS[os.environ["SELFTEST_BREAK"]](handler)


if os.environ.get("SELFTEST_BREAK"):
    RequestHandler.__init__ = _broken_init  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
