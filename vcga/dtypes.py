"""The one dtype table: canonical names and how every ecosystem spells them.

Canonical names are torch's without the ``torch.`` prefix (``"bfloat16"``, ``"float8_e4m3fn"``).
Capability tables, tensor entries, the wire format and every checkpoint format speak these names,
so nothing outside this module needs to know that safetensors says ``BF16``, MindSpore ``BFloat16``
and HDF5 ``H5T_FLOAT_BFLOAT16LE``.

Each :class:`DType` row carries:

- ``numpy``: the numpy type name; bfloat16 and the fp8 types come from ``ml_dtypes`` (numpy lacks them),
  complex32 and packed fp4 have none (opaque ``V4``/``V1`` bytes);
- ``safetensors``: the header dtype string (safetensors has no complex128);
- ``mindspore``: ``str(mindspore.<dtype>)``, the spelling of ``mstype`` objects and of the ``tensor_type``
  field of a ``.ckpt`` file (which accepts only :data:`MINDSPORE_CKPT`);
- ``hdf5``: the HDF5 predefined little-endian type (HDF5 2.0 added bfloat16, fp8 and complex types;
  HDF5 has no boolean type, h5py writes bool as an enum over int8).
  h5py stores only :data:`H5PY_NATIVE` with a real HDF5 type of its own accord (bool as an enum,
  complex as an ``{r, i}`` compound); for the rest an HDF5 writer needs a convention;
- ``code``: the stable number the wire format and vendor-bin tools use (never reused).

Every spelling was checked against the real library: safetensors 0.8 (``safetensors/torch.py``
``_TYPES``), MindSpore 2.10 (``str(mstype.*)``, ``serialization.tensor_to_ms_type``), h5py 3.16 on
HDF5 2.0.0 (``predefined_datatypes_tables`` of the HDF5 reference manual), ml_dtypes 0.6, torch 2.13.

Importing this module imports neither torch nor numpy; the ``to_torch``/``to_numpy`` helpers import
them on first use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vcga._values import FrozenValue
from vcga.errors import VcgaConversionError, VcgaError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "DType",
    "DTYPES",
    "ALL",
    "EVERY",
    "STORAGE_ONLY",
    "NUMPY_OPAQUE",
    "BOOL",
    "UNSIGNED",
    "SIGNED",
    "INTEGER",
    "FLOAT",
    "FP8",
    "COMPLEX",
    "ML_DTYPES",
    "SAFETENSORS",
    "MINDSPORE",
    "MINDSPORE_CKPT",
    "HDF5",
    "H5PY_NATIVE",
    "UnknownDTypeError",
    "get",
    "nbytes",
    "canonical",
    "from_torch",
    "to_torch",
    "from_numpy",
    "to_numpy",
    "from_safetensors",
    "to_safetensors",
    "from_mindspore",
    "to_mindspore",
    "from_hdf5",
    "to_hdf5",
    "from_code",
    "to_code",
    "bits_dtype",
]


class DType(FrozenValue):
    """One element type, with its spelling in each ecosystem (``None``: that ecosystem lacks it).

    Frozen and compared by value, as ``@dataclass(frozen=True)`` would make it; defined without
    dataclasses, which would cost each rank 0.5 ms at every start (:mod:`vcga._values`)."""

    __slots__ = ("name", "itemsize", "kind", "numpy", "safetensors", "mindspore", "hdf5", "code")
    name: str  #: canonical (torch) name
    itemsize: int  #: bytes per element
    kind: str  #: "b" bool, "u" unsigned, "i" signed, "f" floating, "c" complex
    numpy: str  #: numpy / ml_dtypes type name
    safetensors: str | None  #: safetensors header dtype
    mindspore: str | None  #: MindSpore ``str(mstype)`` name (``.ckpt`` ``tensor_type`` for MINDSPORE_CKPT)
    hdf5: str | None  #: HDF5 predefined little-endian datatype (HDF5 >= 2.0 for bf16/fp8/complex)
    code: int  #: stable wire code (1..255); 0 is never a valid code

    def __init__(self, name: str, itemsize: int, kind: str, numpy: str, safetensors: str | None,
                 mindspore: str | None, hdf5: str | None = None, code: int = 0) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "itemsize", itemsize)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "numpy", numpy)
        object.__setattr__(self, "safetensors", safetensors)
        object.__setattr__(self, "mindspore", mindspore)
        object.__setattr__(self, "hdf5", hdf5)
        object.__setattr__(self, "code", code)

    @property
    def is_floating(self) -> bool:
        return self.kind == "f"

    @property
    def is_integer(self) -> bool:
        return self.kind in "ui"

    @property
    def is_complex(self) -> bool:
        return self.kind == "c"

    @property
    def bits(self) -> int:
        return self.itemsize * 8


_TABLE = (
    DType("bool", 1, "b", "bool", "BOOL", "Bool", None, 1),
    DType("uint8", 1, "u", "uint8", "U8", "UInt8", "H5T_STD_U8LE", 2),
    DType("int8", 1, "i", "int8", "I8", "Int8", "H5T_STD_I8LE", 3),
    DType("int16", 2, "i", "int16", "I16", "Int16", "H5T_STD_I16LE", 4),
    DType("uint16", 2, "u", "uint16", "U16", "UInt16", "H5T_STD_U16LE", 5),
    DType("int32", 4, "i", "int32", "I32", "Int32", "H5T_STD_I32LE", 6),
    DType("uint32", 4, "u", "uint32", "U32", "UInt32", "H5T_STD_U32LE", 7),
    DType("int64", 8, "i", "int64", "I64", "Int64", "H5T_STD_I64LE", 8),
    DType("uint64", 8, "u", "uint64", "U64", "UInt64", "H5T_STD_U64LE", 9),
    DType("float16", 2, "f", "float16", "F16", "Float16", "H5T_IEEE_F16LE", 10),
    DType("bfloat16", 2, "f", "bfloat16", "BF16", "BFloat16", "H5T_FLOAT_BFLOAT16LE", 11),
    DType("float32", 4, "f", "float32", "F32", "Float32", "H5T_IEEE_F32LE", 12),
    DType("float64", 8, "f", "float64", "F64", "Float64", "H5T_IEEE_F64LE", 13),
    DType("complex64", 8, "c", "complex64", "C64", "Complex64", "H5T_COMPLEX_IEEE_F32LE", 14),
    DType("complex128", 16, "c", "complex128", None, "Complex128", "H5T_COMPLEX_IEEE_F64LE", 15),
    DType("float8_e4m3fn", 1, "f", "float8_e4m3fn", "F8_E4M3", "Float8E4M3FN", "H5T_FLOAT_F8E4M3", 16),
    DType("float8_e5m2", 1, "f", "float8_e5m2", "F8_E5M2", "Float8E5M2", "H5T_FLOAT_F8E5M2", 17),
    # Storage-only (STORAGE_ONLY): dtypes torch writes in checkpoints that no collective backend
    # moves. complex32 is torch's ComplexHalf (two fp16); float4_e2m1fn_x2 is one byte holding two
    # fp4 e2m1 values (low nibble first), torch's shape counting bytes -- safetensors' "F4" counts
    # the 4-bit values, so its last dimension is twice torch's. numpy has neither: their arrays are
    # opaque bytes ("V4", "V1").
    DType("complex32", 4, "c", "V4", None, None, "H5T_COMPLEX_IEEE_F16LE", 18),
    DType("float8_e4m3fnuz", 1, "f", "float8_e4m3fnuz", "F8_E4M3FNUZ", None, None, 19),
    DType("float8_e5m2fnuz", 1, "f", "float8_e5m2fnuz", "F8_E5M2FNUZ", None, None, 20),
    DType("float8_e8m0fnu", 1, "f", "float8_e8m0fnu", "F8_E8M0", None, None, 21),
    DType("float4_e2m1fn_x2", 1, "f", "V1", "F4", None, None, 22),
)

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}

#: Dtypes torch 2.13 writes in checkpoints (``dcp.save`` included) that no collective backend
#: moves: known to every checkpoint format that can hold them, absent from the capability tables.
STORAGE_ONLY: tuple[str, ...] = ("complex32", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                                 "float4_e2m1fn_x2")
#: Every canonical dtype name, in table order: what the checkpoint formats speak.
EVERY: tuple[str, ...] = tuple(DTYPES)
#: The dtypes of the collective world (capability tables, the bridge, ``vcga verify``): every
#: dtype but :data:`STORAGE_ONLY`. The kind tuples below are drawn from these.
ALL: tuple[str, ...] = tuple(n for n in DTYPES if n not in STORAGE_ONLY)
BOOL: tuple[str, ...] = ("bool",)
UNSIGNED: tuple[str, ...] = tuple(n for n in ALL if DTYPES[n].kind == "u")
SIGNED: tuple[str, ...] = tuple(n for n in ALL if DTYPES[n].kind == "i")
INTEGER: tuple[str, ...] = tuple(n for n in ALL if DTYPES[n].kind in "ui")
FP8: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")
FLOAT: tuple[str, ...] = tuple(n for n in ALL if DTYPES[n].kind == "f")
COMPLEX: tuple[str, ...] = tuple(n for n in ALL if DTYPES[n].kind == "c")
#: Dtypes whose numpy type comes from ml_dtypes (numpy itself lacks them).
ML_DTYPES: tuple[str, ...] = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                              "float8_e8m0fnu")
#: Dtypes numpy and ml_dtypes both lack: their numpy view is opaque bytes of the element's size.
NUMPY_OPAQUE: tuple[str, ...] = ("complex32", "float4_e2m1fn_x2")

#: Dtypes each ecosystem can hold exactly (what a format's ``FormatSpec.dtypes`` starts from).
SAFETENSORS: frozenset[str] = frozenset(d.name for d in _TABLE if d.safetensors)
MINDSPORE: frozenset[str] = frozenset(d.name for d in _TABLE if d.mindspore)
#: What MindSpore 2.10's ``load_checkpoint`` accepts in ``tensor_type`` (its ``tensor_to_ms_type``
#: also has "str" and "Int4", which are not tensors of ours): no complex, no fp8.
MINDSPORE_CKPT: frozenset[str] = frozenset(
    ("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
     "float16", "bfloat16", "float32", "float64"))
#: HDF5 holds every dtype: bool has no predefined HDF5 type, h5py writes it as an enum
#: {FALSE=0, TRUE=1} over H5T_STD_I8LE (so ``DType.hdf5`` is None for bool); the fnuz, e8m0 and
#: fp4 types have none either (VCGA's HDF5 writer labels them as opaque data, docs/convert.md).
HDF5: frozenset[str] = frozenset(EVERY)
#: Dtypes h5py 3.16 maps to a real HDF5 type from the numpy dtype alone. h5py writes bfloat16 and
#: float8_e4m3fn as opaque ``|V2``/``|V1`` data and refuses float8_e5m2, and numpy has no complex32
#: or packed fp4 at all, so an HDF5 writer needs a documented convention for those.
H5PY_NATIVE: frozenset[str] = frozenset(d for d in EVERY if d not in ML_DTYPES and d not in NUMPY_OPAQUE)

_BY_SAFETENSORS = {d.safetensors: d.name for d in _TABLE if d.safetensors}
_BY_MINDSPORE = {d.mindspore: d.name for d in _TABLE if d.mindspore}
# MindSpore < 2.0 wrote "Uint8", "Uint16", ... in .ckpt files; readers accept both.
_BY_MINDSPORE.update({"Uint8": "uint8", "Uint16": "uint16", "Uint32": "uint32", "Uint64": "uint64"})
_BY_HDF5 = {d.hdf5: d.name for d in _TABLE if d.hdf5}
_BY_CODE = {d.code: d.name for d in _TABLE}
assert len(_BY_CODE) == len(_TABLE) and 0 not in _BY_CODE, "wire codes must be unique and non-zero"


class UnknownDTypeError(VcgaError, ValueError):
    """A dtype name or object VCGA does not know."""

    def __init__(self, what: Any, ecosystem: str = "") -> None:
        self.what = what
        where = f" {ecosystem}" if ecosystem else ""
        super().__init__(f"unknown{where} dtype {what!r}; known dtypes: {', '.join(EVERY)}")


def get(name: str) -> DType:
    """Look up a canonical name (``"bf16"``-style abbreviations are not accepted)."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise UnknownDTypeError(name) from None


