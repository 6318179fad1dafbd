"""Reading a torch.distributed.checkpoint (DCP) directory as one stream of whole tensors, without torch.

``vcga convert ckpt/step-100 model.safetensors`` and ``vcga inspect ckpt/step-100`` open DCP
directories in both layouts:

- **torch's** ``FileSystemWriter``: ``.metadata`` plus ``__<rank>_<n>.distcp`` files in which every
  tensor chunk is a complete ``torch.save`` archive (an uncompressed zip: a tiny pickle naming
  the storage, and the storage's bytes) at the offset ``.metadata`` records;
- **VCGA's** (:mod:`vcga.checkpoint`): ``.metadata`` plus per-rank vendor-bin files, and a
  checksummed manifest; every chunk is a checksummed vendor-bin tensor.

DCP shards a tensor into chunks (FSDP and DTensor shards, one per rank; a replicated DDP tensor is
written once). The reader checks that the chunks of every tensor tile it exactly -- in bounds, no
overlap, nothing missing -- and that every file they name exists, before yielding anything; then it
assembles one tensor at a time (one tensor's memory plus one chunk's pages; the pages of every
chunk are released after use), byte for byte: chunks are copied as raw bytes, never through a
float conversion, so NaN payloads and ``-0.0`` survive.

Nothing in the directory is executed: ``.metadata`` is unpickled with DCP's metadata classes only
(:mod:`vcga.checkpoint.dcpmeta`), and each chunk's pickle with torch's tensor-rebuild calls only,
mapped to local stand-ins. Non-tensor values (optimizer hyper-parameters, step counters) are kept
as JSON in the file metadata key ``dcp.objects`` when they are plain data, and listed in a note
otherwise. This module imports neither torch nor any format plugin at import time.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from vcga import dtypes, formatkit
from vcga.contract import FormatSpec, TensorEntry
from vcga.errors import VcgaChecksumError, VcgaConversionError, VcgaFormatError
from vcga.formatkit import ReaderContext, check_tensor_memory, is_plain_name, named_file, open_regular
from vcga.plugin_manager import get_plugin_manager

from .dcpmeta import (
    MANIFEST_FILE,
    METADATA_FILE,
    BytesStorageMetadata,
    StorageInfo,
    TensorStorageMetadata,
    VbinItem,
    load_manifest,
    load_metadata,
    metadata_checksum,
)

__all__ = ["DcpDirectoryReader", "is_dcp_directory", "open_reader", "DCP_SPEC", "FORMAT_NAME"]

FORMAT_NAME = "dcp"
_MAX_PICKLE = 1 << 20  # a chunk's own pickle names one storage: a few hundred bytes
#: A kilobyte for each of vcga.formatkit.MAX_TENSORS tensors (DCP pickles one in a few hundred bytes).
_MAX_METADATA = 1 << 28
_MAX_MANIFEST = 1 << 26
#: Chunks of one tensor that do not form a grid are checked pairwise for overlap, up to this many.
_MAX_IRREGULAR_CHUNKS = 2048

# torch's legacy typed storages (torch.save of the classic dtypes) and the dtype each holds.
_TYPED_STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
}


def is_dcp_directory(path: Any) -> bool:
    """A directory holding DCP's ``.metadata`` (never raises). Whatever that entry is: the reader
    refuses one that is not a regular file in the directory, saying why."""
    try:
        p = Path(path)
        return p.is_dir() and os.path.lexists(p / METADATA_FILE)
    except (OSError, TypeError, ValueError):
        return False


def _plain_name(name: object) -> TypeGuard[str]:
    return is_plain_name(name) and Path(name).name == name


def _read_small(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file ``path``, None when it is larger than ``limit``."""
    with os.fdopen(open_regular(path), "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            return None
        data = f.read(limit + 1)
    return data if len(data) <= limit else None


# --------------------------------------------------------------------------------------------------
# One torch.save archive (a chunk of torch's layout), torch-free
# --------------------------------------------------------------------------------------------------


class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (zipfile reads the archive through it)."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self.view) - self.pos)
        if n <= 0:
            return 0
        b[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.view)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos


class _StorageRef:
    def __init__(self, dtype: str | None, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel  # dtype None: untyped (numel in bytes)


class _TensorRef:
    def __init__(self, storage: _StorageRef, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                 dtype: str) -> None:
        self.storage, self.offset, self.size, self.stride, self.dtype = storage, offset, size, stride, dtype


class _Dtype(str):
    pass


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, (tuple, list)) or not all(type(v) is int and v >= 0 for v in x):
        raise pickle.UnpicklingError(f"{what} is not a tuple of non-negative integers")
    return tuple(x)


def _no_hooks(hooks: Any) -> None:
    if hooks:
        raise pickle.UnpicklingError("refused: the tensor carries backward hooks")


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                hooks: Any = None, metadata: Any = None) -> _TensorRef:
    _no_hooks(hooks)
    if not isinstance(storage, _StorageRef) or storage.dtype is None or type(offset) is not int:
        raise pickle.UnpicklingError("_rebuild_tensor_v2 without a typed storage")
    return _TensorRef(storage, offset, _ints(size, "size"), _ints(stride, "stride"), storage.dtype)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                dtype: Any, metadata: Any = None) -> _TensorRef:
    _no_hooks(hooks)
    if not isinstance(storage, _StorageRef) or not isinstance(dtype, _Dtype) or type(offset) is not int:
        raise pickle.UnpicklingError("_rebuild_tensor_v3 without a storage and a dtype")
    return _TensorRef(storage, offset, _ints(size, "size"), _ints(stride, "stride"), str(dtype))


