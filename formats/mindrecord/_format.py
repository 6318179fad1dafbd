"""The MindRecord file format, byte by byte: header, pages, blob rows, raw rows, integer compression.

This module knows the on-disk layout of MindSpore 2.x MindRecord files (checked against files written
by ``mindspore==2.10.0`` and against ``mindspore/ccsrc/minddata/mindrecord``); it knows nothing about
tensors. :mod:`.reader` and :mod:`.writer` build the tensor convention of ``docs/mindrecord.md`` on top.

Layout of one data file (a *shard*)::

    u64 LE json_len | header JSON (json_len bytes) | zeros up to header_size
    page 0 at header_size, page p at header_size + p * page_size (only the last page is not padded)

A BLOB page holds rows ``u64 LE len + blob``; a RAW page holds rows ``u64 LE len + msgpack map``.
Where each row of each page is, is recorded in the SQLite ``<file>.db`` beside the shard (:mod:`._index`).

Every parser here validates what it reads and raises :class:`~vcga.errors.VcgaFormatError`; nothing
allocates more than the caller has already bounded by the file size.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from vcga import formatkit
from vcga.errors import VcgaFormatError
from vcga.formatkit import is_plain_name

__all__ = [
    "MIN_HEADER_SIZE",
    "MAX_HEADER_SIZE",
    "MIN_PAGE_SIZE",
    "MAX_PAGE_SIZE",
    "DEFAULT_HEADER_SIZE",
    "DEFAULT_PAGE_SIZE",
    "MAX_SHARD_COUNT",
    "VERSION",
    "SUPPORTED_VERSIONS",
    "FIELD_TYPES",
    "BLOB_PAGE",
    "RAW_PAGE",
    "Field",
    "Schema",
    "Page",
    "Header",
    "parse_header",
    "serialize_header",
    "compress_int_array",
    "decompress_int_array",
    "pack_raw_row",
    "unpack_raw_row",
    "check_shard_basename",
    "shard_file_names",
]

# Limits FileWriter enforces (shard_writer.cc SetHeaderSize / SetPageSize, filewriter.py shard_num).
MIN_HEADER_SIZE = 1 << 14  # 16 KiB
MAX_HEADER_SIZE = 1 << 27  # 128 MiB
MIN_PAGE_SIZE = 1 << 15  # 32 KiB
MAX_PAGE_SIZE = 1 << 28  # 256 MiB
DEFAULT_HEADER_SIZE = 1 << 24  # 16 MiB, FileWriter's default
DEFAULT_PAGE_SIZE = 1 << 25  # 32 MiB, FileWriter's default
MAX_SHARD_COUNT = 1000

VERSION = "3.0"  # what MindSpore 2.x writes; integer arrays in blobs are compressed from 3.0 on
SUPPORTED_VERSIONS = ("2.0", "3.0")  # what MindSpore 2.x's reader accepts (kSupportedVersion)

#: Field types a MindRecord schema may use (shard_column.h ColumnDataTypeMap).
FIELD_TYPES = ("bytes", "string", "int32", "int64", "float32", "float64")
_NUMPY_OF = {"int32": "<i4", "int64": "<i8", "float32": "<f4", "float64": "<f8"}

BLOB_PAGE = "BLOB_DATA"
RAW_PAGE = "RAW_DATA"

_U64LE = struct.Struct("<Q")
_U64BE = struct.Struct(">Q")
_U32BE = struct.Struct(">I")


# ---------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One schema field: ``{"type": ...}`` or ``{"type": ..., "shape": [...]}``.

    A field is stored in the blob when its type is ``bytes`` or it has a shape (an array);
    every other field is a scalar stored in the raw (msgpack) row.
    """

    name: str
    type: str
    shape: tuple[int, ...] | None = None

    @property
    def in_blob(self) -> bool:
        return self.type == "bytes" or self.shape is not None

    @property
    def is_int_array(self) -> bool:
        return self.shape is not None and self.type in ("int32", "int64")

    @property
    def numpy_dtype(self) -> np.dtype:
        """Element dtype of an array field (``bytes`` reads as uint8)."""
        return np.dtype(_NUMPY_OF.get(self.type, "u1"))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.shape is not None:
            out["shape"] = list(self.shape)
        out["type"] = self.type
        return out


