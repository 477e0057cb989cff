"""The checks of the coordinator's arguments, and of the callables adapters hand in.

Every argument of the public API is checked where it is given — in the constructor, in
``add_hook``, ``subscribe``, ``expect_relayed_signals``, … — not where it is first used:
a misconfiguration found at shutdown is found at the worst moment, by the component that
cannot say which argument was wrong.  So each check raises a ``TypeError`` or a
``ValueError`` that names the argument and shows what it got.  The seconds themselves are
checked by ``graceful._core.policy``, which the policies share.

The hardest lines:

* ``_check_kill_margin``: stopping begins at the latest two margins before SIGKILL
  (``stop_by = kill - 2 * kill_margin_s``, ``graceful._core.deadlines``): two margins
  must fit in the grace period, or stopping would be due before shutdown was requested.
* ``_grace_period``: ``GRACEFUL_GRACE_PERIOD`` is read here, once, at construction, and
  a value that is not a number fails then, naming the variable — not at SIGTERM.
* ``_check_signals``: ``True`` is the integer 1 (``SIGHUP``): a bool is not a signal.
"""

from __future__ import annotations

import os
import signal
from typing import Final, TypeVar

from .policy import AcceptUntilIdle, Phase, Policy, _check_optional_seconds, _check_seconds

__all__ = ("GRACE_PERIOD_ENV",)

#: Environment variable holding the grace period (seconds before SIGKILL).
GRACE_PERIOD_ENV: Final = "GRACEFUL_GRACE_PERIOD"

_C = TypeVar("_C")


def _check_callable(name: str, value: _C) -> _C:
    """``value`` if it is callable, else a ``TypeError`` naming ``name``."""
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {value!r}")
    return value


def _check_policy(policy: object) -> Policy:
    """``policy``, ``AcceptUntilIdle()`` for ``None``; else a ``TypeError``."""
    if policy is None:
        return AcceptUntilIdle()
    if not isinstance(policy, Policy):
        raise TypeError(
            "policy must be a graceful Policy instance (graceful.AcceptUntilIdle(), "
            "graceful.ServeUntilKilled(), graceful.RefuseImmediately() or "
            "graceful.policy_from_name(...)) or None, got "
            f"{type(policy).__name__} {policy!r}"
        )
    return policy


def _check_kill_margin(kill_margin_s: float, grace_period_s: float | None) -> float:
    """``kill_margin_s``, checked: seconds, less than half the grace period (the process
    is out the margin before SIGKILL, and stopping begins the margin before that)."""
    margin = _check_seconds("kill_margin_s", kill_margin_s)
    if grace_period_s is not None and 2 * margin >= grace_period_s:
        raise ValueError(
            f"kill_margin_s ({margin:g}) must be less than half grace_period_s "
            f"({grace_period_s:g}): the process is out the margin before SIGKILL, and "
            "stopping begins the margin before that"
        )
    return margin


def _grace_period(grace_period_s: float | None) -> float | None:
    """The grace period given, else ``GRACEFUL_GRACE_PERIOD``'s, else ``None``; checked."""
    if grace_period_s is not None:
        return _check_optional_seconds("grace_period_s", grace_period_s)
    env = os.environ.get(GRACE_PERIOD_ENV, "").strip()
    if not env:
        return None
    try:
        value = float(env)
    except ValueError:
        raise ValueError(
            f"{GRACE_PERIOD_ENV} must be a finite number of seconds > 0, got {env!r}"
        ) from None
    return _check_seconds(GRACE_PERIOD_ENV, value)


def _check_signals(name: str, signums: object) -> tuple[int, ...]:
    """``signums`` as a tuple of signal numbers, else an error naming ``name``."""
    if not isinstance(signums, (tuple, list, set, frozenset)):
        raise TypeError(
            f"{name} must be a tuple of signal numbers (signal.SIGQUIT, …), got "
            f"{type(signums).__name__} {signums!r}"
        )
    valid = set(signal.valid_signals())
    for signum in signums:
        if isinstance(signum, bool) or signum not in valid:
            raise ValueError(f"{name}: {signum!r} is not a signal number (signal.SIGTERM, …)")
    return tuple(signums)


def _check_phase(phase: object) -> Phase:
    """``phase`` if it is a ``Phase``, else a ``TypeError`` listing the phases."""
    if not isinstance(phase, Phase):
        allowed = ", ".join(f"Phase.{p.name}" for p in Phase)
        raise TypeError(f"phase must be one of {allowed}, got {type(phase).__name__} {phase!r}")
    return phase
