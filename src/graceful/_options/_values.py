"""``Values``: the checked options by name, and how each one was set.

Every message about an option names it the way the user set it — ``--idle`` on the
command line, ``GRACEFUL_IDLE`` in the environment, ``--graceful-timeout`` when gunicorn's
setting stands in for the grace period, ``idle_s`` in the Python API — so the values
travel with their labels.  An option left at its default has no label of its own:
``label`` then names it the way it *would* be set (the flag, or the Python name the host
passed as ``unset_labels``), and ``given`` tells the two apart for the checks that only
apply to options the user chose (an option the chosen server does not take).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from typing_extensions import final

from ._table import option

__all__ = ("Values",)


@final
class Values(Mapping[str, Any]):
    """Checked option values by name, and how each was set (for messages).

    ``values["idle"]``; ``label`` is ``"--idle"`` or ``"GRACEFUL_IDLE"``.
    """

    __slots__ = ("_labels", "_unset_labels", "_values")

    def __init__(
        self,
        values: Mapping[str, Any],
        labels: Mapping[str, str],
        unset_labels: Mapping[str, str] | None = None,
    ) -> None:
        self._values = dict(values)
        self._labels = dict(labels)
        self._unset_labels = dict(unset_labels or {})

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Values({self._values!r})"

    def label(self, name: str) -> str:
        """How the option was set: its flag, its variable or what the host passed; for
        an option not set, how it would be (its flag, or its Python name)."""
        label = self._labels.get(name) or self._unset_labels.get(name)
        return label if label is not None else option(name).flag

    def replaced(self, changes: Mapping[str, Any]) -> Values:
        """A copy with ``changes`` (their labels kept)."""
        return Values({**self._values, **changes}, self._labels, self._unset_labels)

    def given(self, name: str) -> bool:
        """Whether the option was set (not left at its default)."""
        return name in self._labels