@dataclass(frozen=True)
class Schema:
    """The single schema of a MindRecord dataset (MindSpore allows exactly one)."""

    fields: Mapping[str, Field]
    blob_fields: tuple[str, ...]
    desc: str

    @property
    def raw_fields(self) -> tuple[str, ...]:
        return tuple(n for n in sorted(self.fields) if not self.fields[n].in_blob)

    @property
    def compresses_integers(self) -> bool:
        """shard_column.cc: a schema with any int32/int64 array compresses those arrays (version >= 3.0)."""
        return any(f.is_int_array for f in self.fields.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "blob_fields": list(self.blob_fields),
            "desc": self.desc,
            "schema": {n: self.fields[n].to_json() for n in sorted(self.fields)},
        }

    @staticmethod
    def build(fields: Sequence[Field], desc: str) -> Schema:
        by_name = {f.name: f for f in fields}
        return Schema(by_name, tuple(sorted(n for n, f in by_name.items() if f.in_blob)), desc)


# ---------------------------------------------------------------------------------------------------
# Header
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    """One page entry of a shard header. ``used`` is the header's ``page_size`` (bytes used)."""

    page_id: int
    page_type: str
    page_type_id: int
    start_row_id: int
    end_row_id: int
    row_group_ids: tuple[tuple[int, int], ...]
    used: int
    shard_id: int

    def to_json(self) -> dict[str, Any]:
        groups = self.row_group_ids or ((0, 0),)  # shard_page.cc writes {"id":0,"offset":0} for none
        return {
            "end_row_id": self.end_row_id,
            "page_id": self.page_id,
            "page_size": self.used,
            "page_type": self.page_type,
            "page_type_id": self.page_type_id,
            "row_group_ids": [{"id": g, "offset": o} for g, o in groups],
            "shard_id": self.shard_id,
            "start_row_id": self.start_row_id,
        }


@dataclass(frozen=True)
class Header:
    """A validated shard header."""

    header_size: int
    page_size: int
    compression_size: int
    index_fields: tuple[str, ...]
    pages: tuple[Page, ...]
    schema: Schema
    shard_addresses: tuple[str, ...]
    shard_id: int
    version: str
    json_len: int

    @property
    def row_count(self) -> int:
        return sum(p.end_row_id - p.start_row_id for p in self.pages if p.page_type == BLOB_PAGE)

    def page_offset(self, page_id: int) -> int:
        """Absolute file offset where page ``page_id`` starts."""
        return self.header_size + page_id * self.page_size


def serialize_header(
    *,
    header_size: int,
    page_size: int,
    compression_size: int,
    index_fields: Sequence[str],
    pages: Sequence[Page],
    schema: Schema,
    shard_addresses: Sequence[str],
    shard_id: int,
) -> bytes:
    """The header JSON exactly as MindSpore 2.10 writes it: this key order at the top level
    (shard_header.cc SerializeHeader), keys sorted inside objects (nlohmann::json), compact separators,
    ``null`` for an empty page or index list."""
    dump = lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False)  # noqa: E731
    index = [{"index_field": f, "schema_id": 0} for f in index_fields] or None
    page = [p.to_json() for p in pages] or None
    text = (
        "{"
        f'"header_size":{header_size},'
        f'"index_fields":{dump(index)},'
        f'"page":{dump(page)},'
        f'"page_size":{page_size},'
        f'"compression_size":{compression_size},'
        f'"schema":{dump([schema.to_json()])},'
        f'"shard_addresses":{dump(list(shard_addresses))},'
        f'"shard_id":{shard_id},'
        '"statistics":null,'
        f'"version":{dump(VERSION)}'
        "}"
    )
    return text.encode("utf-8")


def _int(obj: Any, key: str, path: Any, *, lo: int = 0, hi: int = 1 << 63) -> int:
    v = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise VcgaFormatError(path, f"MindRecord header: {key!r} is {v!r}", expected=f"an integer in [{lo}, {hi}]")
    return v


def check_shard_basename(name: Any, path: Any) -> str:
    """A shard address must be a plain file name in the same directory: no separators, no '..'.

    MindSpore joins ``shard_addresses`` to the directory of the file it was given; a name with a
    separator would let a crafted file make the reader open files elsewhere."""
    if not is_plain_name(name) or len(name.encode("utf-8", "surrogatepass")) > 255:
        raise VcgaFormatError(
            path, f"MindRecord header: shard address {name!r} is not a plain file name",
            expected="a file name in the same directory, without '/', '\\\\' or '..'")
    return name


