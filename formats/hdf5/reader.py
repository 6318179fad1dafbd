"""Reading HDF5: the structure scanned in a forked child (libhdf5 may crash on damaged files),
then every dataset streamed one at a time."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vcga import dtypes, formatkit
from vcga.contract import TensorEntry
from vcga.errors import VcgaFormatError
from vcga.formatkit import ReaderContext, check_regular_file, check_tensor_memory

from ._format import (
    _CUSTOM_FLOATS,
    _IEEE_FLOATS,
    DTYPE_ATTR,
    GROUPS_KEY,
    NAME,
    OPAQUE_DTYPES,
    _encode_attrs,
    _h5py,
    _one_line,
)

log = logging.getLogger("vcga.formats.hdf5")  # the package's name, the one users configure for HDF5 messages


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------


#: How long the isolated structure scan may take before the file is declared unreadable
#: (fuzzing found damaged files that send libhdf5 into an endless loop). Env VCGA_HDF5_SCAN_TIMEOUT_S.
SCAN_TIMEOUT_S = 300.0
#: How deep soft links may point through other soft links (HDF5's own default, H5L_NUM_LINKS).
MAX_SOFT_LINK_DEPTH = 16


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
        check_regular_file(self.path)
        self.notes: list[str] = []
        self._items: list[_Item] = []
        self.metadata: dict[str, str] = {}
        _scan_isolated(self)
        for note in self.notes:
            log.warning("%s: %s: %s", NAME, self.path, note)
        try:
            self._file = h5py.File(self.path, "r", locking=False)
        except Exception as e:  # noqa: BLE001 - h5py's errors for a bad file are many: one typed error
            raise VcgaFormatError(self.path, f"not a readable HDF5 file: {_one_line(e)}") from None

    def _scan(self) -> None:
        """Walk every group, dataset and attribute (fills ``_items``, ``metadata``, ``notes``)."""
        h5py = _h5py()
        try:
            f = h5py.File(self.path, "r", locking=False)
        except Exception as e:  # noqa: BLE001 - h5py's errors for a bad file are many: one typed error
            raise VcgaFormatError(self.path, f"not a readable HDF5 file: {_one_line(e)}") from None
        try:
            groups: dict[str, dict[str, str]] = {}
            self._walk(f, "", groups, set())
            self.metadata = _encode_attrs(f, "/", notes=self.notes)
            if groups:
                self.metadata[GROUPS_KEY] = json.dumps(groups, ensure_ascii=False, separators=(",", ":"))
        except VcgaFormatError:
            raise
        except Exception as e:  # noqa: BLE001 - h5py raises OSError/KeyError/RuntimeError on a damaged tree
            raise VcgaFormatError(self.path, f"damaged HDF5 structure: {_one_line(e)}") from None
        finally:
            f.close()

    def _walk(self, group: Any, prefix: str, groups: dict[str, dict[str, str]], seen: set[Any]) -> None:
        h5py = _h5py()
        seen.add(group.id)
        for name in group:
            path = f"{prefix}{name}"
            link = group.get(name, getlink=True)
            if isinstance(link, h5py.HardLink):
                obj, hard = group.get(name), path
            elif isinstance(link, h5py.SoftLink):
                hard_parts = self._follow(group.file, prefix.rstrip("/").split("/") if prefix else [], link.path,
                                          path, 0)
                hard = "/".join(hard_parts)
                obj = group.file[f"/{hard}"] if hard_parts else group.file
            else:
                raise self._foreign_link(path, link)
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
                if len(self._items) >= formatkit.MAX_TENSORS:
                    raise VcgaFormatError(self.path, f"holds more than {formatkit.MAX_TENSORS} datasets, the most "
                                          "VCGA reads from one checkpoint (vcga.formatkit.MAX_TENSORS)")
                item = self._describe(obj, path)
                item.path = hard
                self._items.append(item)
            # named datatypes (h5py.Datatype) carry no tensor

    def _foreign_link(self, path: str, link: Any) -> VcgaFormatError:
        h5py = _h5py()
        if isinstance(link, h5py.ExternalLink):
            return VcgaFormatError(self.path, f"{path!r} is an external link to {link.filename}:{link.path}; "
                                   "VCGA does not follow links into other files (copy the data in first)")
        return VcgaFormatError(self.path, f"{path!r} is a user-defined link ({type(link).__name__}); VCGA follows "
                               "hard and soft links only")

    def _follow(self, f: Any, base: list[str], target: str, shown: str, depth: int) -> list[str]:
        """The hard-link path (components from the root) a soft link's ``target`` leads to, from the
        group at ``base``: followed one component at a time through hard and soft links only, so
        that a soft link through an external link is refused before that other file is opened."""
        if depth >= MAX_SOFT_LINK_DEPTH:
            raise VcgaFormatError(self.path, f"soft link {shown!r} leads through more than {MAX_SOFT_LINK_DEPTH} "
                                  "soft links")
        h5py = _h5py()
        parts = [] if target.startswith("/") else list(base)
        for comp in target.split("/"):
            if comp in ("", "."):
                continue
            here = f[f"/{'/'.join(parts)}"] if parts else f  # hard links only, checked on the way here
            link = here.get(comp, getlink=True) if isinstance(here, h5py.Group) else None
            if link is None:
                raise VcgaFormatError(self.path, f"{shown!r} is a dangling link (to {target!r})")
            if isinstance(link, h5py.HardLink):
                parts.append(comp)
            elif isinstance(link, h5py.SoftLink):
                parts = self._follow(f, parts, link.path, shown, depth + 1)
            else:
                raise self._foreign_link(f"{shown} (through {'/'.join([*parts, comp])})", link)
        return parts

    def _describe(self, ds: Any, path: str) -> _Item:
        h5py = _h5py()
        self._check_in_file(ds, path)
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
            complex_dt = {8: "complex64", 16: "complex128"}.get(ds.dtype.itemsize)
            if complex_dt is None:
                raise self._unsupported(path, f"complex numbers of {ds.dtype.itemsize} bytes")
            dt, mode = complex_dt, "numpy"
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

    def _check_in_file(self, ds: Any, path: str) -> None:
        """Refuse a dataset whose bytes HDF5 would read from another file: external raw storage
        (``external=[(file, offset, size)]``) or a virtual dataset. Reads the dataset's creation
        properties only: no byte of data, and no other file is opened."""
        h5py = _h5py()
        dcpl = ds.id.get_create_plist()
        count = dcpl.get_external_count()
        if count:
            name = dcpl.get_external(0)[0].decode("utf-8", "replace")
            more = f" and {count - 1} more" if count > 1 else ""
            raise VcgaFormatError(self.path, f"dataset {path!r} keeps its bytes in another file, {name!r}{more} "
                                  "(HDF5 external storage); VCGA reads only what is inside the file it is given "
                                  "(copy the data into the file first)")
        if dcpl.get_layout() == h5py.h5d.VIRTUAL:
            n = dcpl.get_virtual_count()
            where = "no source"
            if n:
                file, dset = dcpl.get_virtual_filename(0), dcpl.get_virtual_dsetname(0)
                where = f"{dset!r} in " + ("this same file" if file == "." else repr(file))
            more = f" and {n - 1} more" if n > 1 else ""
            raise VcgaFormatError(self.path, f"dataset {path!r} is a virtual dataset mapped onto {where}{more}; "
                                  "VCGA reads only datasets stored in the file it is given (copy the data into "
                                  "the file first)")

    def _unsupported(self, path: str, what: str) -> VcgaFormatError:
        return VcgaFormatError(self.path, f"dataset {path!r} holds {what}, which is not a tensor VCGA converts")

    def index(self) -> Sequence[TensorEntry]:
        return [it.entry for it in self._items]

    def _read(self, item: _Item) -> Any:
        import numpy as np

        h5py = _h5py()
        e = item.entry
        ds = self._file[item.path]
        self._check_in_file(ds, e.name)  # as the scan found it; the file could have changed since
        if e.nbytes:
            check_tensor_memory(self.path, e.name, e.nbytes, stored=ds.id.get_storage_size())
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
            except VcgaFormatError:
                raise
            except Exception as e:  # noqa: BLE001 - a damaged dataset or missing filter: one typed error
                msg = _one_line(e)
                hint = " (install hdf5plugin for this compression filter)" if "filter" in msg.lower() else ""
                raise VcgaFormatError(self.path, f"cannot read dataset {item.path!r}: {msg}{hint}") from None
            entry = item.entry
            yield TensorEntry(entry.name, entry.dtype, entry.shape, memoryview(arr).cast("B") if arr.size else b"",
                              entry.metadata)
            del arr  # let it go before the next read: one tensor in memory, not two

    def close(self) -> None:
        try:
            self._file.close()
        except Exception:  # noqa: BLE001 - closing a damaged file must not mask the error that ended the read
            pass
