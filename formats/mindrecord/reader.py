"""Read MindRecord datasets (every shard, every schema MindSpore's FileWriter can write).

Two layers:

- :class:`MindRecordDataset` opens every shard of a dataset, validates headers and ``.db`` indexes
  against each other and against the file sizes, and walks the rows: a row's scalar fields come
  from its msgpack raw row, and its blob fields are *located* (offset and length) without reading them.
- :class:`MindRecordReader` turns rows into tensors (the :class:`~vcga.contract.FormatReader` of
  the ``mindrecord`` format), following the convention of ``docs/mindrecord.md``: records
  ``{name, dtype, shape, data[, offset, metadata]}``, a tensor split over several records joined back
  by ``offset``. A dataset with any other schema is read generically: every field of row ``i``
  becomes a tensor ``"<i>/<field>"``, so that nothing FileWriter can write is unreadable.

Nothing is read before it is checked against the file size, and no buffer larger than one tensor
(itself bounded by the bytes the file holds for it) is ever allocated.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vcga import dtypes as _dtypes
from vcga import formatkit
from vcga.contract import TensorEntry
from vcga.errors import VcgaFormatError
from vcga.formatkit import ReaderContext, check_regular_file, named_file, open_regular, pread_exact

from . import _format as F  # noqa: N812 - the format's names read as F.NAME throughout
from ._index import RowLocation, read_index

__all__ = ["MindRecordDataset", "MindRecordReader", "Record", "resolve_dataset_path", "TENSOR_FIELDS"]


_U64LE = struct.Struct("<Q")
_U64BE = struct.Struct(">Q")

#: The fields of the tensor convention (docs/mindrecord.md); ``name`` and ``data`` are required.
TENSOR_FIELDS = ("name", "dtype", "shape", "data", "offset", "metadata")

#: Key in a dataset's ``desc`` JSON that marks a VCGA-written dataset.
DESC_MARKER = "vcga_tensors"


def resolve_dataset_path(path: str | os.PathLike[str]) -> Path:
    """The shard file to open for ``path``: the file itself, or -- when ``path`` names a sharded
    dataset by its base name (``model.mindrecord`` for ``model.mindrecord0 .. model.mindrecordN``) --
    its first shard."""
    p = Path(path)
    if p.is_file():
        return p
    for width in (1, 2, 3):
        cand = p.with_name(p.name + "0" * width)
        if cand.is_file():
            return cand
    if p.exists():
        check_regular_file(p)  # says what it is instead
    raise VcgaFormatError(p, "no such file (nor a first shard named like "
                             f"{p.name}0 / {p.name}00 / {p.name}000)")


def _dtype_from_name(text: Any) -> str | None:
    """Canonical dtype for a name in the dtype field: VCGA's canonical names (also numpy's), or
    MindSpore's tensor-type names ("Float32", "BFloat16")."""
    if not isinstance(text, str):
        return None
    if text in _dtypes.DTYPES:
        return text
    for d in _dtypes.DTYPES.values():
        if d.mindspore == text:
            return d.name
    return None


# ---------------------------------------------------------------------------------------------------
# One shard
# ---------------------------------------------------------------------------------------------------


