"""Parsers: the text of one option to its value, or the reason it is refused.

A parser gets the text of one option as the user wrote it — on the command line or in a
``GRACEFUL_*`` variable, already stripped — and returns the value, or raises
``ValueError`` with the reason, phrased "must be …, got '…'" so that the caller only
prefixes the option's name (``--idle`` or ``GRACEFUL_IDLE``) to make a ``ConfigError``
line.  Each parser checks its value on its own (a wrong type, NaN, a negative or absurdly
large number, an empty choice); the checks between options are ``_build.check``'s.

Some parsers carry a ``choices`` attribute, a function returning the accepted words:
shell completion and the configuration page read it.  It is a function, not a tuple,
because ``uvicorn_choice`` asks the installed uvicorn at the time it is called (a loop or
protocol a newer uvicorn adds is accepted without a change here).  The ``__name__`` of the
parsers made by ``integer`` and ``choice`` is set so that ``_python._python_value`` can
tell a whole-number option from the others without keeping a list of them.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from typing import Final

from .._core.policy import POLICIES

__all__ = (
    "MAX_SECONDS",
    "ConfigError",
    "boolean",
    "choice",
    "endpoint_path",
    "host",
    "integer",
    "policy_name",
    "seconds",
    "uvicorn_choice",
)

#: The largest number of seconds any option takes (a week): larger values are mistakes,
#: and some overflow the platform's timers.
MAX_SECONDS: Final = 7 * 24 * 3600.0


class ConfigError(ValueError):
    """A bad option value; the message is one line naming the option."""


def _shown(text: str) -> str:
    """``text`` quoted for a message, shortened so that the message stays one line."""
    if len(text) > 40:
        return repr(text[:20]) + f"… ({len(text)} characters)"
    return repr(text)


def seconds(text: str) -> float:
    """A finite number of seconds from 0 to ``MAX_SECONDS``."""
    reason = f"must be a number of seconds from 0 to {MAX_SECONDS:g}, got {_shown(text)}"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(reason) from None
    if not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        raise ValueError(reason)
    return value


def integer(low: int, high: int, what: str) -> Callable[[str], int]:
    """A parser for whole numbers from ``low`` to ``high``; ``what`` names them."""

    def parse(text: str) -> int:
        # Digits only: int() would also take "1_000", "+5" and non-ASCII digits.
        if re.fullmatch(r"[0-9]{1,9}", text) is None or not low <= int(text) <= high:
            raise ValueError(f"must be {what} from {low} to {high}, got {_shown(text)}")
        return int(text)

    parse.__name__ = "integer"
    return parse


def choice(*allowed: str) -> Callable[[str], str]:
    """A parser for one of ``allowed`` (case-insensitive)."""

    def parse(text: str) -> str:
        if text.lower() not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, got {_shown(text)}")
        return text.lower()

    parse.__name__ = "choice"
    parse.choices = lambda: allowed  # type: ignore[attr-defined]  # for shell completion
    return parse


#: uvicorn's import strings: ``package.module:attribute``.
_IMPORT_STRING: Final = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _uvicorn_names(table: str, fallback: tuple[str, ...]) -> tuple[str, ...]:
    """The names in ``uvicorn.config.<table>`` of the installed uvicorn (``fallback``
    without uvicorn): a choice a new uvicorn adds is taken as it is."""
    try:
        from uvicorn import config
    except ImportError:
        return fallback
    names = getattr(config, table, None)
    return tuple(names) if isinstance(names, dict) and names else fallback


def uvicorn_choice(table: str, fallback: tuple[str, ...], *extra: str) -> Callable[[str], str]:
    """A parser for one of uvicorn's names in ``uvicorn.config.<table>``
    (``HTTP_PROTOCOLS``, ``LOOP_FACTORIES``), one of ``extra``, or an import string
    ``module:attribute`` — what uvicorn's own ``--http`` and ``--loop`` take."""

    def parse(text: str) -> str:
        names = (*_uvicorn_names(table, fallback), *extra)
        if text.lower() in names:
            return text.lower()
        if _IMPORT_STRING.fullmatch(text):
            return text
        raise ValueError(
            f"must be one of {', '.join(names)} or an import string module:attribute, "
            f"got {_shown(text)}"
        )

    parse.__name__ = "choice"
    parse.choices = lambda: (*_uvicorn_names(table, fallback), *extra)  # type: ignore[attr-defined]
    return parse


_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


def boolean(text: str) -> bool:
    """``true/false``, ``1/0``, ``yes/no`` or ``on/off``, in any case; nothing else."""
    key = text.lower()
    if key in _TRUE:
        return True
    if key in _FALSE:
        return False
    raise ValueError(f"must be true or false (also 1/0, yes/no, on/off), got {_shown(text)}")


def policy_name(text: str) -> str:
    """A policy name (``accept_until_idle`` and any case are accepted)."""
    key = text.lower().replace("_", "-")
    if key not in POLICIES:
        allowed = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown policy {_shown(text)}; expected one of {allowed}")
    return key


policy_name.choices = lambda: tuple(sorted(POLICIES))  # type: ignore[attr-defined]


def endpoint_path(text: str) -> str | None:
    """An HTTP path for an endpoint, or ``none``/``off`` for no endpoint."""
    if text.lower() in ("none", "off"):
        return None
    if not text.startswith("/") or re.search(r"[\s?#]", text) or not text.isprintable():
        raise ValueError(
            "must be a path starting with '/' (no spaces, '?' or '#') or 'none', "
            f"got {_shown(text)}"
        )
    return text


_LABEL: Final = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host(text: str) -> str:
    """An IP address or a host name (whether it resolves is checked by the caller)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        pass
    else:
        return text
    name = text[:-1] if text.endswith(".") else text
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"must be an IP address or a host name, got {_shown(text)}")
    return text
