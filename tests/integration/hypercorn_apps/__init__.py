"""Helpers for ``test_hypercorn.py``: a launcher, a frame-level HTTP/2 client, a rolling restart."""
