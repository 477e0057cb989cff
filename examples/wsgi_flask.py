"""A Flask app whose event stream ends cleanly when the worker starts draining.

    gunicorn -k graceful.gunicorn.ThreadWorker --threads 8 examples.wsgi_flask:app

``/events`` sends ``data: <n>`` every ``interval`` seconds (default 0.5).  Once draining
begins the stream sends a last ``event: bye`` and ends: the client sees a complete
response and reconnects elsewhere, instead of a connection cut at the deadline.  (A
``sync`` worker has one thread: it cannot decide to drain while it streams, so use
``ThreadWorker`` for streams.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from flask import Flask, Response, request

from graceful.wsgi import drain_signal

app = Flask(__name__)


# --8<-- [start:events]
@app.get("/events")
def events() -> Response:
    interval_s = float(request.args.get("interval", "0.5"))
    signal = drain_signal(request.environ)  # None without graceful's worker or middleware

    def stream() -> Iterator[str]:
        n = 0
        while signal is None or not signal.draining:
            yield f"data: {n}\n\n"
            n += 1
            if signal is None:
                time.sleep(interval_s)
            else:
                signal.wait(timeout_s=interval_s)  # wakes at once when draining begins
        yield "event: bye\ndata: draining\n\n"

    return Response(stream(), mimetype="text/event-stream")


# --8<-- [end:events]


@app.get("/")
def index() -> str:
    return "hello\n"
