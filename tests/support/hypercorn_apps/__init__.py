"""Helpers for ``test_hypercorn.py``: a launcher, a frame-level HTTP/2 client, a rolling restart;
and the ASGI app of ``test_server_matrix.py``'s uvicorn and hypercorn rows."""