class _Shard:
    """One data file, its validated header and its validated index."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_regular(path)
        try:
            self.size = os.fstat(self.fd).st_size
            self.header = self._read_header()
            if self.header.row_count > formatkit.MAX_TENSORS:
                raise VcgaFormatError(path, f"header declares {self.header.row_count} rows, more than the "
                                      f"{formatkit.MAX_TENSORS} VCGA reads from one dataset "
                                      "(vcga.formatkit.MAX_TENSORS)")
            db = named_file(path.parent, path.name + ".db", source=path, what="MindRecord index")
            self.rows: list[RowLocation] = read_index(db, path, self.header, self.size)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def pread(self, n: int, offset: int) -> bytes:
        """Exactly ``n`` bytes at ``offset`` (callers have bounded both by the file size)."""
        return pread_exact(self.fd, n, offset, end=self.size, path=self.path)

    def preadinto(self, buf: memoryview, offset: int) -> None:
        n = len(buf)
        if offset < 0 or offset + n > self.size:
            raise VcgaFormatError(self.path, f"read of {n} bytes lies beyond the end of the file", offset=offset)
        done = 0
        while done < n:
            try:
                got = os.preadv(self.fd, [buf[done:]], offset + done)
            except OSError as e:
                raise VcgaFormatError(self.path, f"read failed: {e.strerror}", offset=offset + done) from None
            if got <= 0:
                raise VcgaFormatError(self.path, "file ended early (was it truncated while being read?)",
                                      offset=offset + done)
            done += got

    def _read_header(self) -> F.Header:
        if self.size < 8:
            raise VcgaFormatError(self.path, f"file is {self.size} bytes, too short for a MindRecord header")
        (json_len,) = _U64LE.unpack(self.pread(8, 0))
        if json_len == 0 or json_len > F.MAX_HEADER_SIZE or 8 + json_len > self.size:
            raise VcgaFormatError(self.path, f"MindRecord header claims {json_len} bytes of JSON in a file of "
                                             f"{self.size} bytes; the file is truncated or not MindRecord", offset=0)
        return F.parse_header(self.pread(json_len, 8), self.size, self.path)

    # -- rows ------------------------------------------------------------------------------------

    def raw_row(self, loc: RowLocation) -> dict[str, Any]:
        start = self.header.page_offset(loc.raw_page) + loc.raw_start
        buf = self.pread(loc.raw_end - loc.raw_start, start)
        (n,) = _U64LE.unpack_from(buf, 0)
        if n != len(buf) - 8:
            raise VcgaFormatError(self.path, f"raw row {loc.row_id} says {n} bytes, its index says {len(buf) - 8}",
                                  offset=start)
        return F.unpack_raw_row(buf[8:], self.path, f"row {loc.row_id}", max_fields=len(self.header.schema.fields) + 1)

    def blob_fields(self, loc: RowLocation) -> dict[str, tuple[int, int]]:
        """``{field: (absolute offset, length)}`` of each blob field of a row, without reading them."""
        schema = self.header.schema
        start = self.header.page_offset(loc.blob_page) + loc.blob_start
        (n,) = _U64LE.unpack(self.pread(8, start))
        if n != loc.blob_end - loc.blob_start - 8:
            raise VcgaFormatError(self.path, f"blob row {loc.row_id} says {n} bytes, its index says "
                                             f"{loc.blob_end - loc.blob_start - 8}", offset=start)
        body = start + 8
        names = schema.blob_fields
        if not names:
            return {}
        if len(names) == 1:
            return {names[0]: (body, n)}
        out: dict[str, tuple[int, int]] = {}
        pos = 0
        for name in names:
            if pos + 8 > n:
                raise VcgaFormatError(self.path, f"blob row {loc.row_id} ends inside the length of field {name!r}",
                                      offset=body + pos)
            (flen,) = _U64BE.unpack(self.pread(8, body + pos))
            if flen > n - pos - 8:
                raise VcgaFormatError(self.path, f"blob row {loc.row_id}: field {name!r} claims {flen} bytes, "
                                                 f"only {n - pos - 8} remain in the row", offset=body + pos)
            out[name] = (body + pos + 8, flen)
            pos += 8 + flen
        if pos != n:
            raise VcgaFormatError(self.path, f"blob row {loc.row_id} has {n - pos} bytes after its last field",
                                  offset=body + pos)
        return out


# ---------------------------------------------------------------------------------------------------
# A dataset (all shards)
# ---------------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One row: its shard, row id, scalar fields and blob field locations."""

    shard: int
    row_id: int
    raw: dict[str, Any]
    blobs: dict[str, tuple[int, int]]


