"""HDF5 checkpoints through h5py (installed as ``vcga.formats.hdf5``): Keras weight files and any h5py tree.

Every dataset in any group hierarchy becomes one tensor named by its path without the leading
'/' (``model_weights/dense/dense/kernel``). Chunked and compressed datasets (gzip, lzf, szip,
shuffle, fletcher32; more when the optional ``hdf5plugin`` package is installed), big-endian data
and scalar datasets read as little-endian C-order bytes, one dataset at a time (peak memory: one
tensor). The conventions for what HDF5 lacks -- bf16 and fp8 as labelled OPAQUE data, bool as
h5py's enum, complex as h5py's ``{r, i}`` compound or HDF5 2.0's native complex -- and for
attributes as metadata are specified in docs/convert.md ("HDF5 conventions").

Refused, with a :class:`~vcga.errors.VcgaFormatError` naming the dataset: strings, references,
variable-length, array and non-complex compound types, enums other than bool, null dataspaces,
and external links (a converter must not wander into other files).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vcga import dtypes
from vcga.contract import FormatSpec, TensorEntry, hookimpl
from vcga.errors import VcgaConversionError, VcgaFormatError
from vcga.formatkit import ReaderContext, WriterContext, entry_array
from vcga.tensors import check_entry

__all__ = ["Hdf5Reader", "Hdf5Writer", "sniff", "SPEC", "encode_attr", "decode_attr",
           "GROUPS_KEY", "DTYPE_ATTR", "ATTR_PREFIX"]

log = logging.getLogger(__name__)

NAME = "hdf5"
SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: Keras 3's attribute naming the real dtype of an OPAQUE dataset (``ds.attrs["dtype"] = "bfloat16"``).
DTYPE_ATTR = "dtype"
#: Dtypes stored as labelled OPAQUE data (HDF5 has no predefined type h5py can map to them).
OPAQUE_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
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
    except Exception:
        pass
    return h5py


def sniff(path: Any) -> bool:
    """The HDF5 superblock signature at 0 or at a user-block offset (512, 1024, 2048, 4096)."""
    try:
        with open(path, "rb") as f:
            for off in (0, 512, 1024, 2048, 4096):
                f.seek(off)
                if f.read(8) == SIGNATURE:
                    return True
    except OSError:
        return False
    return False


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
        val = text(arr.item()) if arr.ndim == 0 else [text(v) for v in arr.reshape(-1)]
        return ATTR_PREFIX + json.dumps({"dtype": kind, "shape": list(arr.shape), "value": val}, ensure_ascii=False,
                                         separators=(",", ":"))
    dt = np.dtype(dtype)
    if dt.kind not in "biufc":
        return None
    arr = np.asarray(value, dtype=dt)
    flat = arr.reshape(-1)
    if dt.kind == "c":
        val: Any = [[float(v.real), float(v.imag)] for v in flat]
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
        except Exception as e:  # an attribute h5py cannot read (unknown type, damaged heap)
            notes.append(f"attribute {name!r} of {path!r} is not readable ({_one_line(e)}); not kept")
            continue
        enc = encode_attr(value, aid.dtype, aid.shape)
        if enc is None:
            notes.append(f"attribute {name!r} of {path!r} has type {aid.dtype}, which VCGA does not keep")
            continue
        out[name] = enc
    return out


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------


#: How long the isolated structure scan may take before the file is declared unreadable
#: (fuzzing found damaged files that send libhdf5 into an endless loop). Env VCGA_HDF5_SCAN_TIMEOUT_S.
SCAN_TIMEOUT_S = 300.0


def _scan_isolated(reader: Hdf5Reader) -> None:
    """Run ``reader._scan()`` in a forked child and take its result.

    libhdf5 is C code that trusts the file: fuzzing found damaged attribute heaps that make it
    segfault, which no Python ``except`` can catch. The structure scan (groups, links, datatypes,
    attributes: where the damage showed) therefore runs in a child process; a crash or a hang there
    becomes a :class:`~vcga.errors.VcgaFormatError` here. Dataset reads, which follow the structure
    the child already parsed, stay in this process. Where ``fork`` is unavailable the scan runs here.
    """
    import select
    import signal
    import time

    if not hasattr(os, "fork"):
        reader._scan()
        return
    timeout = float(os.environ.get("VCGA_HDF5_SCAN_TIMEOUT_S", SCAN_TIMEOUT_S))
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: scan, report as JSON, exit without running any cleanup of the parent's state
        code = 0
        try:
            import faulthandler

            faulthandler.disable()  # a crash here is expected on damaged files; the parent reports it
            os.close(rfd)
            try:
                reader._scan()
                out: dict[str, Any] = {
                    "items": [[it.entry.name, it.entry.dtype, list(it.entry.shape), dict(it.entry.metadata), it.path,
                               it.mode] for it in reader._items],
                    "metadata": reader.metadata, "notes": reader.notes}
            except VcgaFormatError as e:
                out = {"error": str(e).removeprefix(f"{reader.path}: ")}
            except BaseException as e:  # noqa: BLE001 - report anything; the parent decides
                out = {"error": f"damaged HDF5 structure: {_one_line(e)}"}
            data = json.dumps(out).encode("utf-8")
            view = memoryview(data)
            while view:
                n = os.write(wfd, view)
                view = view[n:]
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                raise VcgaFormatError(reader.path, f"parsing the HDF5 structure did not finish within "
                                      f"{timeout:.0f} s; the file is damaged or hostile")
            ready, _, _ = select.select([rfd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(rfd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        raise VcgaFormatError(reader.path, f"the HDF5 library crashed (signal {sig}) while parsing the file's "
                              "structure; the file is damaged")
    try:
        out = json.loads(b"".join(chunks).decode("utf-8"))
    except ValueError:
        raise VcgaFormatError(reader.path, "the HDF5 structure scan ended without a result; the file is damaged") \
            from None
    if "error" in out:
        raise VcgaFormatError(reader.path, out["error"])
    reader.metadata = out["metadata"]
    reader.notes = out["notes"]
    reader._items = [_Item(TensorEntry(n, dt, tuple(shape), None, meta), path, mode)
                     for n, dt, shape, meta, path, mode in out["items"]]


class _Item:
    __slots__ = ("entry", "path", "mode")

    def __init__(self, entry: TensorEntry, path: str, mode: str) -> None:
        self.entry, self.path, self.mode = entry, path, mode


class Hdf5Reader(ReaderContext):
    """Streams every dataset of an HDF5 file, one at a time, in group order.

    Groups are walked in their own link order (creation order for files written with
    ``track_order``, which :class:`Hdf5Writer` uses; name order otherwise). A dataset reachable by
    two hard or soft links appears under both names.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        h5py = _h5py()
        if not self.path.is_file():
            raise VcgaFormatError(self.path, "no such file" if not self.path.exists() else "not a regular file")
        self.notes: list[str] = []
        self._items: list[_Item] = []
        self.metadata: dict[str, str] = {}
        _scan_isolated(self)
        for note in self.notes:
            log.warning("%s: %s: %s", NAME, self.path, note)
        try:
            self._file = h5py.File(self.path, "r", locking=False)
        except Exception as e:
            raise VcgaFormatError(self.path, f"not a readable HDF5 file: {_one_line(e)}") from None

    def _scan(self) -> None:
        """Walk every group, dataset and attribute (fills ``_items``, ``metadata``, ``notes``)."""
        h5py = _h5py()
        try:
            f = h5py.File(self.path, "r", locking=False)
        except Exception as e:
            raise VcgaFormatError(self.path, f"not a readable HDF5 file: {_one_line(e)}") from None
        try:
            groups: dict[str, dict[str, str]] = {}
            self._walk(f, "", groups, set())
            self.metadata = _encode_attrs(f, "/", notes=self.notes)
            if groups:
                self.metadata[GROUPS_KEY] = json.dumps(groups, ensure_ascii=False, separators=(",", ":"))
        except VcgaFormatError:
            raise
        except Exception as e:  # h5py raises OSError/KeyError/RuntimeError on a damaged tree
            raise VcgaFormatError(self.path, f"damaged HDF5 structure: {_one_line(e)}") from None
        finally:
            f.close()

    def _walk(self, group: Any, prefix: str, groups: dict[str, dict[str, str]], seen: set[Any]) -> None:
        h5py = _h5py()
        seen.add(group.id)
        for name in group:
            path = f"{prefix}{name}"
            link = group.get(name, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                raise VcgaFormatError(self.path, f"{path!r} is an external link to {link.filename}:{link.path}; "
                                      "VCGA does not follow links into other files (copy the data in first)")
            obj = group.get(name)
            if obj is None:
                raise VcgaFormatError(self.path, f"{path!r} is a dangling link")
            if isinstance(obj, h5py.Group):
                if isinstance(link, h5py.SoftLink) or obj.id in seen:
                    log.info("%s: %s: group %r is a second link to a group already walked; skipped", NAME,
                             self.path, path)
                    continue
                groups[path] = _encode_attrs(obj, path, notes=self.notes)
                self._walk(obj, path + "/", groups, seen)
            elif isinstance(obj, h5py.Dataset):
                self._items.append(self._describe(obj, path))
            # named datatypes (h5py.Datatype) carry no tensor

    def _describe(self, ds: Any, path: str) -> _Item:
        h5py = _h5py()
        if ds.shape is None:
            raise VcgaFormatError(self.path, f"dataset {path!r} has a null dataspace (no shape); it holds no tensor")
        tid = ds.id.get_type()
        cls = tid.get_class()
        size = tid.get_size()
        label = ds.attrs.get(DTYPE_ATTR) if DTYPE_ATTR in ds.attrs else None
        if isinstance(label, bytes):
            label = label.decode("utf-8", "replace")
        skip_attr = None
        if cls == h5py.h5t.INTEGER:
            signed = tid.get_sign() == h5py.h5t.SGN_2
            if size not in (1, 2, 4, 8):
                raise self._unsupported(path, f"{size * 8}-bit integers")
            dt, mode = f"{'int' if signed else 'uint'}{size * 8}", "numpy"
        elif cls == h5py.h5t.FLOAT:
            _, _, esize, _, msize = tid.get_fields()
            key = (size, esize, msize, tid.get_ebias())
            if key in _IEEE_FLOATS:
                dt, mode = _IEEE_FLOATS[key], "numpy"
            elif key in _CUSTOM_FLOATS:
                dt, mode = _CUSTOM_FLOATS[key], "raw-float"
                if label == dt:
                    skip_attr = DTYPE_ATTR
            else:
                raise self._unsupported(path, f"a {size}-byte float with {esize} exponent and {msize} mantissa bits")
        elif cls == h5py.h5t.ENUM:
            if ds.dtype != bool:
                raise self._unsupported(path, "an enum other than h5py's bool")
            dt, mode = "bool", "numpy"
        elif cls in (h5py.h5t.COMPOUND, getattr(h5py.h5t, "COMPLEX", -1)):
            if ds.dtype.kind != "c":
                raise self._unsupported(path, f"a compound type {ds.dtype}")
            dt, mode = {8: "complex64", 16: "complex128"}.get(ds.dtype.itemsize), "numpy"
            if dt is None:
                raise self._unsupported(path, f"complex numbers of {ds.dtype.itemsize} bytes")
        elif cls == h5py.h5t.OPAQUE:
            tag = tid.get_tag().decode("utf-8", "replace") if tid.get_tag() else ""
            names = [n for n in (tag, label) if n in OPAQUE_DTYPES]
            if not names or dtypes.get(names[0]).itemsize != size:
                raise self._unsupported(path, f"opaque data without a dtype label (tag {tag!r}, attribute "
                                        f"{DTYPE_ATTR}={label!r}); label bfloat16/fp8 data as docs/convert.md says")
            dt, mode = names[0], "raw"
            if label == dt:
                skip_attr = DTYPE_ATTR
        else:
            kinds = {h5py.h5t.STRING: "strings", h5py.h5t.VLEN: "variable-length data",
                     h5py.h5t.REFERENCE: "references", h5py.h5t.ARRAY: "an array type",
                     h5py.h5t.BITFIELD: "a bitfield", h5py.h5t.TIME: "a time type"}
            raise self._unsupported(path, kinds.get(cls, f"HDF5 type class {cls}"))
        meta = _encode_attrs(ds, path, skip=skip_attr, notes=self.notes)
        entry = TensorEntry(name=path, dtype=dt, shape=tuple(int(d) for d in ds.shape), data=None, metadata=meta)
        return _Item(entry, path, mode)

    def _unsupported(self, path: str, what: str) -> VcgaFormatError:
        return VcgaFormatError(self.path, f"dataset {path!r} holds {what}, which is not a tensor VCGA converts")

    def index(self) -> Sequence[TensorEntry]:
        return [it.entry for it in self._items]

    def _read(self, item: _Item) -> Any:
        import numpy as np

        h5py = _h5py()
        e = item.entry
        ds = self._file[item.path]
        if item.mode == "numpy":
            arr = np.empty(e.shape, dtype=dtypes.to_numpy(e.dtype))
            if arr.size:
                ds.read_direct(arr)  # HDF5 converts byte order and runs the filters
            return arr
        raw = np.empty(e.shape, dtype=np.dtype(f"<u{dtypes.get(e.dtype).itemsize}"))
        if raw.size:
            mtype = ds.id.get_type()
            if item.mode == "raw-float" and mtype.get_order() == h5py.h5t.ORDER_BE:
                mtype = mtype.copy()
                mtype.set_order(h5py.h5t.ORDER_LE)  # HDF5 swaps bytes only: same layout both sides
            ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=mtype)
        return raw

    def entries(self) -> Iterator[TensorEntry]:
        for item in self._items:
            try:
                arr = self._read(item)
            except Exception as e:
                msg = _one_line(e)
                hint = " (install hdf5plugin for this compression filter)" if "filter" in msg.lower() else ""
                raise VcgaFormatError(self.path, f"cannot read dataset {item.path!r}: {msg}{hint}") from None
            e = item.entry
            yield TensorEntry(e.name, e.dtype, e.shape, memoryview(arr).cast("B") if arr.size else b"", e.metadata)
            del arr  # let it go before the next read: one tensor in memory, not two

    def close(self) -> None:
        try:
            self._file.close()
        except Exception:
            pass



