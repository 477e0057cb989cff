"""Running shutdown hooks: each one bounded, failures contained, never past a deadline.

A hook is user code, so it may hang, raise, or ignore cancellation.  Async hooks run on
the event loop under a cancel scope; synchronous ones in a worker thread that is
*abandoned* at the timeout (a thread cannot be cancelled), so a blocking hook costs at
most its timeout.  Each hook gets ``min(timeout_s, deadline - now)``; one that fails or
times out is logged with its name and the rest still run.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.to_thread

__all__ = ("Hook", "run_hooks")

logger = logging.getLogger("graceful")

Hook = Callable[[], Awaitable[object] | object]


def hook_name(hook: object) -> str:
    """A readable name for the log."""
    return str(getattr(hook, "__qualname__", None) or repr(hook))


async def run_hooks(
    hooks: Sequence[Hook],
    *,
    label: str,
    timeout_s: float | None,
    deadline: float | None,
    now: Callable[[], float],
) -> None:
    """Run ``hooks`` one after the other, each bounded by ``timeout_s`` and ``deadline``.

    Args:
        hooks: The hooks, in the order to run them.
        label: What they are, for the log (``"stopping hook"``, ``"stopping step"``).
        timeout_s: The longest one hook may run (``None``: only the deadline).
        deadline: No hook runs past this time on the ``now`` clock (``None``: none).
        now: The coordinator's clock.
    """
    for hook in hooks:
        limit = float("inf") if timeout_s is None else timeout_s
        if deadline is not None:
            limit = max(0.0, min(limit, deadline - now()))
        name = hook_name(hook)
        try:
            with anyio.move_on_after(limit) as scope:
                if inspect.iscoroutinefunction(hook):
                    await hook()
                else:
                    result = await anyio.to_thread.run_sync(hook, abandon_on_cancel=True)
                    if inspect.isawaitable(result):
                        await result
            if scope.cancelled_caught:
                logger.error("%s %s timed out after %.3g s, abandoned", label, name, limit)
        except Exception:
            logger.exception("%s %s failed", label, name)