def nbytes(name: str, shape: Iterable[int]) -> int:
    """Bytes of a C-order tensor of canonical dtype ``name`` and ``shape`` (``()``: one element)."""
    n = get(name).itemsize
    for d in shape:
        n *= d
    return n


def canonical(dtype: Any) -> str:
    """The canonical name of anything that names a dtype: a canonical name, ``"torch.float32"``,
    a ``torch.dtype``, a numpy dtype or type (ml_dtypes included). Other ecosystems' spellings
    (``"BF16"``, ``"BFloat16"``) are ambiguous as bare strings; use their ``from_*`` function."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in DTYPES:
            return name
        raise UnknownDTypeError(dtype)
    if isinstance(dtype, DType):
        return dtype.name
    tp = type(dtype)
    if tp.__module__ == "torch" and tp.__name__ == "dtype":
        return from_torch(dtype)
    return from_numpy(dtype)


def from_torch(dtype: torch.dtype) -> str:
    """Canonical name of a ``torch.dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise UnknownDTypeError(dtype, "torch")
    return name


def to_torch(name: str) -> torch.dtype:
    """The ``torch.dtype`` for a canonical name."""
    import torch

    get(name)
    return getattr(torch, name)


def from_numpy(dtype: np.dtype | type) -> str:
    """Canonical name of a numpy dtype (ml_dtypes' bfloat16/fp8 included). Byte order is ignored:
    callers holding big-endian data (HDF5 files may) must byteswap before using the bytes."""
    import numpy as np

    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise UnknownDTypeError(dtype, "numpy") from None
    name = dt.name
    if name not in DTYPES or DTYPES[name].numpy != name or dt.fields is not None or dt.subdtype is not None:
        raise UnknownDTypeError(dt, "numpy")
    return name