class MindRecordDataset:
    """Every shard of a MindRecord dataset, validated against each other.

    :param path: any shard of the dataset (MindSpore's FileReader opens every shard listed in the
        header's ``shard_addresses`` too), or the base name of a sharded dataset.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        first_path = resolve_dataset_path(path)
        first = _Shard(first_path)
        self.shards: list[_Shard] = []
        try:
            h = first.header
            if h.shard_addresses[h.shard_id] != first_path.name:
                raise VcgaFormatError(first_path, f"its header names this shard {h.shard_addresses[h.shard_id]!r}; "
                                                  "MindSpore cannot read renamed shards -- rename it back")
            rows = 0
            for i, name in enumerate(h.shard_addresses):
                shard = first if i == h.shard_id else _Shard(
                    named_file(first_path.parent, name, source=first_path, what=f"shard {i}"))
                self.shards.append(shard)
                self._check_consistent(first, shard, i)
                rows += len(shard.rows)
                if rows > formatkit.MAX_TENSORS:
                    raise VcgaFormatError(first_path, f"its shards hold more than {formatkit.MAX_TENSORS} rows, the "
                                          "most VCGA reads from one dataset (vcga.formatkit.MAX_TENSORS)")
        except BaseException:
            self.close()
            first.close()  # closing twice is harmless
            raise
        self.header = first.header
        self.schema = first.header.schema
        self.path = first_path

    @staticmethod
    def _check_consistent(first: _Shard, shard: _Shard, index: int) -> None:
        a, b = first.header, shard.header
        if b.shard_id != index:
            raise VcgaFormatError(shard.path, f"header says shard_id {b.shard_id}, but it is shard {index} "
                                              f"in the shard list of {first.path.name}")
        for what in ("header_size", "page_size", "compression_size", "version", "index_fields", "shard_addresses"):
            if getattr(a, what) != getattr(b, what):
                raise VcgaFormatError(shard.path, f"{what} {getattr(b, what)!r} differs from "
                                                  f"{getattr(a, what)!r} in {first.path.name}; the shards belong "
                                                  "to different datasets")
        if a.schema.to_json() != b.schema.to_json():
            raise VcgaFormatError(shard.path, f"its schema differs from the one in {first.path.name}; the shards "
                                              "belong to different datasets")

    def close(self) -> None:
        for s in self.shards:
            s.close()

    @property
    def row_count(self) -> int:
        return sum(len(s.rows) for s in self.shards)

    def records(self) -> Iterator[Record]:
        """Every row of every shard, in shard order then row-id order (as FileReader returns them)."""
        schema = self.schema
        raw_fields = set(schema.raw_fields)
        for si, shard in enumerate(self.shards):
            for loc in shard.rows:
                raw = shard.raw_row(loc)
                if raw_fields:
                    if set(raw) != raw_fields:
                        raise VcgaFormatError(shard.path, f"row {loc.row_id} has raw fields {sorted(raw)}, the "
                                                          f"schema has {sorted(raw_fields)}")
                    for name in raw_fields:
                        _check_scalar(schema.fields[name], raw[name], shard.path, loc.row_id)
                else:
                    raw = {}  # FileWriter stores a dummy {"id": 0} when every field is a blob
                yield Record(si, loc.row_id, raw, shard.blob_fields(loc))

    def read(self, rec: Record, name: str) -> bytes:
        """The stored bytes of one blob field of a record."""
        off, n = rec.blobs[name]
        return self.shards[rec.shard].pread(n, off)

    def decode_array(self, rec: Record, name: str) -> np.ndarray:
        """A blob field as a 1-D numpy array of its element type (integer arrays decompressed)."""
        f = self.schema.fields[name]
        buf = self.read(rec, name)
        if f.is_int_array and self.compressed:
            return decompress(buf, f, self.shards[rec.shard].path, rec.row_id)
        if len(buf) % f.numpy_dtype.itemsize:
            raise VcgaFormatError(self.shards[rec.shard].path,
                                  f"row {rec.row_id}: field {name!r} holds {len(buf)} bytes, not a whole number of "
                                  f"{f.type} elements")
        return np.frombuffer(buf, dtype=f.numpy_dtype)

    @property
    def compressed(self) -> bool:
        """Integer arrays are compressed in version 3.0 files (shard_reader.cc: version < 3.0 -> plain)."""
        return self.header.version >= "3.0" and self.schema.compresses_integers


def decompress(buf: bytes, f: F.Field, path: Path, row_id: int) -> np.ndarray:
    return F.decompress_int_array(buf, "<i4" if f.type == "int32" else "<i8", path, f"row {row_id} field {f.name!r}")


def _check_scalar(f: F.Field, value: Any, path: Path, row_id: int) -> None:
    ok = {
        "string": lambda v: isinstance(v, str),
        "int32": lambda v: isinstance(v, int) and not isinstance(v, bool) and -(1 << 31) <= v < (1 << 31),
        "int64": lambda v: isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63),
        "float32": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "float64": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    }[f.type]
    if not ok(value):
        raise VcgaFormatError(path, f"row {row_id}: field {f.name!r} holds {value!r}, not a {f.type}")


# ---------------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    """Where part of a tensor's bytes comes from: a stored blob field, a compressed integer array,
    or bytes already in hand (scalar fields)."""

    offset: int  #: byte offset inside the tensor
    length: int  #: decoded length in bytes
    record: Record | None = None
    field: str | None = None
    inline: bytes | None = None


@dataclass
class _Plan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    metadata: dict[str, str]
    chunks: list[_Chunk] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(self.dtype, self.shape)


class MindRecordReader(ReaderContext):
    """The ``mindrecord`` :class:`~vcga.contract.FormatReader`.

    :param path: a shard of the dataset, or the base name of a sharded dataset.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.dataset = MindRecordDataset(path)
        try:
            self.path = self.dataset.path
            self.layout = _classify(self.dataset.schema)
            fields = len(self.dataset.schema.fields)
            if self.layout == "generic" and self.dataset.row_count * fields > formatkit.MAX_TENSORS:
                raise VcgaFormatError(self.dataset.path, f"{self.dataset.row_count} rows of {fields} fields make "
                                      f"more than the {formatkit.MAX_TENSORS} tensors VCGA reads from one dataset "
                                      "(vcga.formatkit.MAX_TENSORS)")
            self.metadata: Mapping[str, str] = _file_metadata(self.dataset.schema.desc)
            self._plans: list[_Plan] | None = None
        except BaseException:
            self.dataset.close()
            raise

    # -- FormatReader ------------------------------------------------------------------------------

    def index(self) -> Sequence[TensorEntry]:
        return [TensorEntry(p.name, p.dtype, p.shape, None, dict(p.metadata)) for p in self._plan()]

    def entries(self) -> Iterator[TensorEntry]:
        for plan in self._plan():
            yield TensorEntry(plan.name, plan.dtype, plan.shape, self._materialise(plan), dict(plan.metadata))

    def close(self) -> None:
        self.dataset.close()


    # -- planning ----------------------------------------------------------------------------------

    def _plan(self) -> list[_Plan]:
        if self._plans is None:
            plans = self._plan_tensors() if self.layout == "tensors" else self._plan_generic()
            for p in plans:
                _check_tiling(p, self.path)
            self._plans = plans
        return self._plans

    def _chunk_length(self, rec: Record, name: str) -> int:
        """Decoded length of a blob field: compressed integer arrays carry their element count up front."""
        f = self.dataset.schema.fields[name]
        off, n = rec.blobs[name]
        if f.is_int_array and self.dataset.compressed:
            if n < 4:
                raise VcgaFormatError(self.dataset.shards[rec.shard].path,
                                      f"row {rec.row_id}: compressed field {name!r} is shorter than its count",
                                      offset=off)
            (count,) = struct.unpack(">I", self.dataset.shards[rec.shard].pread(4, off))
            if 4 + -(-count // 4) + count > n:  # every element takes a byte at least, plus its bitmap bits
                raise VcgaFormatError(self.dataset.shards[rec.shard].path,
                                      f"row {rec.row_id}: compressed field {name!r} claims {count} elements in "
                                      f"{n} bytes", offset=off)
            return count * f.numpy_dtype.itemsize
        return n

    def _plan_tensors(self) -> list[_Plan]:
        ds = self.dataset
        schema = ds.schema
        data_field = schema.fields["data"]
        plans: dict[str, _Plan] = {}
        for rec in ds.records():
            path = ds.shards[rec.shard].path
            name = rec.raw["name"]
            where = f"tensor {name!r} (shard {path.name}, row {rec.row_id})"
            # dtype: from the dtype field for bytes data, from the field type for typed arrays.
            if data_field.type == "bytes":
                dtype = _dtype_from_name(rec.raw.get("dtype"))
                if dtype is None:
                    raise VcgaFormatError(path, f"{where}: unknown dtype {rec.raw.get('dtype')!r}",
                                          expected=f"one of {', '.join(_dtypes.EVERY)}")
            else:
                dtype = data_field.type
                if "dtype" in rec.raw and _dtype_from_name(rec.raw["dtype"]) != dtype:
                    raise VcgaFormatError(path, f"{where}: dtype field says {rec.raw['dtype']!r} but the data "
                                                f"field stores {data_field.type}")
            itemsize = _dtypes.get(dtype).itemsize
            length = self._chunk_length(rec, "data")
            if "shape" in schema.fields:
                shape_arr = ds.decode_array(rec, "shape")
                if shape_arr.size > 64 or (shape_arr < 0).any():
                    raise VcgaFormatError(path, f"{where}: invalid shape {shape_arr.tolist()}")
                shape = tuple(int(d) for d in shape_arr)
            elif data_field.shape is not None and -1 not in data_field.shape:
                shape = data_field.shape
            else:
                if length % itemsize:
                    raise VcgaFormatError(path, f"{where}: {length} bytes is not a whole number of {dtype} elements")
                shape = (length // itemsize,)
            offset = rec.raw.get("offset", 0)
            if not isinstance(offset, int) or offset < 0:
                raise VcgaFormatError(path, f"{where}: invalid offset {offset!r}")
            metadata = _tensor_metadata(rec.raw.get("metadata", ""))
            plan = plans.get(name)
            if plan is None:
                plan = plans[name] = _Plan(name, dtype, shape, metadata)
            elif (plan.dtype, plan.shape, plan.metadata) != (dtype, shape, metadata):
                raise VcgaFormatError(path, f"{where}: its dtype/shape/metadata "
                                            f"({dtype}, {list(shape)}) differ from an earlier record of the same "
                                            f"tensor ({plan.dtype}, {list(plan.shape)})")
            plan.chunks.append(_Chunk(offset, length, rec, "data"))
        return list(plans.values())

    def _plan_generic(self) -> list[_Plan]:
        ds = self.dataset
        schema = ds.schema
        plans: list[_Plan] = []
        for i, rec in enumerate(ds.records()):
            path = ds.shards[rec.shard].path
            for fname in sorted(schema.fields):
                f = schema.fields[fname]
                name = f"{i}/{fname}"
                if f.type == "string" and not f.in_blob:
                    data = rec.raw[fname].encode("utf-8")
                    plans.append(_Plan(name, "uint8", (len(data),), {"mindrecord.type": "string"},
                                       [_Chunk(0, len(data), inline=data)]))
                elif not f.in_blob:
                    value = np.array(rec.raw[fname], dtype=f.numpy_dtype).reshape(())
                    plans.append(_Plan(name, f.type, (), {}, [_Chunk(0, f.numpy_dtype.itemsize,
                                                                     inline=value.tobytes())]))
                elif f.type == "bytes" and f.shape is None:
                    n = rec.blobs[fname][1]
                    plans.append(_Plan(name, "uint8", (n,), {"mindrecord.type": "bytes"},
                                       [_Chunk(0, n, rec, fname)]))
                else:
                    length = self._chunk_length(rec, fname)
                    dtype = "uint8" if f.type == "bytes" else f.type
                    shape = _resolve_shape(f.shape or (-1,), length // _dtypes.get(dtype).itemsize, path,
                                           f"row {rec.row_id} field {fname!r}")
                    plans.append(_Plan(name, dtype, shape, {}, [_Chunk(0, length, rec, fname)]))
        return plans

    # -- reading -----------------------------------------------------------------------------------

    def _read_chunk_into(self, chunk: _Chunk, out: memoryview) -> None:
        if chunk.inline is not None:
            out[:] = chunk.inline
            return
        assert chunk.record is not None and chunk.field is not None
        rec, f = chunk.record, self.dataset.schema.fields[chunk.field]
        shard = self.dataset.shards[rec.shard]
        if f.is_int_array and self.dataset.compressed:
            arr = decompress(self.dataset.read(rec, chunk.field), f, shard.path, rec.row_id)
            out[:] = arr.astype(f.numpy_dtype.newbyteorder("<")).tobytes()
        else:
            shard.preadinto(out, rec.blobs[chunk.field][0])

    def _materialise(self, plan: _Plan) -> bytes | bytearray:
        if len(plan.chunks) == 1:
            chunk = plan.chunks[0]
            if chunk.inline is not None:
                return chunk.inline
            rec, f = chunk.record, self.dataset.schema.fields[chunk.field or ""]
            if not (f.is_int_array and self.dataset.compressed):
                assert rec is not None and chunk.field is not None
                return self.dataset.read(rec, chunk.field)
        buf = bytearray(plan.nbytes)  # bounded: _check_tiling proved the chunks cover exactly this
        view = memoryview(buf)
        for chunk in plan.chunks:
            self._read_chunk_into(chunk, view[chunk.offset:chunk.offset + chunk.length])
        return buf


def _classify(schema: F.Schema) -> str:
    """"tensors" when the schema follows the tensor convention, else "generic"."""
    fields = schema.fields
    if not set(fields) <= set(TENSOR_FIELDS) or "name" not in fields or "data" not in fields:
        return "generic"
    name, data = fields["name"], fields["data"]
    if name.type != "string" or name.in_blob or not data.in_blob:
        return "generic"
    if data.type == "bytes" and data.shape is None:
        if "dtype" not in fields:
            return "generic"
    elif data.type == "string":
        return "generic"
    if "dtype" in fields and (fields["dtype"].type != "string" or fields["dtype"].in_blob):
        return "generic"
    if "shape" in fields and not fields["shape"].is_int_array:
        return "generic"
    if "offset" in fields and (fields["offset"].type not in ("int32", "int64") or fields["offset"].in_blob):
        return "generic"
    if "metadata" in fields and (fields["metadata"].type != "string" or fields["metadata"].in_blob):
        return "generic"
    return "tensors"


def _resolve_shape(shape: tuple[int, ...], numel: int, path: Path, what: str) -> tuple[int, ...]:
    known = 1
    for d in shape:
        if d != -1:
            known *= d
    if -1 in shape:
        if known == 0 or numel % known:
            raise VcgaFormatError(path, f"{what}: {numel} elements do not fit the schema shape {list(shape)}")
        return tuple(numel // known if d == -1 else d for d in shape)
    if known != numel:
        raise VcgaFormatError(path, f"{what}: {numel} elements, the schema shape {list(shape)} needs {known}")
    return shape


def _check_tiling(plan: _Plan, path: Path) -> None:
    """The records of a tensor must cover its bytes exactly once: no gap, no overlap, nothing extra."""
    plan.chunks.sort(key=lambda c: c.offset)
    pos = 0
    for c in plan.chunks:
        if c.offset != pos:
            what = "overlap" if c.offset < pos else "leave a gap"
            raise VcgaFormatError(path, f"tensor {plan.name!r}: its records {what} at byte {min(pos, c.offset)}")
        pos += c.length
    if pos != plan.nbytes:
        raise VcgaFormatError(path, f"tensor {plan.name!r}: its records hold {pos} bytes, dtype {plan.dtype} and "
                                    f"shape {list(plan.shape)} need {plan.nbytes}")


def _tensor_metadata(text: str) -> dict[str, str]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return value
    return {"mindrecord.metadata": text}  # free text from another producer: keep it verbatim


def _file_metadata(desc: str) -> dict[str, str]:
    try:
        value = json.loads(desc) if desc.startswith("{") else None
    except ValueError:
        value = None
    if isinstance(value, dict) and DESC_MARKER in value:
        meta = value.get("metadata", {})
        if isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            return dict(meta)
    return {"mindrecord.desc": desc} if desc else {}
