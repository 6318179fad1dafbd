"""safetensors checkpoints, through the ``safetensors`` library (installed as ``vcga.formats.safetensors_format``).

Reading: :func:`safetensors.safe_open` validates the whole header first (header size, JSON, dtypes,
offsets that tile the buffer exactly, file length) and rejects a damaged file with its own
``SafetensorError``, which becomes :class:`~vcga.errors.VcgaFormatError`. The tensor bytes are then
read with plain positioned reads, one tensor at a time, for two reasons measured with
safetensors 0.8: its numpy binding cannot return fp8 tensors (``numpy`` has no such attribute),
and ``safe_open`` maps the whole file, so every page it touched stays in the process's resident
set until the handle closes -- converting a 2 GiB file would hold 2 GiB. Positioned reads keep the
peak at one tensor.

Writing: the library's writers (``save_file``, ``serialize_file``) take every tensor at once, so
peak memory is the whole checkpoint. :class:`SafetensorsWriter` writes the same bytes without
that: given the list of tensors up front (``plan=``, which ``vcga convert`` passes from the
reader's index) it writes the header first and each tensor straight to its final offset as it
arrives; without a plan it spools tensors to an unlinked temporary file in the destination's
directory and assembles the file on commit (``copy_file_range``, no user-space copy). Either way
the layout is the library's: tensors sorted by descending dtype alignment then name, compact JSON
header padded with spaces to 8 bytes -- a test checks the output is byte-identical to
``safetensors.serialize_file`` for the same tensors.

Per-tensor metadata (HDF5 attributes, torch tie information) rides in ``__metadata__`` under
:data:`vcga.formatkit.TENSOR_METADATA_KEY`.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vcga import dtypes, formatkit
from vcga.atomic import AtomicFile
from vcga.contract import FormatSpec, TensorEntry, hookimpl
from vcga.errors import VcgaConversionError, VcgaFormatError
from vcga.formatkit import (
    ReaderContext,
    WriterContext,
    is_plain_name,
    more_json_objects_than,
    named_file,
    open_regular,
    pack_tensor_metadata,
    pread_exact,
    read_exact,
    unpack_tensor_metadata,
)
from vcga.tensors import check_entry

__all__ = ["SafetensorsReader", "SafetensorsWriter", "ShardedSafetensorsReader", "ShardedSafetensorsWriter",
           "open_reader", "open_writer", "sniff", "SPEC", "LIBRARY_DTYPE_ORDER"]

NAME = "safetensors"

#: The library's ``Dtype`` enum in declaration order ("increasing alignment"); it sorts tensors by
#: this rank, descending, then by name. (safetensors/src/tensor.rs; checked against the installed
#: library by tests/test_formats_safetensors.py.)
LIBRARY_DTYPE_ORDER: tuple[str, ...] = (
    "BOOL", "F4", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16",
    "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
#: safetensors' "F4" is one 4-bit value per element; torch's float4_e2m1fn_x2 (VCGA's name) is one
#: byte holding two, low nibble first, so the header's last dimension is twice torch's -- what
#: the library's own torch binding writes.
PACKED_X2 = "float4_e2m1fn_x2"
_RANK = {name: i for i, name in enumerate(LIBRARY_DTYPE_ORDER)}
_TO_CANON = {d.safetensors: d.name for d in dtypes.DTYPES.values() if d.safetensors}
_FROM_CANON = {v: k for k, v in _TO_CANON.items()}
#: The library refuses headers over 100 MB (MAX_HEADER_SIZE).
MAX_HEADER_SIZE = 100_000_000


def sniff(path: Any) -> bool:
    """A u64 header length that fits the file, followed by a JSON object; or a sharded
    checkpoint's index (JSON with a ``weight_map`` in its first 4 KiB)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if head.lstrip()[:1] == b"{" and b'"weight_map"' in head and str(path).endswith(".json"):
        return True
    head = head[:10]
    if len(head) < 10:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= MAX_HEADER_SIZE and n + 8 <= size and head[8:9] == b"{" and head[9:10] in (b'"', b"}")


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------