def to_numpy(name: str) -> np.dtype:
    """The little-endian numpy dtype for a canonical name (ml_dtypes provides bf16 and fp8)."""
    return _numpy_dtype(get(name))


def _numpy_dtype(d: DType) -> np.dtype:
    import numpy as np

    if d.name in NUMPY_OPAQUE:
        return np.dtype(d.numpy)
    if d.name in ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, d.numpy))
    return np.dtype(d.numpy).newbyteorder("<")


def bits_dtype(name: str) -> np.dtype:
    """A numpy dtype that views the same bytes as plain bits, for bit-exact comparison.

    ``array.view(bits_dtype(name))`` compares NaN payloads and ``-0.0`` exactly where ``==`` would
    not; complex128 (16 bytes, no numpy integer that wide) becomes pairs of uint64 in a struct."""
    import numpy as np

    d = get(name)
    if d.itemsize <= 8:
        return np.dtype(f"<u{d.itemsize}")
    return np.dtype([("lo", "<u8"), ("hi", "<u8")])


def from_safetensors(tag: str) -> str:
    """Canonical name of a safetensors header dtype (``"BF16"`` -> ``"bfloat16"``)."""
    try:
        return _BY_SAFETENSORS[tag]
    except (KeyError, TypeError):
        raise UnknownDTypeError(tag, "safetensors") from None


