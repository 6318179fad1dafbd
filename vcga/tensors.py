"""Tensor entries: one tensor as name, dtype, shape and raw little-endian C-order bytes.

Every checkpoint format and the wire format speak :class:`~vcga.contract.TensorEntry`; this module
builds entries from torch tensors and numpy arrays and turns entries back into them, without
copying wherever the memory allows:

- :func:`from_torch` / :func:`from_numpy` / :func:`from_any`: a contiguous little-endian tensor
  becomes an entry whose ``data`` is a ``memoryview`` of the tensor's own memory (no copy).
  Non-contiguous, conjugated or negated views and big-endian arrays are packed once; device tensors
  come to the host through their vendor plugin (``vcga_tensor_to_host``: Ascend's private layouts
  are converted to ND there).
- :func:`to_numpy` / :func:`to_torch`: an entry's bytes viewed as an array or tensor (no copy when
  the buffer is writable and aligned; torch cannot share read-only memory safely, so a read-only
  buffer such as ``bytes`` is copied once for torch).
- :func:`checksum`: ``"xxh3_64:<16 hex>"`` of the bytes, through the xxhash library.

Importing this module imports neither torch nor numpy.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from vcga import dtypes
from vcga.contract import TensorEntry
from vcga.errors import VcgaChecksumError, VcgaConversionError, VcgaError, VcgaFormatError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "CHECKSUM_ALGORITHM",
    "checksum",
    "checksum_int",
    "format_checksum",
    "parse_checksum",
    "byte_view",
    "is_torch_tensor",
    "from_numpy",
    "from_torch",
    "from_any",
    "to_numpy",
    "to_torch",
    "raw_bytes",
    "typed_view",
    "check_entry",
    "verify_checksum",
    "bits_equal",
]

#: The checksum every VCGA format stores: XXH3, 64-bit, seed 0 (fast, well kept, stable across
#: platforms). Not a cryptographic hash: it detects damage, not tampering.
CHECKSUM_ALGORITHM = "xxh3_64"
_PREFIX = CHECKSUM_ALGORITHM + ":"
_HEX = frozenset("0123456789abcdef")


def checksum_int(data: Any) -> int:
    """XXH3-64 of a buffer, as an unsigned integer."""
    return xxhash.xxh3_64_intdigest(byte_view(data))


def format_checksum(value: int) -> str:
    """``"xxh3_64:<16 lowercase hex>"`` for a 64-bit value."""
    return f"{_PREFIX}{value:016x}"


def checksum(data: Any) -> str:
    """``"xxh3_64:<16 hex>"`` of a buffer (``bytes``, ``memoryview``, a numpy array's bytes)."""
    return format_checksum(checksum_int(data))


def parse_checksum(text: Any) -> int:
    """The 64-bit value of a ``"xxh3_64:<16 lowercase hex>"`` string.

    :raises ValueError: anything else (another algorithm, wrong length, upper case)."""
    if (not isinstance(text, str) or len(text) != len(_PREFIX) + 16 or not text.startswith(_PREFIX)
            or not _HEX.issuperset(text[len(_PREFIX):])):
        raise ValueError(f"not a {CHECKSUM_ALGORITHM} checksum: {text!r}")
    return int(text[len(_PREFIX):], 16)


def byte_view(data: Any) -> memoryview:
    """A flat, C-contiguous ``memoryview`` of unsigned bytes over ``data`` (no copy).

    Accepts anything with the buffer protocol; numpy arrays of ml_dtypes types (bfloat16, fp8),
    which cannot export a typed buffer, are viewed as uint8 first.

    :raises VcgaConversionError: a non-contiguous buffer (its bytes are not the tensor's C order).
    """
    if isinstance(data, memoryview):
        mv = data
    else:
        try:
            mv = memoryview(data)
        except (TypeError, ValueError):
            # numpy arrays of ml_dtypes types raise "cannot include dtype 'E' in a buffer"
            if type(data).__module__ == "numpy" and hasattr(data, "view"):
                if not data.flags.c_contiguous:
                    raise VcgaConversionError("a non-contiguous array has no flat byte view; "
                                              "pass a C-contiguous array") from None
                import numpy as np

                return memoryview(data.reshape(-1).view(np.uint8))
            raise
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    if not mv.c_contiguous:
        raise VcgaConversionError("a non-contiguous buffer has no flat byte view; pass a C-contiguous one")
    if mv.nbytes == 0:
        return memoryview(b"")  # memoryview.cast refuses shapes with a zero
    return mv.cast("B")


def is_torch_tensor(obj: Any) -> bool:
    """True for a ``torch.Tensor`` (checked without importing torch)."""
    if "torch" not in sys.modules:
        return False
    import torch

    return isinstance(obj, torch.Tensor)


def _is_numpy_array(obj: Any) -> bool:
    if "numpy" not in sys.modules:
        return False
    import numpy as np

    return isinstance(obj, np.ndarray)


def _check_metadata(name: str, metadata: Mapping[str, str] | None) -> Mapping[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise VcgaConversionError(f"metadata of tensor {name!r} must map strings to strings",
                                  tensor=name)
    return dict(metadata)


def from_numpy(name: str, array: np.ndarray, metadata: Mapping[str, str] | None = None, *,
               with_checksum: bool = False) -> TensorEntry:
    """An entry over a numpy array's bytes: zero-copy when the array is C-contiguous and
    little-endian, else packed once.

    :param with_checksum: compute the entry's ``checksum`` now (writers compute their own).
    :raises UnknownDTypeError: a dtype outside the table (object, strings, structured, float128...).
    """
    import numpy as np

    if not isinstance(array, np.ndarray):
        array = np.asarray(array)
    dtype = dtypes.from_numpy(array.dtype)
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))  # big-endian source (HDF5 can hold one)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    data = array.reshape(-1).view(np.uint8).data
    return TensorEntry(name=name, dtype=dtype, shape=tuple(int(d) for d in array.shape), data=data,
                       metadata=_check_metadata(name, metadata),
                       checksum=checksum(data) if with_checksum else None)


