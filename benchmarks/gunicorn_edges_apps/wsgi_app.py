"""A plain WSGI app (see the package's docstring for the routes)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs


def _seconds(environ: dict[str, Any]) -> float:
    query = parse_qs(environ.get("QUERY_STRING", ""))
    return float(query.get("s", ["1"])[0])


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "/")
    status = "200 OK"
    if path in ("/sleep", "/stubborn"):
        seconds = _seconds(environ)
        time.sleep(seconds)
        body = f"slept {seconds:g}\n".encode()
    elif path == "/readyz":
        body = b"app ready\n"
    elif path == "/info":
        body = b"graceful\n" if "graceful.drain" in environ else b"stock\n"
    elif path == "/":
        body = b"ok\n"
    else:
        status, body = "404 Not Found", b"not found\n"
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
