"""graceful-drain: graceful shutdown for Python servers.

``import graceful`` needs only anyio; the server adapters are submodules
(``graceful.asgi``, ``graceful.uvicorn``, ``graceful.asyncio``, …) that import
their server when they are imported.
"""

from __future__ import annotations

from ._core.coordinator import GRACE_PERIOD_ENV as GRACE_PERIOD_ENV
from ._core.coordinator import Session as Session
from ._core.coordinator import ShutdownCoordinator as ShutdownCoordinator
from ._core.coordinator import ShutdownStatistics as ShutdownStatistics
from ._core.policy import AcceptUntilIdle as AcceptUntilIdle
from ._core.policy import Decision as Decision
from ._core.policy import Phase as Phase
from ._core.policy import Policy as Policy
from ._core.policy import PolicyInput as PolicyInput
from ._core.policy import RefuseImmediately as RefuseImmediately
from ._core.policy import ServeUntilKilled as ServeUntilKilled
from ._core.policy import policy_from_name as policy_from_name

__all__ = (
    "GRACE_PERIOD_ENV",
    "AcceptUntilIdle",
    "Decision",
    "Phase",
    "Policy",
    "PolicyInput",
    "RefuseImmediately",
    "ServeUntilKilled",
    "Session",
    "ShutdownCoordinator",
    "ShutdownStatistics",
    "policy_from_name",
)

__version__ = "0.1.0.dev0"
