"""Small apps for ``benchmarks/gunicorn_edges.py``: WSGI, ASGI and aiohttp, same routes.

Routes: ``/`` (fast), ``/sleep?s=X`` (sleep, then 200), ``/readyz`` (200: the stock
workers' readiness; graceful's workers answer it before the app), ``/info`` (``graceful``
if graceful's WSGI middleware wraps the app, else ``stock``), ``/stubborn?s=X`` (ASGI and
aiohttp: sleeps X s and ignores cancellation).
"""
