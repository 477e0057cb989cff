"""The demo's WSGI backend for the gunicorn ``sync``/``gthread`` rows: a Flask app with
the ASGI demo app's endpoints (``/`` answers ``hello``, ``/slow?s=2`` after 2 seconds,
``x-backend`` from ``GRACEFUL_DEMO_NAME``), so that their rows compare like with like."""

from __future__ import annotations

import os
import time

from flask import Flask, Response, request

NAME = os.environ.get("GRACEFUL_DEMO_NAME", "backend")

app = Flask(__name__)


@app.get("/")
def hello() -> Response:
    return Response(b"hello\n", mimetype="text/plain", headers={"x-backend": NAME})


@app.get("/slow")
def slow() -> Response:
    time.sleep(min(float(request.args.get("s", "1")), 60.0))
    return Response(b"slow\n", mimetype="text/plain", headers={"x-backend": NAME})
