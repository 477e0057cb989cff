"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import socket
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connect(port: int, timeout_s: float = 15.0) -> socket.socket:
    """Connect to a server that is starting, retrying until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on port {port} after {timeout_s} s") from None
            time.sleep(0.02)