class _StorageType:
    def __init__(self, dtype: str | None) -> None:
        self.dtype = dtype


class _TensorUnpickler(pickle.Unpickler):
    """torch.save's pickle of one tensor (or of plain data), with nothing but stand-ins callable."""

    def __init__(self, data: bytes, *, allow_tensor: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.allow_tensor = allow_tensor

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if self.allow_tensor:
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return _rebuild_v2
            if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
                return _rebuild_v3
            if module == "torch" and name in _TYPED_STORAGES:
                return _StorageType(_TYPED_STORAGES[name])
            if (module, name) == ("torch.storage", "UntypedStorage"):
                return _StorageType(None)
            if module == "torch" and name in dtypes.DTYPES:
                return _Dtype(name)
        raise pickle.UnpicklingError(f"refused: needs {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not self.allow_tensor:
            raise pickle.UnpicklingError("refused: holds a tensor")
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str) or type(pid[4]) is not int):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")
        return _StorageRef(pid[1].dtype, pid[2], pid[4])


def _zip_records(view: memoryview, where: str) -> tuple[zipfile.ZipFile, str]:
    try:
        zf = zipfile.ZipFile(io.BufferedReader(_ViewFile(view)))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise VcgaFormatError(where, f"is not a torch.save archive ({e})") from None
    pkl = [i.filename for i in zf.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(pkl) != 1:
        raise VcgaFormatError(where, "torch.save archive without exactly one data.pkl")
    return zf, pkl[0][: -len("data.pkl")]


def _record_bytes(zf: zipfile.ZipFile, name: str, view: memoryview, where: str) -> memoryview:
    """A stored record's bytes as a view of the archive (no copy)."""
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise VcgaFormatError(where, f"torch.save archive lacks record {name!r}") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise VcgaFormatError(where, f"record {name!r} is compressed; torch.save stores records uncompressed")
    h = info.header_offset
    head = bytes(view[h:h + 30])
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise VcgaFormatError(where, f"record {name!r}: bad local header", offset=h)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    start = h + 30 + name_len + extra_len
    if start + info.file_size > len(view):
        raise VcgaFormatError(where, f"record {name!r} runs past the end of its chunk", offset=start)
    return view[start:start + info.file_size]


def _torch_tensor_chunk(view: memoryview, where: str) -> tuple[str, tuple[int, ...], memoryview, Any]:
    """(dtype, shape, raw storage bytes, numpy uint8 array of the tensor's bytes in C order with a
    trailing itemsize axis -- a strided view, nothing copied)."""
    import numpy as np

    zf, prefix = _zip_records(view, where)
    with zf:
        if prefix + "byteorder" in zf.namelist() and zf.read(prefix + "byteorder") != b"little":
            raise VcgaFormatError(where, "a big-endian torch.save archive; re-save it on a little-endian host")
        info = zf.getinfo(prefix + "data.pkl")
        if info.file_size > _MAX_PICKLE:
            raise VcgaFormatError(where, f"a chunk's pickle of {info.file_size} bytes; expected one tensor")
        try:
            ref = _TensorUnpickler(zf.read(prefix + "data.pkl"), allow_tensor=True).load()
        except pickle.UnpicklingError as e:
            raise VcgaFormatError(where, f"chunk pickle {e}; a DCP chunk is one plain tensor. VCGA never runs code "
                                  "from a checkpoint") from None
        except (EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError,
                zipfile.BadZipFile) as e:
            raise VcgaFormatError(where, f"chunk pickle is damaged ({type(e).__name__}: {str(e)[:120]})") from None
        if not isinstance(ref, _TensorRef):
            raise VcgaFormatError(where, "chunk pickle does not hold a tensor")
        raw = _record_bytes(zf, f"{prefix}data/{ref.storage.key}", view, where)
    if ref.dtype not in dtypes.DTYPES:
        raise VcgaFormatError(where, f"chunk has dtype {ref.dtype}, which VCGA does not hold")
    itemsize = dtypes.get(ref.dtype).itemsize
    storage_bytes = ref.storage.numel * (itemsize if ref.storage.dtype is not None else 1)
    if storage_bytes != raw.nbytes or len(ref.size) != len(ref.stride):
        raise VcgaFormatError(where, f"chunk storage is {raw.nbytes} bytes where its pickle says {storage_bytes}")
    numel = 1
    for s in ref.size:
        numel *= s
    if numel:
        last = ref.offset + sum((s - 1) * st for s, st in zip(ref.size, ref.stride, strict=True))
        if (last + 1) * itemsize > raw.nbytes:
            raise VcgaFormatError(where, "chunk view runs past its storage")
        base = np.frombuffer(raw, dtype=np.uint8)
        arr = np.lib.stride_tricks.as_strided(
            base[ref.offset * itemsize:], shape=(*ref.size, itemsize),
            strides=(*(st * itemsize for st in ref.stride), 1), writeable=False)
    else:
        arr = np.empty((*ref.size, itemsize), dtype=np.uint8)
    return ref.dtype, ref.size, raw, arr


def _plain_object(data: bytes, where: str) -> Any:
    """A non-tensor value saved with torch.save, if it is plain data (else VcgaFormatError)."""
    view = memoryview(data)
    zf, prefix = _zip_records(view, where)
    with zf:
        info = zf.getinfo(prefix + "data.pkl")
        if info.file_size > _MAX_PICKLE:
            raise VcgaFormatError(where, "value too large to keep as metadata")
        try:
            return _TensorUnpickler(zf.read(prefix + "data.pkl"), allow_tensor=False).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
                RecursionError, zipfile.BadZipFile) as e:
            raise VcgaFormatError(where, f"value is not plain data ({str(e)[:120]})") from None