def to_safetensors(name: str) -> str:
    """The safetensors header dtype; :class:`~vcga.errors.VcgaConversionError` if safetensors lacks it."""
    d = get(name)
    if d.safetensors is None:
        raise VcgaConversionError(f"safetensors has no dtype for {name}", dtype=name, target="safetensors")
    return d.safetensors


def from_mindspore(tag: str) -> str:
    """Canonical name of a MindSpore dtype spelling (``str(mstype)`` or a ``.ckpt`` ``tensor_type``)."""
    try:
        return _BY_MINDSPORE[tag]
    except (KeyError, TypeError):
        raise UnknownDTypeError(tag, "MindSpore") from None


def to_mindspore(name: str, *, ckpt: bool = False) -> str:
    """The MindSpore spelling; with ``ckpt=True`` only what ``load_checkpoint`` accepts.

    :raises VcgaConversionError: MindSpore (or its ``.ckpt`` format) lacks the dtype."""
    d = get(name)
    if d.mindspore is None or (ckpt and name not in MINDSPORE_CKPT):
        target = "mindspore-ckpt" if ckpt else "mindspore"
        raise VcgaConversionError(f"{target} has no dtype for {name}", dtype=name, target=target)
    return d.mindspore


def from_hdf5(tag: str) -> str:
    """Canonical name of an HDF5 predefined little-endian datatype name (``"H5T_IEEE_F32LE"``)."""
    try:
        return _BY_HDF5[tag]
    except (KeyError, TypeError):
        raise UnknownDTypeError(tag, "HDF5") from None


def to_hdf5(name: str) -> str:
    """The HDF5 predefined little-endian datatype name for a canonical name."""
    d = get(name)
    if d.hdf5 is None:
        raise VcgaConversionError(
            f"HDF5 has no predefined type for {name}; h5py stores bool as an enum {{FALSE=0, TRUE=1}} "
            "over H5T_STD_I8LE", dtype=name, target="hdf5")
    return d.hdf5


def from_code(code: int) -> str:
    """Canonical name of a wire code."""
    try:
        return _BY_CODE[code]
    except (KeyError, TypeError):
        raise UnknownDTypeError(code, "wire-code") from None


def to_code(name: str) -> int:
    """The stable wire code of a canonical name."""
    return get(name).code