def _host_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    import torch

    t = tensor.detach() if tensor.requires_grad else tensor
    if t.layout is not torch.strided:
        raise VcgaConversionError(
            f"tensor {name!r} has layout {t.layout}; only dense tensors are stored. Call .to_dense() first.",
            tensor=name)
    if t.is_quantized:
        raise VcgaConversionError(
            f"tensor {name!r} is quantized ({t.dtype}); store t.int_repr() and its scale/zero point instead",
            tensor=name)
    if t.device.type == "meta":
        raise VcgaConversionError(f"tensor {name!r} is on the meta device and has no data", tensor=name)
    if t.device.type != "cpu":
        from vcga.plugin_manager import get_plugin_manager

        t = get_plugin_manager().tensor_to_host(t)
    # Lazy conjugate/negative views carry a bit instead of the values: materialise them.
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = _pack(t)
    return t


def _pack(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy made by copying integers of the same width, so no float kernel can touch
    a NaN payload and every dtype (fp8 included) has a copy kernel."""
    import torch

    if t.is_complex():
        parts = torch.view_as_real(t)  # (..., 2) of the real dtype, a view
        ints = parts.view(torch.int32 if parts.dtype == torch.float32 else torch.int64)
        return torch.view_as_complex(ints.contiguous().view(parts.dtype))
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width).contiguous().view(t.dtype)


def from_torch(name: str, tensor: torch.Tensor, metadata: Mapping[str, str] | None = None, *,
               with_checksum: bool = False) -> TensorEntry:
    """An entry over a torch tensor's bytes: zero-copy for a contiguous CPU tensor.

    A device tensor comes to the host through its plugin's ``vcga_tensor_to_host``; a
    non-contiguous, conjugated or negated view is packed once.

    :raises VcgaConversionError: sparse, quantized or meta tensors.
    :raises UnknownDTypeError: a dtype outside the table (e.g. ``torch.float8_e4m3fnuz``).
    """
    import torch

    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch host to test on
        raise VcgaError("the torch bridge assumes a little-endian host; convert through numpy "
                        "(vcga.tensors.from_numpy) on this machine")
    t = _host_tensor(name, tensor)
    dtype = dtypes.from_torch(t.dtype)
    if t.numel() == 0:
        data = memoryview(b"")  # an empty tensor's strides can be anything; it has no bytes
    else:
        if t.dim() and t.stride(-1) == 1:
            raw = t.view(torch.uint8)  # (..., last * itemsize), still C-contiguous
        else:
            # 0-d, or a size-1 last dim with an odd stride (contiguity ignores size-1 strides,
            # view(uint8) does not): the bytes are consecutive, so view them flat.
            raw = t.as_strided((t.numel(),), (1,)).view(torch.uint8)
        data = byte_view(raw.numpy())
    return TensorEntry(name=name, dtype=dtype, shape=tuple(t.shape), data=data,
                       metadata=_check_metadata(name, metadata),
                       checksum=checksum(data) if with_checksum else None)


def from_any(name: str, obj: Any, metadata: Mapping[str, str] | None = None, *,
             with_checksum: bool = False) -> TensorEntry:
    """An entry from a torch tensor, a numpy array, or an entry (renamed if ``name`` differs)."""
    if isinstance(obj, TensorEntry):
        if obj.name == name and metadata is None and (obj.checksum or not with_checksum):
            return obj
        return TensorEntry(name, obj.dtype, obj.shape, obj.data,
                           _check_metadata(name, metadata) if metadata is not None else obj.metadata,
                           obj.checksum or (checksum(obj.data) if with_checksum else None))
    if is_torch_tensor(obj):
        return from_torch(name, obj, metadata, with_checksum=with_checksum)
    if _is_numpy_array(obj):
        return from_numpy(name, obj, metadata, with_checksum=with_checksum)
    raise VcgaConversionError(f"tensor {name!r}: expected a torch.Tensor, numpy.ndarray or TensorEntry, "
                              f"got {type(obj).__name__}", tensor=name)


def check_entry(entry: TensorEntry, *, target: str | None = None) -> memoryview:
    """Check an entry is well formed and return its data as a flat byte view (no copy).

    The one check every writer, the wire format and the converters apply to an entry before using
    its bytes.

    :param target: the format being written, for the error.
    :raises VcgaConversionError: unknown dtype, a shape that is not a tuple of non-negative ints,
        no data (an index-only entry), a non-contiguous buffer, or data of the wrong length.
    """
    def error(what: str) -> VcgaConversionError:
        return VcgaConversionError(f"tensor {entry.name!r}{what}", tensor=entry.name, dtype=entry.dtype,
                                   target=target)

    try:
        info = dtypes.get(entry.dtype)
    except dtypes.UnknownDTypeError as e:
        raise error(f": {e}") from None
    if not isinstance(entry.shape, tuple) or not all(type(d) is int and d >= 0 for d in entry.shape):
        raise error(f": shape {entry.shape!r} is not a tuple of non-negative ints")
    if entry.data is None:
        raise error(" has no data (an index-only entry was passed where bytes are needed)")
    try:
        mv = byte_view(entry.data)
    except VcgaConversionError as e:
        raise error(f": {e}") from None
    expected = entry.numel * info.itemsize
    if mv.nbytes != expected:
        raise error(f": {mv.nbytes} data bytes, but {entry.dtype} {list(entry.shape)} needs {expected}")
    return mv


def verify_checksum(entry: TensorEntry, source: Any = "<entry>") -> None:
    """Recompute the checksum of an entry that carries one.

    :raises VcgaChecksumError: the bytes differ from what was stored.
    """
    if entry.checksum is None:
        return
    try:
        want = parse_checksum(entry.checksum)
    except ValueError as e:
        raise VcgaFormatError(source, f"tensor {entry.name!r}: {e}") from None
    got = checksum_int(entry.data)
    if got != want:
        raise VcgaChecksumError(source, f"tensor {entry.name!r}: checksum mismatch, the data was damaged "
                                f"after it was written (computed {format_checksum(got)})",
                                expected=entry.checksum)


def _address(mv: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if mv.nbytes else 0


def to_numpy(entry: TensorEntry, *, copy: bool = False) -> np.ndarray:
    """The entry as a numpy array of its dtype and shape (bf16/fp8 via ml_dtypes).

    A view of ``entry.data`` (read-only if the buffer is) unless ``copy``."""
    import numpy as np

    mv = check_entry(entry)
    arr = np.frombuffer(mv, dtype=np.uint8).view(dtypes.to_numpy(entry.dtype)).reshape(entry.shape)
    return arr.copy() if copy else arr


def to_torch(entry: TensorEntry, *, copy: bool = False) -> torch.Tensor:
    """The entry as a CPU torch tensor of its dtype and shape.

    Shares ``entry.data`` when the buffer is writable and aligned to the element size (a
    vendor-bin file's mapping, a ``bytearray``); otherwise, or with ``copy``, copies once into
    memory torch owns. torch tensors cannot be read-only, so sharing immutable ``bytes`` would let
    a write corrupt them."""
    import numpy as np
    import torch

    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch host to test on
        raise VcgaError("the torch bridge assumes a little-endian host; use vcga.tensors.to_numpy")
    mv = check_entry(entry)
    tdt = dtypes.to_torch(entry.dtype)
    if mv.nbytes == 0:
        return torch.empty(entry.shape, dtype=tdt)  # torch.frombuffer refuses empty buffers
    itemsize = dtypes.get(entry.dtype).itemsize
    if copy or mv.readonly or _address(mv) % itemsize:
        raw = torch.empty(mv.nbytes, dtype=torch.uint8)
        raw.numpy()[:] = np.frombuffer(mv, dtype=np.uint8)
    else:
        raw = torch.frombuffer(_private_view(mv), dtype=torch.uint8)
    return raw.view(tdt).reshape(entry.shape)


def _private_view(mv: memoryview) -> memoryview:
    """A memoryview only the tensor holds. torch.frombuffer keeps the object alive but gives its
    buffer export back at once; a view nobody else can ``release()`` keeps the export -- and so
    the memory, e.g. a file mapping -- alive as long as the tensor."""
    return memoryview(mv)


def raw_bytes(buffer: Any, framework: str) -> Any:
    """A flat uint8 torch tensor (``"pt"``) or numpy array (``"np"``) sharing a writable buffer,
    to cut many tensors from with :func:`typed_view` (a file mapping: one export, many cheap slices)."""
    mv = byte_view(buffer)
    if framework == "np":
        import numpy as np

        return np.frombuffer(mv, dtype=np.uint8)
    import torch

    if mv.readonly:
        raise ValueError("torch cannot share a read-only buffer")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(_private_view(mv), dtype=torch.uint8)


def typed_view(raw: Any, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """The tensor of ``dtype`` and ``shape`` stored at ``raw[offset:offset + nbytes]`` (no copy).

    ``raw`` comes from :func:`raw_bytes`; the caller guarantees ``offset`` is aligned for ``dtype``
    and ``nbytes`` matches the shape (vendor-bin's reader has checked both)."""
    piece = raw[offset:offset + nbytes]
    if type(raw).__module__ == "numpy":
        return piece.view(dtypes.to_numpy(dtype)).reshape(shape)
    return piece.view(dtypes.to_torch(dtype)).reshape(shape)


def bits_equal(a: Any, b: Any) -> bool:
    """True when two tensors or arrays have the same dtype, shape and bytes (NaN payloads and
    ``-0.0`` included, where ``==`` would say otherwise)."""
    ea, eb = from_any("a", a), from_any("b", b)
    return (ea.dtype == eb.dtype and ea.shape == eb.shape
            and bytes(byte_view(ea.data)) == bytes(byte_view(eb.data)))
