"""``examples.asgi_app:app`` under a uvicorn whose zttp HTTP/2 protocol changed in a way
graceful's GOAWAY (``graceful.uvicorn._http2``) does not expect — what its start-up
check looks for, changed on purpose.  With ``ZTTP_CHANGE=cycles`` the protocol keeps
its streams in flight in a ``UserDict`` rather than a dict: zttp itself still works (it
only gets, sets, pops and iterates them); graceful's check says it is not the dict by
stream id it reads.  Unset: nothing is changed.

    ZTTP_CHANGE=cycles graceful run tests.uvicorn.zttp_changed:app --http zttp --http2
"""

from __future__ import annotations

import os
from collections import UserDict
from typing import Any

from uvicorn.protocols.http.zttp_h2_impl import ZttpH2Protocol

from examples.asgi_app import app

__all__ = ("app",)

_init = ZttpH2Protocol.__init__


def _cycles_in_a_user_dict(self: ZttpH2Protocol, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    self.cycles = UserDict()  # type: ignore[assignment]


if os.environ.get("ZTTP_CHANGE") == "cycles":
    ZttpH2Protocol.__init__ = _cycles_in_a_user_dict  # type: ignore[method-assign]
