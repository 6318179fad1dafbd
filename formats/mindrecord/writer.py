"""Write tensors as a MindRecord dataset that MindSpore's FileReader reads (docs/mindrecord.md).

Schema (one record per tensor, or several when a tensor is larger than a page)::

    name: string        the tensor's name (an index field: MindSpore's MindPage can look tensors up)
    dtype: string       canonical dtype name ("float32", "bfloat16", "float8_e4m3fn", ...)
    shape: int64 [-1]   the tensor's full shape; [] for a 0-d tensor (a blob field, so it is compressed)
    data: bytes         this record's slice of the tensor's little-endian, C-order bytes
    offset: int64       where that slice starts inside the tensor's bytes (0 unless split)
    metadata: string    per-tensor metadata as a JSON object, or "" when there is none

``shape`` and ``data`` are both blob fields, so a record's blob is never empty: FileWriter drops (or
fails on) records whose only blob is empty, and with two blob fields an empty tensor still has a
non-empty blob (its two length prefixes and its shape).

Streaming: blob rows go straight to their page with ``pwritev`` (no copy of tensor data); the small
raw rows and index rows wait in memory until their shard is finished; headers and ``.db`` files are
written at :meth:`MindRecordWriter.commit`, when the number of shards -- and so their names -- is known.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vcga import dtypes as _dtypes
from vcga.atomic import AtomicFile
from vcga.contract import TensorEntry
from vcga.errors import VcgaConfigError, VcgaConversionError
from vcga.formatkit import WriterContext, is_unicode

from . import _format as F  # noqa: N812 - the format's names read as F.NAME throughout
from ._index import CAN_SERIALIZE, index_bytes, write_index
from .reader import DESC_MARKER

__all__ = ["MindRecordWriter", "TENSOR_SCHEMA"]


_U64LE = struct.Struct("<Q")
_U64BE = struct.Struct(">Q")

#: The schema VCGA writes (see the module docstring and docs/mindrecord.md).
TENSOR_SCHEMA = (
    F.Field("data", "bytes"),
    F.Field("dtype", "string"),
    F.Field("metadata", "string"),
    F.Field("name", "string"),
    F.Field("offset", "int64"),
    F.Field("shape", "int64", (-1,)),
)
_INDEX_FIELDS = (("name", "string"),)

# Blob layout with two blob fields (data, shape), sorted by name as MindSpore sorts them:
#   u64 LE row length | u64 BE len(data) | data | u64 BE len(shape) | compressed shape
_ROW_OVERHEAD = 8 + 8 + 8
#: Start writing a shard to disk in the background after this many bytes (AtomicFile.writeback).
WRITEBACK_BYTES = 64 << 20


@dataclass
class _PendingRow:
    row_id: int
    blob_page: int
    blob_start: int
    blob_end: int
    raw: bytes  # msgpack row, without its u64 length prefix
    name: str


@dataclass
class _ShardState:
    """A shard being written: its files, its pages so far and the rows waiting for their raw page."""

    data: AtomicFile
    db: AtomicFile
    pages: list[F.Page] = field(default_factory=list)
    rows: list[_PendingRow] = field(default_factory=list)
    index_rows: list[tuple[Any, ...]] = field(default_factory=list)
    # the open blob page
    page_id: int = -1
    page_used: int = 0
    page_start_row: int = 0
    group_raw: int = 0  # raw bytes of the rows of the open page (a row group must fit one raw page)
    data_bytes: int = 0
    file_end: int = 0
    finished: bool = False
    unsynced: int = 0

    @property
    def row_count(self) -> int:
        return len(self.rows)


def _check_size(key: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi or value % 4:
        raise VcgaConfigError(key, value, f"a multiple of 4 between {lo} and {hi} bytes (MindSpore's limits)")
    return value


class MindRecordWriter(WriterContext):
    """The ``mindrecord`` :class:`~vcga.contract.FormatWriter`.

    :param path: the dataset's file name (with several shards: its base name; shards are
        ``path0 .. pathN-1`` exactly as FileWriter names them).
    :param shard_size: start a new shard once a shard holds this many bytes of tensor data
        (None: one file). A tensor larger than a shard is split across shards.
    :param header_size: bytes reserved for each shard's header (16 KiB .. 128 MiB, multiple of 4).
    :param page_size: page size (32 KiB .. 256 MiB, multiple of 4); tensors larger than a page are
        split into several records.
    """

    def __init__(self, path: str | os.PathLike[str], *, shard_size: int | None = None,
                 header_size: int = F.DEFAULT_HEADER_SIZE, page_size: int = F.DEFAULT_PAGE_SIZE,
                 publish_into: str | os.PathLike[str] | None = None) -> None:
        self._init_outputs(publish_into)
        self.path = Path(path)
        self.header_size = _check_size("header_size", header_size, F.MIN_HEADER_SIZE, F.MAX_HEADER_SIZE)
        self.page_size = _check_size("page_size", page_size, F.MIN_PAGE_SIZE, F.MAX_PAGE_SIZE)
        if shard_size is not None and (not isinstance(shard_size, int) or isinstance(shard_size, bool)
                                       or shard_size <= 0):
            raise VcgaConfigError("shard_size", shard_size, "a positive number of bytes, or None for one file")
        self.shard_size = shard_size
        if not self.path.parent.is_dir():
            raise VcgaConversionError(f"{self.path}: directory {self.path.parent} does not exist")
        self.schema = F.Schema.build(TENSOR_SCHEMA, "")
        self.metadata: dict[str, str] = {}
        self.shards: list[_ShardState] = []
        self.names: set[str] = set()
        self.compression_size = 0

    # -- FormatWriter ------------------------------------------------------------------------------

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        self._check_open()
        if not all(isinstance(k, str) and isinstance(v, str) and is_unicode(k) and is_unicode(v)
                   for k, v in metadata.items()):
            raise VcgaConversionError("mindrecord metadata must map strings to strings (valid Unicode)")
        self.metadata = dict(metadata)

    def write(self, entry: TensorEntry) -> None:
        self._check_open()
        name, dtype, shape = entry.name, entry.dtype, tuple(entry.shape)
        if not isinstance(name, str) or not name or not is_unicode(name):
            raise VcgaConversionError(f"tensor name {name!r} is not a non-empty Unicode string", tensor=str(name))
        if name in self.names:
            raise VcgaConversionError(f"tensor {name!r} is written twice", tensor=name)
        info = _dtypes.get(dtype)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise VcgaConversionError(f"tensor {name!r}: invalid shape {list(shape)}", tensor=name)
        data = memoryview(entry.data if entry.data is not None else b"").cast("B")
        if data.nbytes != entry.nbytes:
            raise VcgaConversionError(f"tensor {name!r}: {data.nbytes} bytes of data, but {dtype} "
                                      f"{list(shape)} needs {entry.nbytes}", tensor=name, dtype=dtype)
        if not all(isinstance(k, str) and isinstance(v, str) and is_unicode(k) and is_unicode(v)
                   for k, v in entry.metadata.items()):
            raise VcgaConversionError(f"tensor {name!r}: metadata must map Unicode strings to strings", tensor=name)
        self.names.add(name)
        meta = json.dumps(dict(entry.metadata), ensure_ascii=False, sort_keys=True,
                          separators=(",", ":")) if entry.metadata else ""
        shape_blob = F.compress_int_array(np.array(shape, dtype=np.int64))

        # Largest slice of data one record can hold: the row must fit a page, slices stay whole elements.
        capacity = self.page_size - _ROW_OVERHEAD - len(shape_blob)
        capacity -= capacity % info.itemsize
        raw_probe = F.pack_raw_row({"dtype": dtype, "metadata": meta, "name": name, "offset": data.nbytes})
        if capacity <= 0 or len(raw_probe) + 8 > self.page_size:
            raise VcgaConversionError(f"tensor {name!r}: its name, shape and metadata do not fit a "
                                      f"{self.page_size}-byte MindRecord page; write with a larger page_size",
                                      tensor=name)
        offset = 0
        while True:
            piece = data[offset:offset + capacity]
            raw = F.pack_raw_row({"dtype": dtype, "metadata": meta, "name": name, "offset": offset})
            self._append_row(piece, shape_blob, raw, name)
            self.compression_size += 8 * len(shape) - len(shape_blob)  # per record, as MindSpore counts
            offset += len(piece)
            if offset >= data.nbytes:
                break

    def _finish(self) -> None:
        if not self.shards:
            self._open_shard()
        for shard in self.shards:
            self._finish_shard(shard)
        names = F.shard_file_names(self.path.name, len(self.shards))
        desc = json.dumps({DESC_MARKER: 1, "metadata": self.metadata}, ensure_ascii=False,
                          separators=(",", ":"), sort_keys=True)
        schema = F.Schema(self.schema.fields, self.schema.blob_fields, desc)
        for i, (shard, name) in enumerate(zip(self.shards, names, strict=True)):
            header = F.serialize_header(
                header_size=self.header_size, page_size=self.page_size,
                compression_size=max(self.compression_size, 0), index_fields=[n for n, _ in _INDEX_FIELDS],
                pages=shard.pages, schema=schema, shard_addresses=names, shard_id=i)
            if 8 + len(header) > self.header_size:
                raise VcgaConversionError(
                    f"{self.path}: the MindRecord header of shard {i} needs {8 + len(header)} bytes, more than "
                    f"header_size={self.header_size}; write with a larger header_size or a smaller shard_size")
            fd = shard.data.file.fileno()
            os.pwrite(fd, _U64LE.pack(len(header)) + header, 0)
            if not shard.pages:  # FileWriter leaves an empty dataset's file at the header's length
                os.ftruncate(fd, 8 + len(header))
            # The final names are known only now: point both outputs at them.
            shard.data.path = self.path.with_name(name)
            shard.db.path = self.path.with_name(name + ".db")
            if shard.db.tmp_path is None:
                shard.db.write(index_bytes(name, _INDEX_FIELDS, shard.index_rows))
            else:
                write_index(shard.db.tmp_path, name, _INDEX_FIELDS, shard.index_rows)

    def __del__(self) -> None:
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - a finalizer cannot report; at interpreter exit any name may be gone
            pass

    # -- shards and pages --------------------------------------------------------------------------

    def _open_shard(self) -> _ShardState:
        if len(self.shards) >= F.MAX_SHARD_COUNT:
            raise VcgaConversionError(f"{self.path}: more than {F.MAX_SHARD_COUNT} shards (MindSpore's limit); "
                                      "use a larger shard_size")
        # Provisional names; commit() renames once the shard count (and so the digits) is known.
        base = self.path.name if not self.shards else f"{self.path.name}{len(self.shards)}"
        # The index first: the AtomicGroup renames in opening order, so a shard appears after its index.
        # SQLite needs a path unless it can serialize an in-memory database (Python 3.11+).
        db = self._open_output(self.path.with_name(base + ".db"), named=not CAN_SERIALIZE)
        data = self._open_output(self.path.with_name(base))
        shard = _ShardState(data=data, db=db)
        self.shards.append(shard)
        return shard

    def _current_shard(self, incoming: int) -> _ShardState:
        if not self.shards:
            return self._open_shard()
        shard = self.shards[-1]
        if self.shard_size is not None and shard.row_count and shard.data_bytes + incoming > self.shard_size:
            self._finish_shard(shard)
            return self._open_shard()
        return shard

    def _append_row(self, piece: memoryview, shape_blob: bytes, raw: bytes, name: str) -> None:
        shard = self._current_shard(len(piece))
        blob_len = 8 + len(piece) + 8 + len(shape_blob)
        row_len = 8 + blob_len
        raw_len = 8 + len(raw)
        # shard_writer.cc CutRowGroup: a new page when the blob page or the group's raw rows would overflow.
        if shard.page_id < 0 or shard.page_used + row_len > self.page_size or \
                shard.group_raw + raw_len > self.page_size:
            self._close_blob_page(shard)
            shard.page_id = len(shard.pages)
            shard.pages.append(None)  # type: ignore[arg-type]  # placeholder, filled when the page closes
            shard.page_used = 0
            shard.page_start_row = shard.row_count
            shard.group_raw = 0
        start = shard.page_used
        pos = self.header_size + shard.page_id * self.page_size + start
        prefix = _U64LE.pack(blob_len) + _U64BE.pack(len(piece))
        suffix = _U64BE.pack(len(shape_blob)) + shape_blob
        _pwritev_all(shard.data.file.fileno(), [prefix, piece, suffix], pos)
        shard.unsynced += row_len
        if shard.unsynced >= WRITEBACK_BYTES:  # let the disk work while the next tensors arrive
            shard.data.writeback()
            shard.unsynced = 0
        shard.file_end = max(shard.file_end, pos + row_len)
        shard.page_used += row_len
        shard.group_raw += raw_len
        shard.data_bytes += len(piece)
        shard.rows.append(_PendingRow(shard.row_count, shard.page_id, start, start + row_len, raw, name))

    def _close_blob_page(self, shard: _ShardState) -> None:
        if shard.page_id < 0 or shard.pages[shard.page_id] is not None:
            return
        group = sum(1 for p in shard.pages[:shard.page_id] if p is not None and p.page_type == F.BLOB_PAGE)
        shard.pages[shard.page_id] = F.Page(
            page_id=shard.page_id, page_type=F.BLOB_PAGE, page_type_id=group,
            start_row_id=shard.page_start_row, end_row_id=shard.row_count, row_group_ids=(),
            used=shard.page_used, shard_id=self.shards.index(shard))

    def _finish_shard(self, shard: _ShardState) -> None:
        """Close the open blob page, then lay out and write the raw pages (after every blob page, as
        FileWriter does within one write call) and prepare the shard's index rows."""
        if shard.finished:
            return
        shard.finished = True
        self._close_blob_page(shard)
        shard_id = self.shards.index(shard)
        blob_pages = [p for p in shard.pages if p.page_type == F.BLOB_PAGE]
        raw_pages: list[tuple[int, int, list[tuple[int, int]]]] = []  # (page_id, used, groups)
        placements: dict[int, tuple[int, int]] = {}  # row_id -> (raw page id, start)
        fd = shard.data.file.fileno()
        next_page = len(shard.pages)
        for bp in blob_pages:
            rows = shard.rows[bp.start_row_id:bp.end_row_id]
            group_bytes = sum(8 + len(r.raw) for r in rows)
            if not raw_pages or raw_pages[-1][1] + group_bytes > self.page_size:
                raw_pages.append((next_page, 0, []))
                next_page += 1
            pid, used, groups = raw_pages[-1]
            groups.append((bp.page_type_id, used))
            base = self.header_size + pid * self.page_size
            chunks = []
            for r in rows:
                placements[r.row_id] = (pid, used)
                chunks += [_U64LE.pack(len(r.raw)), r.raw]
                used += 8 + len(r.raw)
            _pwritev_all(fd, chunks, base + raw_pages[-1][1])
            shard.file_end = max(shard.file_end, base + used)
            raw_pages[-1] = (pid, used, groups)
        prev_raw_id = -1
        for pid, used, groups in raw_pages:
            # shard_writer.cc EmptyRawPage: a raw page's page_type_id is the previous raw page's id + 1.
            shard.pages.append(F.Page(page_id=pid, page_type=F.RAW_PAGE, page_type_id=prev_raw_id + 1,
                                      start_row_id=0, end_row_id=0, row_group_ids=tuple(groups), used=used,
                                      shard_id=shard_id))
            prev_raw_id = pid
        for r in shard.rows:
            rpid, rstart = placements[r.row_id]
            bp = shard.pages[r.blob_page]
            shard.index_rows.append((r.row_id, rpid, rstart, rstart + 8 + len(r.raw), bp.page_type_id,
                                     r.blob_page, r.blob_start, r.blob_end, r.name))
            r.raw = b""  # the raw row is on disk now
        if shard.pages:
            os.ftruncate(fd, shard.file_end)


def _pwritev_all(fd: int, buffers: list[Any], offset: int) -> None:
    """Write every buffer at ``offset`` (pwritev may write less than asked; loop until done)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        # Linux caps one call at IOV_MAX buffers and ~2 GiB.
        batch = views[:512]
        written = os.pwritev(fd, batch, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, "write returned 0 bytes")
        offset += written
        while written:
            if written >= len(views[0]):
                written -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][written:]
                written = 0