# --------------------------------------------------------------------------------------------------
# The directory
# --------------------------------------------------------------------------------------------------


class _Tensor:
    def __init__(self, fqn: str, dtype: str, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...],
                 tuple[int, ...], Any]]) -> None:
        self.fqn, self.dtype, self.shape, self.chunks = fqn, dtype, shape, chunks


class DcpDirectoryReader(ReaderContext):
    """A :class:`~vcga.contract.FormatReader` over a DCP checkpoint directory (either layout).

    Opening reads ``.metadata`` (and the manifest of a VCGA checkpoint, whose checksum of
    ``.metadata`` must match), checks that every tensor's chunks tile it and that every file they
    name exists. :meth:`entries` yields each tensor whole, assembled from its chunks.

    :param verify: check the checksum of every vendor-bin chunk as it is read (VCGA layout).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True, **_options: Any) -> None:
        self.path = Path(path)
        self.verify = verify
        self.notes: list[str] = []
        self._maps: dict[str, tuple[mmap.mmap | None, memoryview]] = {}
        self._vbin: dict[str, Any] = {}
        if not self.path.is_dir():
            raise VcgaFormatError(self.path, "is not a directory")
        meta_path = named_file(self.path, METADATA_FILE, source=self.path, what="DCP metadata")
        if not meta_path.exists():
            raise VcgaFormatError(self.path, f"holds no {METADATA_FILE}: not a torch.distributed.checkpoint "
                                  "directory (or its save did not finish)")
        raw = _read_small(meta_path, _MAX_METADATA)
        if raw is None:
            raise VcgaFormatError(meta_path, f"is larger than {_MAX_METADATA >> 20} MiB, more than the metadata of "
                                  f"{formatkit.MAX_TENSORS} tensors (vcga.formatkit.MAX_TENSORS); not DCP metadata")
        self.manifest: dict[str, Any] | None = None
        manifest_path = named_file(self.path, MANIFEST_FILE, source=self.path, what="checkpoint manifest")
        if manifest_path.exists():
            manifest = _read_small(manifest_path, _MAX_MANIFEST)
            if manifest is None:
                raise VcgaFormatError(manifest_path, f"is larger than {_MAX_MANIFEST >> 20} MiB; not a VCGA manifest")
            self.manifest = load_manifest(manifest, manifest_path)
            got = metadata_checksum(raw)
            if got != self.manifest["metadata"]["checksum"]:
                raise VcgaChecksumError(meta_path, f"checksum mismatch (computed {got}); the file was damaged after "
                                        "it was written", expected=self.manifest["metadata"]["checksum"])
        md = load_metadata(raw, where=meta_path)
        if len(md.state_dict_metadata) > formatkit.MAX_TENSORS:
            raise VcgaFormatError(meta_path, f"lists {len(md.state_dict_metadata)} entries, more than the "
                                  f"{formatkit.MAX_TENSORS} tensors VCGA reads from one checkpoint "
                                  "(vcga.formatkit.MAX_TENSORS)")
        self.layout = "vcga" if self.manifest is not None else "torch"
        self._tensors: list[_Tensor] = []
        self._objects: dict[str, Any] = {}
        storage = {}
        for idx, loc in md.storage_data.items():
            fqn, offset = getattr(idx, "fqn", None), getattr(idx, "offset", None)
            storage[(fqn, tuple(offset) if offset is not None else None)] = loc
        files: set[str] = set()
        for fqn, item in md.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise VcgaFormatError(meta_path, f"state dict key {fqn!r} is not a string")
            if isinstance(item, BytesStorageMetadata):
                loc = storage.get((fqn, None))
                if loc is None:
                    raise VcgaFormatError(meta_path, f"value {fqn!r} has no storage entry")
                files.add(self._check_location(loc, fqn, meta_path))
                self._objects[fqn] = loc
                continue
            if not isinstance(item, TensorStorageMetadata):
                raise VcgaFormatError(meta_path, f"entry {fqn!r} is a {type(item).__name__}")
            self._tensors.append(self._plan_tensor(fqn, item, storage, files, meta_path))
        self._files = {f: named_file(self.path, f, source=meta_path, what="shard file") for f in sorted(files)}
        missing = sorted(f for f, p in self._files.items() if not p.exists())
        if missing:
            raise VcgaFormatError(self.path, f"shard file {missing[0]} is missing"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                                  + "; the checkpoint is incomplete", expected=f"{missing[0]} beside {METADATA_FILE}")
        if self.manifest is not None:
            for f in self.manifest["files"]:
                p = named_file(self.path, f["file"], source=manifest_path, what="shard file")
                if not p.exists():
                    raise VcgaFormatError(self.path, f"shard file {f['file']} is missing; the checkpoint is incomplete")
                if p.stat().st_size != f["size"]:
                    raise VcgaFormatError(p, f"is {p.stat().st_size} bytes where the manifest says {f['size']}; it "
                                          "was truncated or replaced")
        self.metadata: dict[str, str] = {"dcp.layout": self.layout,
                                         "dcp.version": str(getattr(md, "version", ""))}
        if self.manifest is not None:
            self.metadata["vcga.step"] = str(self.manifest["step"])
        self._load_objects()

    # -- planning ----------------------------------------------------------------------------------

    def _check_location(self, loc: Any, fqn: str, where: Path) -> str:
        name: str | None
        if isinstance(loc, VbinItem):
            name = loc.relative_path
        elif isinstance(loc, StorageInfo):
            name = getattr(loc, "relative_path", None)
            transforms = getattr(loc, "transform_descriptors", None)
            if transforms:
                raise VcgaFormatError(where, f"{fqn!r} was written through stream transforms "
                                      f"{transforms}; VCGA reads untransformed DCP files only")
            off, length = getattr(loc, "offset", None), getattr(loc, "length", None)
            if type(off) is not int or type(length) is not int or off < 0 or length < 0:
                raise VcgaFormatError(where, f"{fqn!r}: bad storage offset/length")
        else:
            raise VcgaFormatError(where, f"{fqn!r}: unknown storage entry {type(loc).__name__}")
        if not _plain_name(name):
            raise VcgaFormatError(where, f"{fqn!r} names file {name!r}, which is not a plain file name in the "
                                  "checkpoint directory")
        return name

    def _plan_tensor(self, fqn: str, item: Any, storage: dict[Any, Any], files: set[str], where: Path) -> _Tensor:
        dtype = str(getattr(getattr(item, "properties", None), "dtype", ""))
        if dtype not in dtypes.DTYPES:
            raise VcgaFormatError(where, f"tensor {fqn!r} has dtype {dtype or '?'}, which VCGA does not hold")
        shape = getattr(item, "size", None)
        if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
            raise VcgaFormatError(where, f"tensor {fqn!r}: bad size {shape!r}")
        chunks = []
        volume = 0
        for c in getattr(item, "chunks", None) or []:
            off, size = tuple(getattr(c, "offsets", ()) or ()), tuple(getattr(c, "sizes", ()) or ())
            if (len(off) != len(shape) or len(size) != len(shape)
                    or not all(type(v) is int and v >= 0 for v in (*off, *size))
                    or any(o + s > d for o, s, d in zip(off, size, shape, strict=True))):
                raise VcgaFormatError(where, f"tensor {fqn!r}: chunk at {list(off)} of size {list(size)} lies outside "
                                      f"its shape {list(shape)}")
            loc = storage.get((fqn, off))
            if loc is None:
                raise VcgaFormatError(where, f"tensor {fqn!r}: the chunk at offsets {list(off)} has no storage entry "
                                      "(a shard is missing from the metadata)")
            files.add(self._check_location(loc, fqn, where))
            n = 1
            for s in size:
                n *= s
            volume += n
            chunks.append((off, size, loc))
        numel = 1
        for d in shape:
            numel *= d
        # Chunks within bounds whose volumes add up to the tensor's and that do not overlap tile it.
        regular = volume == numel and _grid(shape, chunks)
        if volume == numel and not regular and len(chunks) > _MAX_IRREGULAR_CHUNKS:
            raise VcgaFormatError(where, f"tensor {fqn!r}: its {len(chunks)} chunks do not form a grid; VCGA checks "
                                  f"at most {_MAX_IRREGULAR_CHUNKS} irregular chunks of a tensor for overlap")
        if volume != numel or (not regular and _overlap(chunks)):
            raise VcgaFormatError(where, f"tensor {fqn!r}: its {len(chunks)} chunks do not tile shape {list(shape)} "
                                  f"({volume} elements for {numel}{', overlapping' if volume == numel else ''}); a "
                                  "shard is missing or duplicated")
        return _Tensor(fqn, dtype, shape, chunks)

    def _load_objects(self) -> None:
        kept: dict[str, Any] = {}
        dropped = []
        for fqn, loc in self._objects.items():
            try:
                value = _plain_object(bytes(self._item_bytes(loc, fqn)), f"{self.path}: value {fqn!r}")
                json.dumps(value)
                kept[fqn] = value
            except (VcgaFormatError, TypeError, ValueError):
                dropped.append(fqn)
            finally:
                self._release_all()
        if kept:
            self.metadata["dcp.objects"] = json.dumps(kept, sort_keys=True)
        if dropped:
            self.notes.append(f"{len(dropped)} non-tensor value(s) are not plain data and were not kept: "
                              f"{', '.join(dropped[:5])}{' ...' if len(dropped) > 5 else ''}")

    # -- FormatReader --------------------------------------------------------------------------------

    def index(self) -> list[TensorEntry]:
        return [TensorEntry(t.fqn, t.dtype, t.shape, None, {}, _whole_checksum(t)) for t in self._tensors]

    def entries(self) -> Iterator[TensorEntry]:
        for t in self._tensors:
            try:
                data = self._assemble(t)
                yield TensorEntry(t.fqn, t.dtype, t.shape, data, {}, _whole_checksum(t))
            finally:
                self._release_all()

    def close(self) -> None:
        for mm, view in self._maps.values():
            view.release()
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass
        self._maps.clear()
        for r in self._vbin.values():
            r.close()
        self._vbin.clear()

    # -- reading chunks ------------------------------------------------------------------------------

    def _assemble(self, t: _Tensor) -> Any:
        import numpy as np

        itemsize = dtypes.get(t.dtype).itemsize
        # A chunk of torch's layout may view its storage with zero strides: a few stored bytes can
        # declare a tensor of any size, which is built here whole.
        check_tensor_memory(self.path, t.fqn, dtypes.nbytes(t.dtype, t.shape))
        out = np.empty((*t.shape, itemsize), dtype=np.uint8)
        for off, size, loc in t.chunks:
            where = f"{self.path / loc.relative_path}: tensor {t.fqn!r} chunk {list(off)}"
            if isinstance(loc, VbinItem):
                arr = self._vbin_chunk(loc, t, size, itemsize, where)
            else:
                dtype, shape, _raw, arr = _torch_tensor_chunk(self._item_bytes(loc, t.fqn), where)
                if dtype != t.dtype or shape != size:
                    raise VcgaFormatError(where, f"holds {dtype} {list(shape)} where the metadata says {t.dtype} "
                                          f"{list(size)}")
            out[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))] = arr
            del arr
        return out.reshape(-1).data

    def _vbin_chunk(self, loc: VbinItem, t: _Tensor, size: tuple[int, ...], itemsize: int, where: str) -> Any:
        import numpy as np

        reader = self._vbin_reader(loc.relative_path)
        try:
            e = reader.entry(loc.name)
        except KeyError:
            raise VcgaFormatError(where, f"the vendor-bin file has no tensor {loc.name!r}") from None
        if (e.dtype, tuple(e.shape)) != (t.dtype, size):
            raise VcgaFormatError(where, f"holds {e.dtype} {list(e.shape)} where the metadata says {t.dtype} "
                                  f"{list(size)}")
        if e.checksum != loc.checksum:
            raise VcgaChecksumError(where, f"the vendor-bin file stores checksum {e.checksum} where the metadata "
                                    "pins another; the file belongs to another checkpoint", expected=loc.checksum)
        return np.frombuffer(e.data, dtype=np.uint8).reshape(*size, itemsize)

    def _vbin_reader(self, name: str) -> Any:
        r = self._vbin.get(name)
        if r is None:
            r = _vbin_spec().open_reader(self._files[name], verify=self.verify)
            self._vbin[name] = r
        return r

    def _item_bytes(self, loc: Any, fqn: str) -> memoryview:
        if isinstance(loc, VbinItem):
            reader = self._vbin_reader(loc.relative_path)
            e = reader.entry(loc.name)
            if e.checksum != loc.checksum:
                raise VcgaChecksumError(self.path / loc.relative_path, f"value {fqn!r}: checksum differs from the "
                                        "metadata's", expected=loc.checksum)
            return memoryview(e.data).cast("B") if e.data is not None else memoryview(b"")
        name = loc.relative_path
        if name not in self._maps:
            f = os.fdopen(open_regular(self._files[name]), "rb")
            try:
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
            finally:
                f.close()
            self._maps[name] = (mm, memoryview(mm) if mm is not None else memoryview(b""))
        view = self._maps[name][1]
        if loc.offset + loc.length > len(view):
            raise VcgaFormatError(self.path / name, f"{fqn!r}: {loc.length} bytes at {loc.offset} run past the end of "
                                  f"the file ({len(view)} bytes); it was truncated", offset=loc.offset)
        return view[loc.offset:loc.offset + loc.length]

    def _release_all(self) -> None:
        """Drop the pages of every chunk read for the last tensor from this process's memory."""
        for mm, _view in self._maps.values():
            if mm is not None:
                try:
                    mm.madvise(mmap.MADV_DONTNEED)
                except (OSError, ValueError, AttributeError):
                    pass
        for r in self._vbin.values():
            release = getattr(r, "release", None)
            if release is not None:
                release()


