"""The one dtype table: canonical names and how every ecosystem spells them.

Canonical names are torch's without the ``torch.`` prefix (``"bfloat16"``, ``"float8_e4m3fn"``).
Capability tables, tensor entries, the wire format and every checkpoint format speak these names,
so nothing outside this module needs to know that safetensors says ``BF16`` and MindSpore ``BFloat16``.

Importing this module imports neither torch nor numpy; the ``to_torch``/``to_numpy`` helpers import
them on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vcga.errors import VcgaError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "DType",
    "DTYPES",
    "ALL",
    "BOOL",
    "UNSIGNED",
    "SIGNED",
    "INTEGER",
    "FLOAT",
    "FP8",
    "COMPLEX",
    "get",
    "from_torch",
    "to_torch",
    "from_numpy",
    "to_numpy",
]


@dataclass(frozen=True)
class DType:
    """One element type, with its spelling in each ecosystem (``None``: that ecosystem lacks it)."""

    name: str  #: canonical (torch) name
    itemsize: int  #: bytes per element
    kind: str  #: "b" bool, "u" unsigned, "i" signed, "f" floating, "c" complex
    numpy: str  #: numpy / ml_dtypes type name
    safetensors: str | None  #: safetensors header dtype
    mindspore: str | None  #: MindSpore ``tensor_type`` / mstype name

    @property
    def is_floating(self) -> bool:
        return self.kind == "f"

    @property
    def is_integer(self) -> bool:
        return self.kind in "ui"


_TABLE = (
    DType("bool", 1, "b", "bool", "BOOL", "Bool"),
    DType("uint8", 1, "u", "uint8", "U8", "UInt8"),
    DType("int8", 1, "i", "int8", "I8", "Int8"),
    DType("int16", 2, "i", "int16", "I16", "Int16"),
    DType("uint16", 2, "u", "uint16", "U16", "UInt16"),
    DType("int32", 4, "i", "int32", "I32", "Int32"),
    DType("uint32", 4, "u", "uint32", "U32", "UInt32"),
    DType("int64", 8, "i", "int64", "I64", "Int64"),
    DType("uint64", 8, "u", "uint64", "U64", "UInt64"),
    DType("float16", 2, "f", "float16", "F16", "Float16"),
    DType("bfloat16", 2, "f", "bfloat16", "BF16", "BFloat16"),
    DType("float32", 4, "f", "float32", "F32", "Float32"),
    DType("float64", 8, "f", "float64", "F64", "Float64"),
    DType("complex64", 8, "c", "complex64", "C64", "Complex64"),
    DType("complex128", 16, "c", "complex128", None, "Complex128"),
    DType("float8_e4m3fn", 1, "f", "float8_e4m3fn", "F8_E4M3", None),
    DType("float8_e5m2", 1, "f", "float8_e5m2", "F8_E5M2", None),
)

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}

#: Every canonical dtype name, in table order.
ALL: tuple[str, ...] = tuple(DTYPES)
BOOL: tuple[str, ...] = ("bool",)
UNSIGNED: tuple[str, ...] = tuple(d.name for d in _TABLE if d.kind == "u")
SIGNED: tuple[str, ...] = tuple(d.name for d in _TABLE if d.kind == "i")
INTEGER: tuple[str, ...] = tuple(d.name for d in _TABLE if d.kind in "ui")
FP8: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")
FLOAT: tuple[str, ...] = tuple(d.name for d in _TABLE if d.kind == "f")
COMPLEX: tuple[str, ...] = tuple(d.name for d in _TABLE if d.kind == "c")


class UnknownDTypeError(VcgaError, ValueError):
    """A dtype name or object VCGA does not know."""

    def __init__(self, what: Any) -> None:
        super().__init__(f"unknown dtype {what!r}; known dtypes: {', '.join(ALL)}")


def get(name: str) -> DType:
    """Look up a canonical name (``"bf16"``-style abbreviations are not accepted)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UnknownDTypeError(name) from None


def from_torch(dtype: torch.dtype) -> str:
    """Canonical name of a ``torch.dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise UnknownDTypeError(dtype)
    return name


def to_torch(name: str) -> torch.dtype:
    """The ``torch.dtype`` for a canonical name."""
    import torch

    get(name)
    return getattr(torch, name)


def from_numpy(dtype: np.dtype | type) -> str:
    """Canonical name of a numpy dtype (ml_dtypes' bfloat16/fp8 included). Byte order is ignored."""
    import numpy as np

    dt = np.dtype(dtype)
    name = dt.name
    if name not in DTYPES or DTYPES[name].numpy != name:
        raise UnknownDTypeError(dt)
    return name


def to_numpy(name: str) -> np.dtype:
    """The little-endian numpy dtype for a canonical name (ml_dtypes provides bf16 and fp8)."""
    import numpy as np

    d = get(name)
    if d.numpy in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, d.numpy))
    return np.dtype(d.numpy).newbyteorder("<")