def _parse_schema(raw: Any, path: Any) -> Schema:
    if not isinstance(raw, list) or len(raw) != 1 or not isinstance(raw[0], dict):
        raise VcgaFormatError(path, "MindRecord header: 'schema' must be a list holding one schema object")
    sch = raw[0]
    desc, body, blob = sch.get("desc"), sch.get("schema"), sch.get("blob_fields")
    if not isinstance(desc, str) or not isinstance(body, dict) or not body or not isinstance(blob, list):
        raise VcgaFormatError(path, "MindRecord header: schema needs 'desc' (string), 'schema' (non-empty object) "
                                    "and 'blob_fields' (list)")
    fields = []
    for name, spec in body.items():
        if not isinstance(spec, dict) or spec.get("type") not in FIELD_TYPES or not set(spec) <= {"type", "shape"}:
            raise VcgaFormatError(path, f"MindRecord header: field {name!r} has an invalid definition {spec!r}",
                                  expected=f"{{'type': one of {', '.join(FIELD_TYPES)}, optional 'shape'}}")
        shape = spec.get("shape")
        if shape is not None:
            if (not isinstance(shape, list) or not shape or len(shape) > 64
                    or any(not isinstance(d, int) or isinstance(d, bool) or not (d == -1 or 0 < d < 1 << 62)
                           for d in shape)
                    or shape.count(-1) > 1 or spec["type"] == "string"):
                raise VcgaFormatError(path, f"MindRecord header: field {name!r} has an invalid shape {shape!r}")
            shape = tuple(shape)
        fields.append(Field(name, spec["type"], shape))
    schema = Schema.build(fields, desc)
    if len(set(blob)) != len(blob) or set(blob) != set(schema.blob_fields):
        raise VcgaFormatError(path, f"MindRecord header: blob_fields {blob!r} do not match the schema",
                              expected=repr(list(schema.blob_fields)))
    # Keep the header's order: it is the order of the fields inside each blob.
    return Schema(schema.fields, tuple(blob), desc)


