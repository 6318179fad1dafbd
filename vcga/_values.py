"""Frozen value classes without :mod:`dataclasses`.

``@dataclass(frozen=True)`` writes and compiles the source of six methods when the class is
defined: about 0.5 ms a class. A job's ``init_process_group("vcga")`` imports a handful of such
classes (the contract's :class:`~vcga.contract.ProbeResult`, the dtype table's
:class:`~vcga.dtypes.DType`, the capability :class:`~vcga.capabilities.Cell`, ...), and every
rank of every job paid for them. :class:`FrozenValue` gives those classes the same behaviour from
one definition.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

__all__ = ["FrozenValue"]


class FrozenValue:
    """A frozen value: what ``@dataclass(frozen=True)`` gives, for a class that names its fields in
    ``__slots__`` (in its ``__init__``'s order) and sets them with ``object.__setattr__``.

    Equal to an instance of the same class with equal fields, hashed by the fields, shown as
    ``Name(field=value, ...)``; assigning or deleting a field raises
    :class:`dataclasses.FrozenInstanceError`; copies and pickles are made through ``__init__``.
    """

    __slots__: tuple[str, ...] = ()

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{self.__class__.__qualname__}({fields})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, self._values()
