"""A task an app leaves running at the end, for the teardown-window tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def linger(say: Callable[[str], None]) -> None:
    """Wait until cancelled, then take a second to go: cancelled in the server's
    teardown, after the coordinator stopped, it opens a window for a late signal."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        say("lingering task cancelled")
        await asyncio.sleep(1.0)  # the behaviour under test: a slow end
        raise