def _parse_pages(raw: Any, shard_id: int, page_size: int, path: Any) -> tuple[Page, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise VcgaFormatError(path, "MindRecord header: 'page' must be a list")
    pages = []
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise VcgaFormatError(path, f"MindRecord header: page entry {i} is not an object")
        pid = _int(p, "page_id", path)
        if pid != i:
            raise VcgaFormatError(path, f"MindRecord header: page entry {i} has page_id {pid}", expected=str(i))
        ptype = p.get("page_type")
        if ptype not in (BLOB_PAGE, RAW_PAGE):
            raise VcgaFormatError(path, f"MindRecord header: page {i} has page_type {ptype!r}",
                                  expected=f"{BLOB_PAGE} or {RAW_PAGE}")
        if _int(p, "shard_id", path) != shard_id:
            raise VcgaFormatError(path, f"MindRecord header: page {i} belongs to shard {p['shard_id']}",
                                  expected=f"shard {shard_id}")
        groups_raw = p.get("row_group_ids")
        if not isinstance(groups_raw, list) or len(groups_raw) > page_size:
            raise VcgaFormatError(path, f"MindRecord header: page {i} has invalid row_group_ids")
        groups = tuple((_int(g, "id", path), _int(g, "offset", path, hi=page_size)) for g in groups_raw)
        start, end = _int(p, "start_row_id", path), _int(p, "end_row_id", path)
        if end < start:
            raise VcgaFormatError(path, f"MindRecord header: page {i} ends at row {end} before it starts ({start})")
        pages.append(Page(pid, ptype, _int(p, "page_type_id", path), start, end, groups,
                          _int(p, "page_size", path, hi=page_size), shard_id))
    return tuple(pages)


def parse_header(blob: bytes, file_size: int, path: Any) -> Header:
    """Validate and parse the header JSON of one shard (``blob`` is the JSON text, without the u64)."""
    # Pages hold a row each at least, so a header within the limit on rows lists as many pages,
    # beside a few objects of its own (schema, fields).
    if formatkit.more_json_objects_than(blob, formatkit.MAX_TENSORS + 4096):
        raise VcgaFormatError(path, f"MindRecord header lists more pages than the {formatkit.MAX_TENSORS} rows VCGA "
                              "reads from one dataset (vcga.formatkit.MAX_TENSORS)", offset=8)
    try:
        h = json.loads(blob)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise VcgaFormatError(path, f"MindRecord header is not valid JSON ({e})", offset=8) from None
    if not isinstance(h, dict):
        raise VcgaFormatError(path, "MindRecord header is not a JSON object", offset=8)
    version = h.get("version")
    if version not in SUPPORTED_VERSIONS:
        raise VcgaFormatError(path, f"MindRecord version {version!r} is not supported",
                              expected=" or ".join(SUPPORTED_VERSIONS))
    json_len = len(blob)
    header_size = _int(h, "header_size", path, lo=8 + json_len, hi=MAX_HEADER_SIZE)
    page_size = _int(h, "page_size", path, lo=1, hi=MAX_PAGE_SIZE)
    shard_id = _int(h, "shard_id", path, hi=MAX_SHARD_COUNT - 1)
    addresses = h.get("shard_addresses")
    if not isinstance(addresses, list) or not 1 <= len(addresses) <= MAX_SHARD_COUNT:
        raise VcgaFormatError(path, "MindRecord header: 'shard_addresses' must list 1 to "
                                    f"{MAX_SHARD_COUNT} file names")
    addresses = tuple(check_shard_basename(a, path) for a in addresses)
    if shard_id >= len(addresses):
        raise VcgaFormatError(path, f"MindRecord header: shard_id {shard_id} but only {len(addresses)} shard addresses")
    schema = _parse_schema(h.get("schema"), path)
    index_raw = h.get("index_fields")
    if index_raw is None:
        index_raw = []
    if not isinstance(index_raw, list) or not all(
            isinstance(f, dict) and isinstance(f.get("index_field"), str) for f in index_raw):
        raise VcgaFormatError(path, "MindRecord header: 'index_fields' must be a list of {index_field, schema_id}")
    index_fields = tuple(f["index_field"] for f in index_raw)
    for f in index_fields:
        if f not in schema.fields or schema.fields[f].in_blob:
            raise VcgaFormatError(path, f"MindRecord header: index field {f!r} is not a scalar field of the schema")
    compression = h.get("compression_size", 0)
    if not isinstance(compression, int) or isinstance(compression, bool):
        raise VcgaFormatError(path, f"MindRecord header: compression_size is {compression!r}", expected="an integer")
    pages = _parse_pages(h.get("page"), shard_id, page_size, path)
    for p in pages:
        start = header_size + p.page_id * page_size
        if start + p.used > file_size:
            raise VcgaFormatError(
                path, f"MindRecord page {p.page_id} ({p.page_type}) claims {p.used} bytes at offset {start}, "
                      f"beyond the end of the file ({file_size} bytes); the file is truncated or its header corrupt",
                offset=start)
    return Header(header_size, page_size, compression, index_fields, pages, schema, addresses, shard_id,
                  version, json_len)


def shard_file_names(base: str, count: int) -> list[str]:
    """FileWriter's names: ``base`` for one shard, else ``base0 .. base{N-1}`` padded to the width of N-1."""
    if count == 1:
        return [base]
    width = len(str(count - 1))
    return [f"{base}{str(i).rjust(width, '0')}" for i in range(count)]


# ---------------------------------------------------------------------------------------------------
# Integer-array compression (version 3.0; shard_column.cc CompressInt / UncompressInt)
# ---------------------------------------------------------------------------------------------------
#
#   u32 BE count | bitmap: 2 bits per element, MSB first (0 int8, 1 int16, 2 int32, 3 int64) |
#   each value little-endian in the narrowest signed width that holds it.

_WIDTH = np.array([1, 2, 4, 8], dtype=np.int64)
_LIMITS = [(-(1 << 7), (1 << 7) - 1), (-(1 << 15), (1 << 15) - 1), (-(1 << 31), (1 << 31) - 1)]


def compress_int_array(values: np.ndarray) -> bytes:
    """Compress a 1-D int32/int64 array the way MindSpore does (any length, vectorised)."""
    v = np.ascontiguousarray(values, dtype=np.int64).reshape(-1)
    n = v.size
    code = np.full(n, 3, dtype=np.uint8)
    for c, (lo, hi) in reversed(list(enumerate(_LIMITS))):
        code[(v >= lo) & (v <= hi) & (code > c)] = c
    padded = np.zeros(-(-n // 4) * 4, dtype=np.uint8)
    padded[:n] = code
    quads = padded.reshape(-1, 4)
    bitmap = (quads[:, 0] << 6) | (quads[:, 1] << 4) | (quads[:, 2] << 2) | quads[:, 3]
    # Little-endian bytes of every value, then keep the first width(code) bytes of each.
    le = v.astype("<i8").view(np.uint8).reshape(n, 8)
    keep = np.arange(8)[None, :] < _WIDTH[code][:, None]
    return _U32BE.pack(n) + bitmap.astype(np.uint8).tobytes() + le[keep].tobytes()


def decompress_int_array(buf: bytes | memoryview, out_dtype: str, path: Any, what: str) -> np.ndarray:
    """Inverse of :func:`compress_int_array`; every length is checked against ``buf``."""
    b = memoryview(buf)
    if len(b) < 4:
        raise VcgaFormatError(path, f"{what}: compressed integer array shorter than its 4-byte count")
    n = _U32BE.unpack_from(b, 0)[0]
    nbitmap = -(-n // 4)
    if 4 + nbitmap + n > len(b):  # every element needs at least one byte
        raise VcgaFormatError(path, f"{what}: compressed integer array claims {n} elements in {len(b)} bytes")
    bitmap = np.frombuffer(b, dtype=np.uint8, count=nbitmap, offset=4)
    codes = np.empty(nbitmap * 4, dtype=np.uint8)
    codes[0::4], codes[1::4], codes[2::4], codes[3::4] = bitmap >> 6, (bitmap >> 4) & 3, (bitmap >> 2) & 3, bitmap & 3
    codes = codes[:n]
    widths = _WIDTH[codes]
    body = len(b) - 4 - nbitmap
    if int(widths.sum()) != body:
        raise VcgaFormatError(path, f"{what}: compressed integer array holds {body} value bytes, "
                                    f"its bitmap says {int(widths.sum())}")
    out_info = np.iinfo(out_dtype)
    if n and _WIDTH[codes].max() > out_info.bits // 8:
        raise VcgaFormatError(path, f"{what}: compressed value wider than the field's {out_dtype}")
    raw = np.frombuffer(b, dtype=np.uint8, offset=4 + nbitmap)
    out = np.zeros(n, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(widths)[:-1])) if n else np.zeros(0, dtype=np.int64)
    for c, w in enumerate((1, 2, 4, 8)):
        sel = np.nonzero(codes == c)[0]
        if sel.size:
            idx = starts[sel][:, None] + np.arange(w)[None, :]
            out[sel] = raw[idx].copy().view(f"<i{w}").reshape(-1)
    return out.astype(out_dtype)


# ---------------------------------------------------------------------------------------------------
# Raw rows (msgpack, as nlohmann::json::to_msgpack writes them)
# ---------------------------------------------------------------------------------------------------


def pack_raw_row(row: Mapping[str, Any]) -> bytes:
    """msgpack map with sorted keys. msgpack-python chooses the same encodings nlohmann does for the
    strings and integers VCGA writes (fixstr/str8/str16, positive fixint/uint8.., negative fixint/int8..)."""
    return msgpack.packb({k: row[k] for k in sorted(row)}, use_bin_type=True)


def unpack_raw_row(buf: bytes, path: Any, what: str, max_fields: int = 64) -> dict[str, Any]:
    """One raw row: a map of at most ``max_fields`` scalars. unpackb derives its byte limits from
    len(buf); the map and array limits keep a crafted row from becoming millions of Python objects."""
    try:
        row = msgpack.unpackb(buf, raw=False, strict_map_key=True, max_map_len=max_fields, max_array_len=0)
    except Exception as e:  # noqa: BLE001 - msgpack reports malformed input with several exception types
        raise VcgaFormatError(path, f"{what}: raw row is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(row, dict):
        raise VcgaFormatError(path, f"{what}: raw row is a {type(row).__name__}, not a map")
    return row