def _vbin_spec() -> FormatSpec:
    """The vendor-bin format (vcga.checkpoint's shards), from the loaded format plugins."""
    for spec in get_plugin_manager().formats():
        if spec.name == "vendor-bin":
            return spec
    raise VcgaConversionError("this checkpoint's shards are vendor-bin files, and the vendor-bin format plugin "
                              "is not loaded; `vcga info` shows why")


def _whole_checksum(t: _Tensor) -> str | None:
    """A tensor kept whole in one vendor-bin chunk has that chunk's stored checksum."""
    if len(t.chunks) == 1 and isinstance(t.chunks[0][2], VbinItem) and t.chunks[0][1] == t.shape:
        return t.chunks[0][2].checksum
    return None


def _grid(shape: tuple[int, ...], chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...], Any]]) -> bool:
    """Whether the non-empty chunks are distinct cells of one grid -- cut along each dimension at
    every chunk's start and end, each chunk spanning exactly one cell -- so that none overlaps
    another (what FSDP, tensor parallelism and DTensor shardings give), in O(n log n)."""
    boxes = [(off, size) for off, size, _ in chunks if all(size)]
    cuts = [sorted({0, d, *(o[i] for o, _ in boxes), *(o[i] + z[i] for o, z in boxes)})
            for i, d in enumerate(shape)]
    rank = [{c: j for j, c in enumerate(cs)} for cs in cuts]
    for off, size in boxes:
        if any(rank[i][o + z] != rank[i][o] + 1 for i, (o, z) in enumerate(zip(off, size, strict=True))):
            return False
    return len({off for off, _ in boxes}) == len(boxes)


