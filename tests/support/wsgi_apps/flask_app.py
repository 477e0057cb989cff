"""A Flask app for the WSGI worker tests: ``/`` answers at once, ``/slow?s=N`` after N
seconds, ``/draining`` reports the drain signal (``graceful.wsgi.drain_signal``)."""

from __future__ import annotations

import time

from flask import Flask, request

from graceful.wsgi import drain_signal

app = Flask(__name__)


@app.get("/")
def index() -> str:
    return f"hello from {request.args.get('id', '-')}\n"


@app.get("/slow")
def slow() -> str:
    seconds = float(request.args.get("s", "1"))
    print(f"slow request started {request.args.get('id', '-')}", flush=True)
    time.sleep(seconds)  # the behaviour under test: a request that takes this long
    return f"slow done after {seconds:g} s\n"


@app.get("/draining")
def draining() -> str:
    signal = drain_signal(request.environ)
    return f"draining={None if signal is None else signal.draining}\n"
