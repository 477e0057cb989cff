"""``DrainSignal``: what a handler may know about the shutdown, for the ASGI and the
aiohttp adapters alike (``graceful.asgi.drain_signal(scope)``,
``graceful.aiohttp.drain_signal(request)``); public as ``graceful.asgi.DrainSignal``
and ``graceful.aiohttp.DrainSignal``.  WSGI's is a thread-safe twin
(``graceful.wsgi.DrainSignal``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from typing_extensions import final

from .coordinator import ShutdownCoordinator, _check_coordinator
from .policy import Phase

__all__ = ("DrainSignal", "in_scope")


@final
class DrainSignal:
    """What a handler may know about the shutdown (one shared object per middleware).

    Found with ``drain_signal(scope)``.  A streaming handler typically does::

        signal = graceful.asgi.drain_signal(scope)
        while not signal.draining:
            ...send the next event...
        ...send a final event and end the stream...
    """

    __slots__ = ("coordinator",)

    def __init__(self, coordinator: ShutdownCoordinator) -> None:
        self.coordinator: Final = _check_coordinator(coordinator)

    @property
    def draining(self) -> bool:
        """``True`` once draining began: finish the current message and end."""
        return self.coordinator.draining

    @property
    def shutdown_requested(self) -> bool:
        """``True`` once shutdown was requested (still accepting, perhaps)."""
        return self.coordinator.shutdown_requested

    async def wait(self, *, timeout_s: float | None = None) -> bool:
        """Wait until draining begins; ``False`` if ``timeout_s`` elapsed first."""
        return await self.coordinator.wait_for_phase(Phase.DRAINING, timeout_s=timeout_s)

    def time_left_s(self) -> float | None:
        """Seconds until the drain deadline (``None`` before draining or without one)."""
        return self.coordinator.drain_time_left()


def in_scope(scope: Mapping[str, Any]) -> DrainSignal | None:
    """Return the ``DrainSignal`` of the request, or ``None`` outside the middleware
    (public as ``graceful.asgi.drain_signal``).

    It is looked up in ``scope["state"]["graceful"]`` (the lifespan state the server
    copies into every request) and in ``scope["extensions"]["graceful"]`` (where the
    middleware puts it too; deprecated for direct reading)."""
    if not isinstance(scope, Mapping):
        raise TypeError(f"scope must be an ASGI scope (a mapping), got {scope!r}")
    for where in ("state", "extensions"):
        signal = (scope.get(where) or {}).get("graceful")
        if isinstance(signal, DrainSignal):
            return signal
    return None
