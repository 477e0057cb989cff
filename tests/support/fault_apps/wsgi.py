"""A WSGI app (the fault suite's ``basic`` for gunicorn's sync and gthread workers).

``handled <id>`` is written when the server closes the response iterable, that is after
it wrote the last byte, so a test can compare what the app answered with what every
client received.  Routes (every response body is ``ok <id>``):

``/``              answers at once
``/slow?s=1``      answers after ``s`` seconds (``time.sleep``: the GIL is released)
``/gil?s=5``       holds the GIL for ``s`` seconds in one C call (a regular expression
                   that backtracks), as a C extension that never releases it would
``/header?kb=64``  answers with an ``X-Pad`` header of ``kb`` KiB: a slow reader keeps
                   gunicorn writing the head (``headers_sent`` still false) for long
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs

from . import log


class _Body:
    """The response body; ``handled`` is logged when the server closes it."""

    def __init__(self, body: bytes, rid: str) -> None:
        self.body, self.rid = body, rid

    def __iter__(self) -> Iterator[bytes]:
        yield self.body

    def close(self) -> None:
        log(f"handled {self.rid}")


def _backtrack(seconds: float) -> None:
    """One C call that holds the GIL for about ``seconds`` (catastrophic backtracking:
    each extra character doubles the time)."""
    text = "a" * 18
    began = time.monotonic()
    re.match(r"(a+)+$", text + "b")
    once = max(time.monotonic() - began, 1e-4)
    extra = max(0, int.bit_length(int(seconds / once)))
    re.match(r"(a+)+$", "a" * (18 + extra) + "b")


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    query = {k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
    rid = query.get("id", "-")
    path = environ.get("PATH_INFO", "/")
    if path != "/":
        log(f"started {rid} {path}")
    if path == "/slow":
        time.sleep(float(query.get("s", "1")))
    elif path == "/gil":
        _backtrack(float(query.get("s", "5")))
    body = f"ok {rid}\n".encode()
    headers = [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))]
    if path == "/header":
        headers.append(("X-Pad", "x" * (int(query.get("kb", "64")) * 1024)))
    start_response("200 OK", headers)
    return _Body(body, rid)