class SafetensorsReader(ReaderContext):
    """Streams the tensors of one ``.safetensors`` file in file order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._f = os.fdopen(open_regular(self.path), "rb")  # closed in close()
        try:
            raw = self._bounded_header()
            self._validate_with_library()
            self._parse_header(raw)
        except BaseException:
            self._f.close()
            raise

    def _bounded_header(self) -> bytes | None:
        """The header's bytes, once they are known to declare at most :data:`~vcga.formatkit.MAX_TENSORS`
        tensors: the library's validation builds objects for every entry of a header of up to
        100 MB (its cost: docs/security.md), so they are counted first. None when the length field
        is invalid: the library then says what is wrong."""
        size = os.fstat(self._f.fileno()).st_size
        if size < 8:
            return None
        fd = self._f.fileno()
        (n,) = struct.unpack("<Q", pread_exact(fd, 8, 0, end=size, path=self.path))
        if n > MAX_HEADER_SIZE or n + 8 > size:
            return None
        raw = pread_exact(fd, n, 8, end=size, path=self.path)
        # One object per tensor, one for the header itself, one for __metadata__.
        if more_json_objects_than(raw, formatkit.MAX_TENSORS + 2):
            raise VcgaFormatError(self.path, f"header declares more than {formatkit.MAX_TENSORS} tensors, the most "
                                  "VCGA reads from one file (vcga.formatkit.MAX_TENSORS)", offset=8)
        return raw

    def _validate_with_library(self) -> None:
        try:
            from safetensors import safe_open

            with safe_open(str(self.path), framework="numpy") as handle:
                self._order = list(handle.offset_keys())
        except FileNotFoundError:
            raise VcgaFormatError(self.path, "no such file") from None
        except IsADirectoryError:
            raise VcgaFormatError(self.path, "is a directory, not a safetensors file") from None
        except Exception as e:  # noqa: BLE001 - SafetensorError, or anything the binding raises on hostile input
            raise VcgaFormatError(self.path, f"not a valid safetensors file: {e}") from None

    def _parse_header(self, raw: bytes | None) -> None:
        # The library has validated this header; parse it again here for the byte offsets it does
        # not expose, and keep the checks that protect our own reads.
        if raw is None:
            raise VcgaFormatError(self.path, "header length does not fit the file", offset=0)
        n = len(raw)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise VcgaFormatError(self.path, f"header is not UTF-8 JSON: {e}", offset=8) from None
        if not isinstance(header, dict):
            raise VcgaFormatError(self.path, "header is not a JSON object", offset=8)
        meta = header.pop("__metadata__", None) or {}
        if not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
            raise VcgaFormatError(self.path, "__metadata__ must map strings to strings", offset=8)
        self.metadata, per_tensor = unpack_tensor_metadata(meta, path=self.path)
        self._base = 8 + n
        self._index: list[tuple[TensorEntry, int, int]] = []
        for name in self._order:
            info = header.get(name)
            if not isinstance(info, dict):
                raise VcgaFormatError(self.path, f"tensor {name!r} missing from the header", offset=8)
            st = info.get("dtype")
            if st not in _TO_CANON:
                raise VcgaFormatError(self.path, f"tensor {name!r} has safetensors dtype {st!r}, which VCGA does not "
                                      f"support (supported: {', '.join(sorted(_TO_CANON))})", offset=8)
            shape = tuple(info.get("shape", ()))
            if _TO_CANON[st] == PACKED_X2:
                if not shape or shape[-1] % 2:
                    raise VcgaFormatError(self.path, f"tensor {name!r}: F4 data of shape {list(shape)} does not pack "
                                          f"into bytes along its last dimension, as {PACKED_X2} needs", offset=8)
                shape = (*shape[:-1], shape[-1] // 2)
            start, end = info.get("data_offsets", (0, -1))
            entry = TensorEntry(name=name, dtype=_TO_CANON[st], shape=shape, data=None,
                                metadata=per_tensor.get(name, {}))
            if end - start != entry.nbytes:
                raise VcgaFormatError(self.path, f"tensor {name!r}: offsets span {end - start} bytes, "
                                      f"expected {entry.nbytes}", offset=self._base + start)
            self._index.append((entry, start, end))
        if len(self._index) != len(header):
            raise VcgaFormatError(self.path, "header lists tensors the library did not report", offset=8)

    def index(self) -> Sequence[TensorEntry]:
        return [e for e, _, _ in self._index]

    def entries(self) -> Iterator[TensorEntry]:
        for entry, start, end in self._index:
            buf = read_exact(self._f, self._base + start, end - start, path=self.path, what=f"tensor {entry.name!r}")
            yield TensorEntry(entry.name, entry.dtype, entry.shape, buf, entry.metadata)
            del buf  # let it go before the next read: one tensor in memory, not two

    def close(self) -> None:
        self._f.close()



# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------


def library_order(specs: Sequence[tuple[str, str]]) -> list[int]:
    """Indices of ``(name, canonical dtype)`` pairs in the order the library lays tensors out."""
    return sorted(range(len(specs)), key=lambda i: (-_RANK[_FROM_CANON[specs[i][1]]], specs[i][0]))


def _header_bytes(metadata: Mapping[str, str], layout: Sequence[tuple[str, str, tuple[int, ...], int, int]]) -> bytes:
    # serde_json's compact form: no spaces, non-ASCII kept, control characters escaped -- exactly
    # json.dumps(ensure_ascii=False, separators=(",", ":")).
    obj: dict[str, Any] = {}
    if metadata:
        obj["__metadata__"] = dict(metadata)
    for name, dt, shape, start, end in layout:
        dims = list(shape) if dt != PACKED_X2 else [*shape[:-1], shape[-1] * 2]
        obj[name] = {"dtype": _FROM_CANON[dt], "shape": dims, "data_offsets": [start, end]}
    raw = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_SIZE:
        raise VcgaConversionError(f"safetensors header would be {len(raw)} bytes; the library refuses over "
                                  f"{MAX_HEADER_SIZE}", target=NAME)
    return struct.pack("<Q", len(raw)) + raw


def _check_dtype(entry: TensorEntry) -> None:
    if entry.dtype not in _FROM_CANON:
        raise VcgaConversionError(
            f"tensor {entry.name!r} has dtype {entry.dtype}, which safetensors cannot hold "
            f"(it has {', '.join(sorted(_FROM_CANON))}); cast it first (vcga convert --cast {entry.dtype}=...)",
            tensor=entry.name, dtype=entry.dtype, target=NAME)
    if entry.dtype == PACKED_X2 and not entry.shape:
        raise VcgaConversionError(
            f"tensor {entry.name!r} is a 0-d {PACKED_X2} (one byte, two fp4 values): safetensors' F4 counts "
            "values along the last dimension and has no shape for it; reshape it to (1,) first",
            tensor=entry.name, dtype=entry.dtype, target=NAME)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], offset + done)


def _copy_range(src: int, dst: int, src_off: int, dst_off: int, count: int) -> None:
    """Copy bytes between files in the kernel where it can (copy_file_range), else in 8 MiB chunks."""
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, min(count, 1 << 30), src_off, dst_off)
        except (AttributeError, OSError):
            n = 0
        if n <= 0:
            chunk = os.pread(src, min(count, 8 << 20), src_off)
            if not chunk:
                raise OSError("spool file ended early")
            _pwrite_all(dst, memoryview(chunk), dst_off)
            n = len(chunk)
        src_off += n
        dst_off += n
        count -= n


class SafetensorsWriter(WriterContext):
    """Writes one ``.safetensors`` file atomically, tensor by tensor, with memory bounded by one tensor.

    :param path: the destination (appears only on :meth:`commit`).
    :param plan: optional: every tensor that will be written (name, dtype, shape, metadata), e.g. a
        reader's :meth:`index`. With it the file is written in one pass; without, tensors are spooled.
    """

    def __init__(self, path: str | os.PathLike[str], *, plan: Sequence[TensorEntry] | None = None,
                 publish_into: str | os.PathLike[str] | None = None, _file: AtomicFile | None = None) -> None:
        self._init_outputs(publish_into)
        self.path = Path(path)
        self._metadata: dict[str, str] = {}
        self._names: set[str] = set()
        self._spooled: list[tuple[TensorEntry, int]] = []  # (entry without data, spool offset)
        self._spool: Any = None
        self._spool_end = 0
        self._plan: dict[str, tuple[TensorEntry, int, int]] | None = None
        self._plan_entries: list[TensorEntry] | None = None
        if plan is not None:
            self._plan_entries = list(plan)
            seen: set[str] = set()
            for e in self._plan_entries:
                _check_dtype(e)
                if e.name in seen:
                    raise VcgaConversionError(f"tensor {e.name!r} appears twice", tensor=e.name, target=NAME)
                seen.add(e.name)
        self._header_written = False
        self._base = 0
        # A sharded writer passes its own outputs (one group) so that all shards appear together;
        # it then calls finish() on this writer and publishes them itself.
        self._file = _file if _file is not None else self._open_output(self.path, "w+b")

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        self._check_open()
        if self._header_written:
            raise ValueError("set_metadata must be called before the first write")
        bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise VcgaConversionError(f"safetensors metadata maps strings to strings; key {bad[0]!r} is not",
                                      target=NAME)
        self._metadata = dict(metadata)

    # -- one pass with a plan ----------------------------------------------------------------------

    def _write_planned_header(self) -> None:
        assert self._plan_entries is not None
        entries = self._plan_entries
        order = library_order([(e.name, e.dtype) for e in entries])
        layout = []
        off = 0
        self._plan = {}
        for i in order:
            e = entries[i]
            layout.append((e.name, e.dtype, tuple(e.shape), off, off + e.nbytes))
            self._plan[e.name] = (e, off, off + e.nbytes)
            off += e.nbytes
        meta = pack_tensor_metadata(self._metadata, {e.name: e.metadata for e in entries})
        header = _header_bytes(meta, layout)
        self._base = len(header)
        f = self._file.file
        f.write(header)
        f.truncate(self._base + off)  # sparse until each tensor lands at its offset
        self._header_written = True

    def write(self, entry: TensorEntry) -> None:
        """Write one tensor (bytes go to disk now; nothing is kept but its name and offsets)."""
        self._check_open()
        _check_dtype(entry)
        if entry.name in self._names:
            raise VcgaConversionError(f"tensor {entry.name!r} written twice", tensor=entry.name, target=NAME)
        data = check_entry(entry, target=NAME)
        if self._plan_entries is not None:
            if not self._header_written:
                self._write_planned_header()
            assert self._plan is not None
            planned = self._plan.get(entry.name)
            if planned is None:
                raise VcgaConversionError(f"tensor {entry.name!r} is not in the writer's plan", tensor=entry.name,
                                          target=NAME)
            p, start, _ = planned
            if (p.dtype, tuple(p.shape), dict(p.metadata)) != (entry.dtype, tuple(entry.shape), dict(entry.metadata)):
                raise VcgaConversionError(
                    f"tensor {entry.name!r} is {entry.dtype} {list(entry.shape)} but the plan said {p.dtype} "
                    f"{list(p.shape)} (or its metadata changed)", tensor=entry.name, dtype=entry.dtype, target=NAME)
            _pwrite_all(self._file.file.fileno(), data, self._base + start)
        else:
            if self._spool is None:
                self._spool = tempfile.TemporaryFile(  # noqa: SIM115 - kept across writes; _close_spool closes it
                    dir=self.path.parent, prefix=f".{self.path.name}.spool-")
            _pwrite_all(self._spool.fileno(), data, self._spool_end)
            self._spooled.append((TensorEntry(entry.name, entry.dtype, tuple(entry.shape), None,
                                              dict(entry.metadata)), self._spool_end))
            self._spool_end += data.nbytes
        self._names.add(entry.name)

    def _assemble_from_spool(self) -> None:
        entries = [e for e, _ in self._spooled]
        order = library_order([(e.name, e.dtype) for e in entries])
        layout = []
        off = 0
        for i in order:
            e = entries[i]
            layout.append((e.name, e.dtype, tuple(e.shape), off, off + e.nbytes))
            off += e.nbytes
        meta = pack_tensor_metadata(self._metadata, {e.name: e.metadata for e in entries})
        header = _header_bytes(meta, layout)
        f = self._file.file
        f.write(header)
        f.flush()
        dst_off = len(header)
        for i in order:
            e, src_off = self._spooled[i]
            if e.nbytes:
                _copy_range(self._spool.fileno(), f.fileno(), src_off, dst_off, e.nbytes)
            dst_off += e.nbytes
        f.seek(dst_off)

    def finish(self) -> None:
        """Complete the file's content (header, spooled data) without publishing it."""
        try:
            if self._plan_entries is not None:
                if not self._header_written:
                    self._write_planned_header()
                missing = [e.name for e in self._plan_entries if e.name not in self._names]
                if missing:
                    raise VcgaConversionError(f"{len(missing)} planned tensors were never written, e.g. "
                                              f"{missing[0]!r}", tensor=missing[0], target=NAME)
            else:
                self._assemble_from_spool()
        finally:
            self._close_spool()

    def _finish(self) -> None:
        self.finish()

    def _close_spool(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None

    def _discard(self) -> None:
        self._close_spool()


# ---------------------------------------------------------------------------------------------------
# Sharded checkpoints: Hugging Face's layout
# ---------------------------------------------------------------------------------------------------

#: Hugging Face's index of a sharded checkpoint: ``model.safetensors.index.json`` =
#: ``{"metadata": {"total_size": N}, "weight_map": {tensor name: shard file name}}``, shards named
#: ``model-00001-of-00003.safetensors`` (transformers' ``save_pretrained``).
INDEX_SUFFIX = ".index.json"
MAX_INDEX_BYTES = 100_000_000


class ShardedSafetensorsReader(ReaderContext):
    """Streams a sharded checkpoint through its ``*.safetensors.index.json``, shard after shard.

    Every shard name in the index must be a plain file name in the index's directory (no path
    separators, no ``..``), every listed tensor must be in its shard and every shard tensor listed.
    """

    def __init__(self, index_path: str | os.PathLike[str]) -> None:
        self.path = Path(index_path)
        with os.fdopen(open_regular(self.path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_INDEX_BYTES:
                raise VcgaFormatError(self.path, f"index of {size} bytes is larger than the {MAX_INDEX_BYTES} allowed")
            text = f.read(MAX_INDEX_BYTES + 1)
        try:
            doc = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise VcgaFormatError(self.path, f"index is not UTF-8 JSON: {e}") from None
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
            raise VcgaFormatError(self.path, "index has no weight_map of tensor name -> shard file name")
        if len(wmap) > formatkit.MAX_TENSORS:
            raise VcgaFormatError(self.path, f"weight_map lists {len(wmap)} tensors, more than the "
                                  f"{formatkit.MAX_TENSORS} VCGA reads from one checkpoint "
                                  "(vcga.formatkit.MAX_TENSORS)")
        shards: dict[str, list[str]] = {}
        for name, shard in wmap.items():
            if not is_plain_name(shard):
                raise VcgaFormatError(self.path, f"weight_map sends {name!r} to {shard!r}, which is not a plain file "
                                      "name in the index's directory (path separators and '..' are refused)")
            shards.setdefault(shard, []).append(name)
        self._readers: list[SafetensorsReader] = []
        try:
            for shard in sorted(shards):
                r = SafetensorsReader(named_file(self.path.parent, shard, source=self.path, what="shard"))
                self._readers.append(r)
                have = {e.name for e in r.index()}
                want = set(shards[shard])
                if have != want:
                    odd = sorted(want - have)[:1] or sorted(have - want)[:1]
                    where = "is not in" if want - have else "is in, but the index does not list it in"
                    raise VcgaFormatError(self.path, f"tensor {odd[0]!r} {where} shard {shard!r}")
        except BaseException:
            self.close()
            raise
        self.metadata: dict[str, str] = dict(self._readers[0].metadata) if self._readers else {}
        meta = doc.get("metadata")
        if isinstance(meta, dict):
            for k, v in meta.items():
                if k != "total_size":
                    self.metadata.setdefault(f"index.{k}", v if isinstance(v, str) else json.dumps(v))
        self.notes = [f"read {len(self._readers)} shards through {self.path.name}"]

    def index(self) -> Sequence[TensorEntry]:
        return [e for r in self._readers for e in r.index()]

    def entries(self) -> Iterator[TensorEntry]:
        for r in self._readers:
            yield from r.entries()

    def close(self) -> None:
        for r in self._readers:
            r.close()



def _index_path_for(path: Path) -> Path:
    return path if path.name.endswith(INDEX_SUFFIX) else path.with_name(path.name + INDEX_SUFFIX)


def open_reader(path: str | os.PathLike[str]) -> SafetensorsReader | ShardedSafetensorsReader:
    """A single file, or a sharded checkpoint given by its index (or by the base name next to it)."""
    p = Path(path)
    if p.name.endswith(INDEX_SUFFIX):
        return ShardedSafetensorsReader(p)
    if not p.exists() and _index_path_for(p).is_file():
        return ShardedSafetensorsReader(_index_path_for(p))
    return SafetensorsReader(p)


class ShardedSafetensorsWriter(WriterContext):
    """Writes Hugging Face's sharded layout: ``<stem>-00001-of-0000N.safetensors`` + ``<name>.index.json``.

    Tensors go to shards in plan order, a new shard starting when the next tensor would take the
    current one over ``shard_size`` (a tensor larger than that gets a shard to itself) -- the
    greedy split transformers uses. Every shard is a complete safetensors file carrying the
    file metadata; all shards and the index appear together on :meth:`commit` (index last).
    """

    def __init__(self, path: str | os.PathLike[str], *, plan: Sequence[TensorEntry], shard_size: int,
                 publish_into: str | os.PathLike[str] | None = None) -> None:
        self._init_outputs(publish_into)
        base = Path(path)
        self.path = base
        if base.name.endswith(INDEX_SUFFIX):
            base = base.with_name(base.name[: -len(INDEX_SUFFIX)])
        stem = base.name[: -len(".safetensors")] if base.name.endswith(".safetensors") else base.name
        groups: list[list[TensorEntry]] = [[]]
        used = 0
        for e in plan:
            if groups[-1] and used + e.nbytes > shard_size:
                groups.append([])
                used = 0
            groups[-1].append(e)
            used += e.nbytes
        n = len(groups)
        self._writers: list[SafetensorsWriter] = []
        self._route: dict[str, SafetensorsWriter] = {}
        self._weight_map: dict[str, str] = {}
        self._total = sum(e.nbytes for e in plan)
        try:
            for i, entries in enumerate(groups, 1):
                shard = base.with_name(f"{stem}-{i:05d}-of-{n:05d}.safetensors")
                w = SafetensorsWriter(shard, plan=entries, _file=self._open_output(shard, "w+b"))
                self._writers.append(w)
                for e in entries:
                    self._route[e.name] = w
                    self._weight_map[e.name] = shard.name
            self._index = self._open_output(_index_path_for(base), "wb")
        except BaseException:
            self.abort()
            raise
        self.notes = [f"wrote {n} shards of at most {shard_size} bytes (tensors larger than that: one per shard) "
                      f"and {self._index.path.name}"]

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        self._check_open()
        for w in self._writers:
            w.set_metadata(metadata)

    def write(self, entry: TensorEntry) -> None:
        self._check_open()
        w = self._route.get(entry.name)
        if w is None:
            raise VcgaConversionError(f"tensor {entry.name!r} is not in the writer's plan", tensor=entry.name,
                                      target=NAME)
        w.write(entry)

    def _finish(self) -> None:
        for w in self._writers:
            w.finish()
        doc = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(self._weight_map.items()))}
        self._index.write(json.dumps(doc, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")

    def _discard(self) -> None:
        for w in getattr(self, "_writers", ()):
            w._close_spool()


def open_writer(path: str | os.PathLike[str], *, plan: Sequence[TensorEntry] | None = None,
                shard_size: int | None = None, publish_into: str | os.PathLike[str] | None = None
                ) -> SafetensorsWriter | ShardedSafetensorsWriter:
    """One file; or, with ``shard_size`` and a checkpoint larger than it, Hugging Face's shards + index."""
    p = Path(path)
    if p.name.endswith(INDEX_SUFFIX):
        p = p.with_name(p.name[: -len(INDEX_SUFFIX)])
    if shard_size is not None:
        if plan is None:
            raise VcgaConversionError("sharded safetensors output needs the list of tensors up front (plan=)",
                                      target=NAME)
        if sum(e.nbytes for e in plan) > shard_size:
            return ShardedSafetensorsWriter(p, plan=plan, shard_size=shard_size, publish_into=publish_into)
    return SafetensorsWriter(p, plan=plan, publish_into=publish_into)


SPEC = FormatSpec(
    name=NAME,
    extensions=(".safetensors", ".safetensors.index.json"),
    dtypes=frozenset(_FROM_CANON),
    sniff=sniff,
    open_reader=open_reader,
    open_writer=open_writer,
    description="Hugging Face safetensors, single or sharded (index.json); validated by the safetensors library",
)


@hookimpl
def vcga_formats() -> list[FormatSpec]:
    return [SPEC]
