"""A plain WSGI app answering as the server matrix's ASGI app does
(``tests.support.hypercorn_apps.asgi_app``, ``examples.asgi_app``), for its gunicorn
WSGI row: ``/`` answers ``hello``, ``/slow?s=N`` prints ``slow request started (N s)``
and answers ``slept N`` after N seconds, ``/held`` prints ``slow request started (held)``
and answers ``released`` once its body has come; anything else is 404.  WSGI
has no lifespan and no websockets: the row says so (``tests/matrix/test_server_matrix.py``).

    gunicorn -k graceful.gunicorn.ThreadWorker --threads 4 \\
        --http-protocols h2,h1 --http2-cleartext both tests.support.wsgi_apps.matrix_app:app
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

__all__ = ("app",)

_TEXT = ("Content-Type", "text/plain; charset=utf-8")


def say(line: str) -> None:
    """One write per line, so that lines of several threads don't interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "/")
    if path == "/":
        body = b"hello\n"
    elif path == "/slow":
        query = parse_qs(environ.get("QUERY_STRING", ""))
        seconds = float(query.get("s", ["1"])[0])
        say(f"slow request started ({seconds:g} s)")  # tests wait for this line
        time.sleep(seconds)  # the behaviour under test: a request that takes this long
        body = f"slept {seconds:g}\n".encode()
    elif path == "/held":
        say("slow request started (held)")
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))  # the test's
        body = b"released\n"
    else:
        start_response("404 Not Found", [_TEXT, ("Content-Length", "10")])
        return [b"not found\n"]
    start_response("200 OK", [_TEXT, ("Content-Length", str(len(body)))])
    return [body]
