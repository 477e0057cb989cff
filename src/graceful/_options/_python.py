"""The Python API's options: graceful's settings as keyword arguments of the run functions.

The servers' run functions (``graceful.uvicorn.run``, ``graceful.hypercorn.run``,
``graceful.aiohttp.run_app``) take graceful's options as keyword arguments, by their
Python names (``Option.python``: ``grace_period_s`` for ``--grace-period``), and check
them with the command line's parsers and ``check``.  The server's own settings (host,
port, log level, …) keep the server's names and go to the server.

A Python value is not text, so ``_python_value`` first checks its type (``True`` is not a
number of seconds, ``"2"`` is not one either) and then hands the parser the value's
``repr``: the parser's own range check and reason apply, with the message's trailing
"got '…'" replaced by the value and its type.  ``python_setup`` then goes through
``resolve`` with the values as host overrides and the Python names as the labels of the
options not set, so every message names keywords the caller can find in its own call.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any, Final

from .._core.coordinator import ShutdownCoordinator
from .._core.policy import POLICIES, Policy
from ._build import build_coordinator
from ._parse import boolean, endpoint_path, seconds
from ._resolve import resolve
from ._table import OPTIONS, Option

__all__ = (
    "PYTHON_RUN_OPTIONS",
    "PYTHON_TARGETS",
    "python_options",
    "python_setup",
    "split_python",
    "unexpected_keyword",
)

#: The targets whose options the run functions take by their Python names; of the
#: ``run`` target only ``PYTHON_RUN_OPTIONS`` (the others are ``graceful run``'s own).
PYTHON_TARGETS: Final = ("policy", "coordinator", "middleware")
PYTHON_RUN_OPTIONS: Final = ("kubernetes", "wait_for_endpoints")


def python_options() -> tuple[Option, ...]:
    """The options the run functions take, by ``Option.python``."""
    return tuple(o for o in OPTIONS if o.target in PYTHON_TARGETS or o.name in PYTHON_RUN_OPTIONS)


def split_python(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` as graceful's options (by Python name) and the rest (the server's)."""
    names = {o.python for o in python_options()}
    ours = {k: v for k, v in kwargs.items() if k in names}
    return ours, {k: v for k, v in kwargs.items() if k not in names}


def unexpected_keyword(caller: str, name: str, known: Collection[str]) -> TypeError:
    """The error for an unknown keyword argument of ``caller``, with the closest
    known one (an option's command-line name, ``grace_period``, points at its Python
    name, ``grace_period_s``)."""
    import difflib

    aliases = {o.name: o.python for o in python_options() if o.name != o.python}
    hint = aliases.get(name.replace("-", "_"))
    if hint is None:
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        hint = close[0] if close else None
    return TypeError(
        f"{caller}() got an unexpected keyword argument {name!r}"
        + (f" (did you mean {hint}?)" if hint else "")
    )


def _python_value(opt: Option, value: object) -> object:
    """``value`` of ``opt`` given in Python, checked by the option's own parser."""
    name = opt.python
    if opt.parse is boolean:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
        return value
    if opt.parse is seconds or opt.parse.__name__ == "integer":
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if opt.parse is not seconds and not isinstance(value, int):
            number = False
        text = repr(value) if number else "\x00"  # a text no parser accepts: the reason
        try:
            parsed = opt.parse(text)
        except ValueError as exc:
            reason = re.sub(r", got .*$", "", " ".join(str(exc).split()))
            error = ValueError if number else TypeError
            raise error(f"{name} {reason}, got {type(value).__name__} {value!r}") from None
        return parsed
    if value is None and opt.parse is endpoint_path:
        return None
    if not isinstance(value, str):
        what = "a str or None" if opt.parse is endpoint_path else "a str"
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    try:
        return opt.parse(value.strip())
    except ValueError as exc:
        reason = " ".join(str(exc).split())
        raise ValueError(
            f"{name} {reason}" if reason.startswith("must ") else f"{name}: {reason}"
        ) from None


def python_setup(
    caller: str,
    options: Mapping[str, Any],
    *,
    coordinator: object = None,
    policy: object = None,
    **coordinator_overrides: Any,
) -> tuple[ShutdownCoordinator, dict[str, Any]]:
    """The coordinator and the middleware's keyword arguments of a run function, from
    graceful's options given by their Python names (``options``, see ``split_python``),
    checked as the command line's are.

    Args:
        caller: The function, for messages (``"graceful.uvicorn.run"``).
        options: graceful's options by Python name.
        coordinator: The caller's coordinator, if given (then options that would
            configure a new one are an error).
        policy: A ``Policy``, or a policy's name (``--policy``'s values), or ``None``.
        coordinator_overrides: Coordinator arguments that are not options.

    Raises:
        TypeError: a value of the wrong type, naming the keyword, the value and what is
            allowed.
        ValueError: a bad value or combination (a ``ConfigError``), likewise.
    """
    from .._core.coordinator import _check_coordinator

    by_python = {o.python: o for o in python_options()}
    # None is "not set" for the options whose default is None (a policy's own default,
    # no grace period); for an endpoint it is "no endpoint", a value.
    options = {
        k: v
        for k, v in options.items()
        if v is not None or by_python[k].default is not None or by_python[k].parse is endpoint_path
    }
    instance: Policy | None = None
    if coordinator is not None:
        _check_coordinator(coordinator)
        if policy is not None:
            raise ValueError(f"{caller}: pass either coordinator= or policy=, not both")
    if isinstance(policy, Policy):
        instance = policy
    elif isinstance(policy, str):
        options["policy"] = policy
    elif policy is not None:
        raise TypeError(
            "policy must be a graceful Policy instance (graceful.AcceptUntilIdle(), …), a "
            f"policy's name ({', '.join(sorted(POLICIES))}) or None, got "
            f"{type(policy).__name__} {policy!r}"
        )
    for name, value in options.items():
        opt = by_python[name]
        if coordinator is not None and opt.target != "middleware":
            raise ValueError(
                f"{caller}: {name}={value!r} configures the coordinator {caller} would "
                f"create; with coordinator= given, set it on that coordinator "
                "(graceful.ShutdownCoordinator, graceful.policy_from_name)"
            )
        if instance is not None and opt.target == "policy":
            raise ValueError(
                f"{caller}: {name}={value!r} applies to a policy given by name "
                f"(policy={instance.name!r}); with a Policy instance, set it on the policy"
            )
    overrides = {
        by_python[name].name: (_python_value(by_python[name], value), name)
        for name, value in options.items()
    }
    values = resolve(
        environ={}, overrides=overrides, unset_labels={o.name: o.python for o in OPTIONS}
    )
    middleware = {
        o.keyword: values[o.name]
        for o in OPTIONS
        if o.target == "middleware" and o.name in overrides
    }
    if isinstance(coordinator, ShutdownCoordinator):
        return coordinator, middleware
    if instance is not None:
        coordinator_overrides["policy"] = instance
    return build_coordinator(values, **coordinator_overrides), middleware
