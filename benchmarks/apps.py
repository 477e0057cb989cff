"""Hello-world ASGI apps for the benchmarks: the demo's bare app, and the same wrapped."""

from __future__ import annotations

from graceful import ShutdownCoordinator
from graceful._demo.app import app as bare
from graceful.asgi import GracefulMiddleware

__all__ = ("bare", "wrapped")

wrapped = GracefulMiddleware(bare, coordinator=ShutdownCoordinator())
