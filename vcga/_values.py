"""Frozen value classes without the cost of ``@dataclass(frozen=True)``.

``@dataclass(frozen=True)`` writes and compiles the source of six methods when the class is
defined: about 0.5 ms for a class of four fields, 1 ms for :class:`~vcga.config.Config`'s twenty.
A job's ``init_process_group("vcga")`` imports a handful of such classes (the contract's
:class:`~vcga.contract.ProbeResult`, the dtype table's :class:`~vcga.dtypes.DType`, the
capability :class:`~vcga.capabilities.Cell`, the config, ...), and every rank of every job paid for
them. The bases here give those classes the same behaviour from one definition:

- :class:`FrozenValue` for a class that names its fields in ``__slots__``;
- :class:`FrozenDataclass` for a dataclass declared ``@dataclass(init=False, repr=False,
  eq=False)``, which stays a dataclass (``fields``, ``replace`` and ``asdict`` work on it) and costs
  a tenth to define.
"""

from __future__ import annotations

from dataclasses import MISSING, FrozenInstanceError
from typing import Any

__all__ = ["FrozenValue", "FrozenDataclass"]


class _Frozen:
    """Equal to an instance of the same class with equal fields, hashed by the fields, shown as
    ``Name(field=value, ...)``; assigning or deleting an attribute raises
    :class:`dataclasses.FrozenInstanceError`. Subclasses say what the fields are (``_names``)."""

    __slots__ = ()

    def _names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._names())

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._names())
        return f"{self.__class__.__qualname__}({fields})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")


class FrozenValue(_Frozen):
    """A frozen value whose class names its fields in ``__slots__`` (in its ``__init__``'s order)
    and sets them with ``object.__setattr__``. Copies and pickles are made through ``__init__``."""

    __slots__: tuple[str, ...] = ()

    def _names(self) -> tuple[str, ...]:
        return self.__slots__

    def _set(self, *values: Any) -> None:
        """Set the fields, in ``__slots__`` order (what a subclass's ``__init__`` calls)."""
        for name, value in zip(self.__slots__, values, strict=True):
            object.__setattr__(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, self._values()


class FrozenDataclass(_Frozen):
    """The methods of ``@dataclass(frozen=True)`` for a class declared ``@dataclass(init=False,
    repr=False, eq=False)``: its ``__init__`` takes each field by keyword (a field left out gets
    its default), and copies and pickles keep the instance's attributes as a dataclass's do."""

    __slots__ = ()
    __dataclass_fields__: Any  # set by @dataclass on the subclass

    def _names(self) -> tuple[str, ...]:
        return tuple(self.__dataclass_fields__)

    def __init__(self, **values: Any) -> None:
        fields = self.__dataclass_fields__
        for name in values:
            if name not in fields:
                raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword argument {name!r}")
        for name, f in fields.items():
            if name in values:
                value = values[name]
            elif f.default is not MISSING:
                value = f.default
            elif f.default_factory is not MISSING:
                value = f.default_factory()
            else:
                raise TypeError(f"{type(self).__name__}.__init__() missing keyword argument {name!r}")
            object.__setattr__(self, name, value)
