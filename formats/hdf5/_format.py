"""The HDF5 conventions both sides share: the names VCGA gives HDF5 things, the float layouts
it recognises, the lazy h5py import, and attributes <-> metadata strings (docs/convert.md,
"HDF5 conventions")."""

from __future__ import annotations

import json
from typing import Any

NAME = "hdf5"
SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: Keras 3's attribute naming the real dtype of an OPAQUE dataset (``ds.attrs["dtype"] = "bfloat16"``).
DTYPE_ATTR = "dtype"
#: Dtypes stored as labelled OPAQUE data (HDF5 has no predefined type h5py can map to them).
OPAQUE_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "float8_e8m0fnu", "float4_e2m1fn_x2")
#: File-level metadata key holding every non-root group and its attributes (JSON).
GROUPS_KEY = "hdf5.groups"
#: Prefix of an attribute value that is not a plain string (followed by JSON; see :func:`encode_attr`).
ATTR_PREFIX = "h5attr:"

#: (size, exponent bits, mantissa bits, exponent bias) of the float layouts HDF5 2.0 predefines
#: for bf16/fp8 (H5T_FLOAT_BFLOAT16LE, H5T_FLOAT_F8E4M3, H5T_FLOAT_F8E5M2) or another tool may write.
_CUSTOM_FLOATS = {
    (2, 8, 7, 127): "bfloat16",
    (1, 4, 3, 7): "float8_e4m3fn",
    (1, 5, 2, 15): "float8_e5m2",
}
_IEEE_FLOATS = {(2, 5, 10, 15): "float16", (4, 8, 23, 127): "float32", (8, 11, 52, 1023): "float64"}


def _h5py() -> Any:
    import h5py

    try:  # registers extra compression filters (blosc, zstd, bitshuffle, ...) when installed
        import hdf5plugin  # noqa: F401
    except Exception:  # noqa: BLE001 - optional: a broken install must not stop files that need no filter
        pass
    return h5py


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ---------------------------------------------------------------------------------------------------
# Attributes <-> metadata strings
# ---------------------------------------------------------------------------------------------------


def encode_attr(value: Any, dtype: Any, shape: tuple[int, ...] | None) -> str | None:
    """One attribute as a metadata string.

    A scalar UTF-8 string that does not start with :data:`ATTR_PREFIX` is kept as it is; anything
    else becomes ``ATTR_PREFIX + JSON {"dtype", "shape", "value"}`` so the writer recreates the same
    HDF5 type and shape (bytes as latin-1 text, complex as [re, im], NaN/Infinity as JSON extensions).
    Returns None for types with no faithful encoding (references, compounds); the caller logs them.
    """
    import numpy as np

    h5py = _h5py()
    if isinstance(value, h5py.Empty):
        return ATTR_PREFIX + json.dumps({"dtype": np.dtype(dtype).str, "empty": True}, separators=(",", ":"))
    sinfo = h5py.check_string_dtype(dtype)
    if sinfo is not None:
        if sinfo.length is None:
            kind = "vlen-utf8" if sinfo.encoding == "utf-8" else "vlen-ascii"
        else:
            kind = np.dtype(dtype).str
        if shape == () and isinstance(value, str) and kind == "vlen-utf8" and not value.startswith(ATTR_PREFIX):
            return value

        def text(v: Any) -> str:
            return v.decode("latin-1") if isinstance(v, bytes) else str(v)

        arr = np.asarray(value, dtype=object)
        val: Any = text(arr.item()) if arr.ndim == 0 else [text(v) for v in arr.reshape(-1)]
        return ATTR_PREFIX + json.dumps({"dtype": kind, "shape": list(arr.shape), "value": val}, ensure_ascii=False,
                                         separators=(",", ":"))
    dt = np.dtype(dtype)
    if dt.kind not in "biufc":
        return None
    arr = np.asarray(value, dtype=dt)
    flat = arr.reshape(-1)
    if dt.kind == "c":
        val = [[float(v.real), float(v.imag)] for v in flat]
    elif dt.kind == "f":
        val = [float(v) for v in flat]
    elif dt.kind == "b":
        val = [bool(v) for v in flat]
    else:
        val = [int(v) for v in flat]
    return ATTR_PREFIX + json.dumps({"dtype": dt.str, "shape": list(arr.shape), "value": val}, separators=(",", ":"))


def decode_attr(text: str) -> tuple[Any, Any]:
    """``(value, dtype or None)`` to pass to ``attrs.create`` -- the inverse of :func:`encode_attr`.

    :raises ValueError: a prefixed value that is not valid JSON of the expected shape.
    """
    import numpy as np

    h5py = _h5py()
    if not text.startswith(ATTR_PREFIX):
        return text, h5py.string_dtype("utf-8")
    spec = json.loads(text[len(ATTR_PREFIX):])
    kind = spec["dtype"]
    if spec.get("empty"):
        return h5py.Empty(np.dtype(kind)), None
    shape = tuple(spec["shape"])
    val = spec["value"]
    if kind in ("vlen-utf8", "vlen-ascii"):
        dt = h5py.string_dtype("utf-8" if kind == "vlen-utf8" else "ascii")
        if kind == "vlen-ascii":
            val = [v.encode("latin-1") for v in val] if shape else val.encode("latin-1")
        arr = np.array(val, dtype=object).reshape(shape) if shape else np.array(val, dtype=dt)
        return arr, dt
    dt = np.dtype(kind)
    if dt.kind == "S":
        vals = [v.encode("latin-1") for v in val] if shape else val.encode("latin-1")
        return np.array(vals, dtype=dt).reshape(shape), dt
    if dt.kind == "c":
        val = [complex(re, im) for re, im in val]
    return np.array(val, dtype=dt).reshape(shape), dt


def _encode_attrs(obj: Any, path: str, skip: str | None = None, notes: list[str] | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    notes = [] if notes is None else notes
    for name in obj.attrs:
        if name == skip:
            continue
        aid = obj.attrs.get_id(name)
        try:
            value = obj.attrs[name]
        except Exception as e:  # noqa: BLE001 - an attribute h5py cannot read (unknown type, damaged heap): a note
            notes.append(f"attribute {name!r} of {path!r} is not readable ({_one_line(e)}); not kept")
            continue
        enc = encode_attr(value, aid.dtype, aid.shape)
        if enc is None:
            notes.append(f"attribute {name!r} of {path!r} has type {aid.dtype}, which VCGA does not keep")
            continue
        out[name] = enc
    return out