def _overlap(chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...], Any]]) -> bool:
    boxes = sorted((off, size) for off, size, _ in chunks if all(size))
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1:]:
            if a_off and b_off and b_off[0] >= a_off[0] + a_size[0]:
                break  # sorted by the first offset: no later box reaches back into this one
            if all(bo < ao + asz and ao < bo + bsz
                   for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size, strict=True)):
                return True
    return False


def open_reader(path: str | os.PathLike[str], **options: Any) -> DcpDirectoryReader:
    return DcpDirectoryReader(path, **options)


def _no_writer(path: Any, **_options: Any) -> Any:
    raise VcgaConversionError("a DCP directory is written by training (vcga.checkpoint.save or "
                              "torch.distributed.checkpoint.save), not by vcga convert; convert into a file format")


def _sniff(path: Any) -> bool:
    return is_dcp_directory(path)


#: Not a plugin's format: a directory layout ``vcga convert``/``vcga inspect`` read (never write).
DCP_SPEC = FormatSpec(
    name=FORMAT_NAME,
    extensions=(),
    dtypes=frozenset(dtypes.EVERY),
    sniff=_sniff,
    open_reader=open_reader,
    open_writer=_no_writer,
    description="torch.distributed.checkpoint directory (torch's FileSystemWriter layout or VCGA's), read-only",
)