def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------


class Hdf5Writer(WriterContext):
    """Writes an HDF5 file atomically, one dataset per tensor, groups from '/' in names.

    :param path: the destination (appears only on :meth:`commit`).
    :param compression: ``None`` (contiguous datasets, the fastest), ``"gzip"`` or ``"lzf"``.
    :param compression_opts: gzip level 0-9.
    :param shuffle: byte-shuffle before compressing.
    """

    def __init__(self, path: str | os.PathLike[str], *, compression: str | None = None,
                 compression_opts: int | None = None, shuffle: bool = False,
                 publish_into: str | os.PathLike[str] | None = None) -> None:
        h5py = _h5py()
        self._init_outputs(publish_into)
        if compression not in (None, "gzip", "lzf"):
            raise VcgaConversionError(f"hdf5 compression must be gzip or lzf, not {compression!r}", target=NAME)
        self.path = Path(path)
        self._filters: dict[str, Any] = {}
        if compression:
            self._filters = {"compression": compression, "shuffle": bool(shuffle)}
            if compression_opts is not None:
                self._filters["compression_opts"] = int(compression_opts)
        self._af = self._open_output(self.path, "w+b")
        try:
            # HDF5 is given the file object, not a path: the output is an anonymous file (vcga.atomic),
            # and HDF5 resolves a path's real name, which /proc/self/fd/N does not have. (h5py's
            # file-object driver writes big datasets as fast as the path driver; docs/benchmarks.md.)
            # track_order: groups list their members in creation order, so a round trip keeps the order.
            self._h5 = h5py.File(self._af.file, "w", track_order=True)
        except BaseException:
            self.abort()
            raise
        self._metadata: dict[str, str] = {}

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        """File metadata: root attributes, plus the groups (and their attributes) listed under
        :data:`GROUPS_KEY`, created now so they keep the source's order."""
        self._check_open()
        self._metadata = dict(metadata)
        self._write_groups()

    def _group(self, parts: Sequence[str], full: str) -> Any:
        h5py = _h5py()
        g = self._h5
        for i, part in enumerate(parts):
            if part in g:
                nxt = g[part]
                if not isinstance(nxt, h5py.Group):
                    raise VcgaConversionError(
                        f"tensor {full!r} needs group {'/'.join(parts[:i + 1])!r}, but a tensor of that name was "
                        "already written; HDF5 names are paths, so one name cannot be both", tensor=full, target=NAME)
                g = nxt
            else:
                g = g.create_group(part, track_order=True)
        return g

    def write(self, entry: TensorEntry) -> None:
        import numpy as np

        self._check_open()
        name = entry.name
        parts = name.split("/")
        if not name or "\x00" in name or any(p in ("", ".") for p in parts):
            raise VcgaConversionError(
                f"tensor name {name!r} is not a valid HDF5 path (a NUL character, empty or '.' components, leading, "
                "trailing or doubled '/'); rename it before converting to hdf5", tensor=name, target=NAME)
        buf = check_entry(entry, target=NAME)
        group = self._group(parts[:-1], name)
        leaf = parts[-1]
        if leaf in group:
            raise VcgaConversionError(f"tensor {name!r} written twice (or is also a group)", tensor=name, target=NAME)
        shape = tuple(entry.shape)
        filters = self._filters if (self._filters and shape and entry.numel) else {}
        if entry.dtype in OPAQUE_DTYPES:
            # Exactly what Keras 3 writes for bf16: h5py's untagged OPAQUE type for numpy's void dtype
            # plus attrs["dtype"]. (A tag would make HDF5 refuse Keras' opaque-to-opaque read.)
            size = dtypes.get(entry.dtype).itemsize
            ds = group.create_dataset(leaf, shape=shape, dtype=np.dtype(f"V{size}"), **filters)
            if entry.numel:
                ds.write_direct(np.frombuffer(buf, dtype=np.dtype(f"V{size}")).reshape(shape))
            ds.attrs[DTYPE_ATTR] = entry.dtype
        else:
            arr = entry_array(entry, target=NAME)
            ds = group.create_dataset(leaf, shape=shape, dtype=arr.dtype, **filters)
            if entry.numel:
                ds.write_direct(np.ascontiguousarray(arr))
        for key, text in entry.metadata.items():
            if entry.dtype in OPAQUE_DTYPES and key == DTYPE_ATTR:
                continue
            _set_attr(ds, key, text, name)

    def _write_groups(self) -> None:
        meta = dict(self._metadata)
        raw = meta.pop(GROUPS_KEY, None)
        if raw is not None:
            try:
                groups = json.loads(raw)
                if not isinstance(groups, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                raise VcgaConversionError(f"metadata {GROUPS_KEY!r} is not a JSON object: {e}", target=NAME) from None
            for gpath, attrs in groups.items():
                parts = gpath.split("/")
                if any(p in ("", ".") for p in parts) or not isinstance(attrs, dict):
                    raise VcgaConversionError(f"metadata {GROUPS_KEY!r} names an invalid group {gpath!r}", target=NAME)
                g = self._group(parts, gpath)
                for key, text in attrs.items():
                    _set_attr(g, key, text, gpath)
        for key, text in meta.items():
            _set_attr(self._h5, key, text, "/")

    def _finish(self) -> None:
        self._h5.close()  # HDF5 writes its last metadata into the file object

    def _discard(self) -> None:
        h5 = getattr(self, "_h5", None)
        if h5 is not None:
            try:
                h5.close()
            except Exception:
                pass


def _set_attr(obj: Any, key: str, text: Any, where: str) -> None:
    if not isinstance(text, str):
        raise VcgaConversionError(f"metadata {key!r} of {where!r} is not a string", target=NAME)
    # HDF5 names and variable-length strings are C strings: a NUL would silently cut them short.
    if not key or "\x00" in key:
        raise VcgaConversionError(f"metadata key {key!r} of {where!r} cannot be an HDF5 attribute name "
                                  "(empty or containing NUL)", target=NAME)
    if "\x00" in text and not text.startswith(ATTR_PREFIX):
        raise VcgaConversionError(f"metadata {key!r} of {where!r} contains a NUL character, which HDF5 strings "
                                  "cannot hold", target=NAME)
    try:
        value, dt = decode_attr(text)
        if dt is None:
            obj.attrs[key] = value
        else:
            obj.attrs.create(key, value, dtype=dt)
    except (ValueError, KeyError, TypeError) as e:
        raise VcgaConversionError(f"metadata {key!r} of {where!r} is not a valid {ATTR_PREFIX} attribute: {e}",
                                  target=NAME) from None


SPEC = FormatSpec(
    name=NAME,
    extensions=(".h5", ".hdf5", ".hdf", ".he5"),
    dtypes=frozenset(dtypes.ALL),
    sniff=sniff,
    open_reader=Hdf5Reader,
    open_writer=Hdf5Writer,
    description="HDF5 through h5py: Keras weight files and any group tree; bf16/fp8 as labelled opaque data",
)


@hookimpl
def vcga_formats() -> list[FormatSpec]:
    return [SPEC]

