"""One file of a vendor-bin set, mapped, with its preamble, trailer and index validated before
anything is read from it (:class:`_VbinFile`); the reader (:mod:`.reader`) works on these."""

from __future__ import annotations

import json
import mmap
import os
import reprlib
from pathlib import Path
from typing import Any, TypeGuard

import xxhash

from vcga import dtypes, formatkit, tensors
from vcga.errors import VcgaChecksumError, VcgaFormatError
from vcga.formatkit import is_plain_name, more_json_objects_than, open_regular

from ._format import (
    _DOC_KEYS,
    _DOC_OPTIONAL,
    _ENTRY_KEYS,
    _ENTRY_OPTIONAL,
    _MAX_INDEX,
    _PREAMBLE,
    _TRAILER,
    FORMAT_NAME,
    MAGIC,
    MAX_ALIGNMENT,
    MAX_NDIM,
    MIN_ALIGNMENT,
    PREAMBLE_SIZE,
    TRAILER_MAGIC,
    TRAILER_SIZE,
    VERSION,
    _Record,
    _required_alignment,
)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: a repeated key is an error (plain json keeps the last one silently)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return d


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 80, 80, 40


def _short(value: Any) -> str:
    """A bounded repr of an untrusted index value for an error message: a value can be a
    megabyte string or a list nested hundreds deep, and the message must stay one short line."""
    return _REPR.repr(value)


def _is_int(x: object) -> TypeGuard[int]:
    return type(x) is int


def _is_str_map(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(v, str) for v in x.values())


def check_zero_padding(source: Any, start: int, data: Any) -> None:
    """That ``data``, the file's bytes from offset ``start`` on, are all zero: padding between
    tensors, where a flipped bit is damage like any other (the mapped and the read pass both ask)."""
    if any(data):
        bad = start + next(i for i, b in enumerate(data) if b)
        raise VcgaChecksumError(source, "non-zero byte in the padding between tensors (the file was damaged)",
                                offset=bad, expected="zero padding")


class _VbinFile:
    """One mapped vendor-bin file with its preamble, trailer and index validated."""

    def __init__(self, source: Any, buffer: Any, size: int, mm: mmap.mmap | None = None) -> None:
        self.source = source
        self.size = size
        self._mm = mm
        self.buf = memoryview(buffer)
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file mapped
        self._raw: dict[str, Any] = {}
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # every check names the byte offset it looked at and what it expected
    def _err(self, message: str, offset: int | None = None, expected: str | None = None) -> VcgaFormatError:
        return VcgaFormatError(self.source, message, offset=offset, expected=expected)

    def _parse(self) -> None:
        size = self.size
        if size < PREAMBLE_SIZE + TRAILER_SIZE:
            raise self._err(f"file is {size} bytes, too short for a vendor-bin file (truncated?)", size,
                            f"at least {PREAMBLE_SIZE + TRAILER_SIZE} bytes")
        # -- preamble
        magic, major, minor, alignment, file_id, _reserved, pre_sum = _PREAMBLE.unpack(self.buf[:PREAMBLE_SIZE])
        if magic != MAGIC:
            raise self._err(f"bad signature {bytes(magic)!r}: not a vendor-bin file", 0, repr(MAGIC))
        computed = xxhash.xxh3_64_intdigest(self.buf[:56])
        if computed != pre_sum:
            raise VcgaChecksumError(self.source, f"preamble checksum mismatch (computed {computed:016x})",
                                    offset=56, expected=f"{pre_sum:016x}")
        if major != VERSION[0]:
            raise self._err(f"vendor-bin version {major}.{minor} is not supported by this reader", 8,
                            f"major version {VERSION[0]}")
        if alignment < MIN_ALIGNMENT or alignment > MAX_ALIGNMENT or alignment & (alignment - 1):
            raise self._err(f"alignment {alignment} is invalid", 12,
                            f"a power of two between {MIN_ALIGNMENT} and {MAX_ALIGNMENT}")
        self.version = (major, minor)
        self.alignment = alignment
        self.file_id = bytes(file_id)
        # -- trailer
        t0 = size - TRAILER_SIZE
        (tmagic, tmajor, tminor, flags, index_offset, index_length, index_sum, tfile_id,
         trailer_sum) = _TRAILER.unpack(self.buf[t0:])
        if tmagic != TRAILER_MAGIC:
            raise self._err(f"no trailer (found {bytes(tmagic)!r}): the file is truncated or was not "
                            "completely written", t0, repr(TRAILER_MAGIC))
        computed = xxhash.xxh3_64_intdigest(self.buf[t0:t0 + 56])
        if computed != trailer_sum:
            raise VcgaChecksumError(self.source, f"trailer checksum mismatch (computed {computed:016x})",
                                    offset=t0 + 56, expected=f"{trailer_sum:016x}")
        if (tmajor, tminor) != (major, minor):
            raise self._err(f"trailer version {tmajor}.{tminor} differs from the preamble's {major}.{minor}",
                            t0 + 8, f"{major}.{minor}")
        if flags != 0:
            raise self._err(f"unknown trailer flags 0x{flags:08x}", t0 + 12, "0")
        if bytes(tfile_id) != self.file_id:
            raise self._err("trailer and preamble belong to different files", t0 + 40,
                            f"file id {self.file_id.hex()}")
        if index_offset < PREAMBLE_SIZE or index_offset > t0:
            raise self._err(f"index offset {index_offset} is outside the file", t0 + 16,
                            f"between {PREAMBLE_SIZE} and {t0}")
        if index_length != t0 - index_offset:
            raise self._err(f"index length {index_length} does not reach the trailer", t0 + 24,
                            f"{t0 - index_offset} (trailer at {t0}, index at {index_offset})")
        self.index_offset = index_offset
        # One read for the whole index (the mapping is advised random while it is parsed).
        self.advise(mmap.MADV_WILLNEED, index_offset, t0 - index_offset)
        index = self.buf[index_offset:t0]
        computed = xxhash.xxh3_64_intdigest(index)
        if computed != index_sum:
            raise VcgaChecksumError(self.source, f"index checksum mismatch (computed {computed:016x})",
                                    offset=index_offset, expected=f"{index_sum:016x}")
        # -- index
        # One object per tensor and per tensor's metadata, a few of the file's own, one per shard.
        limit = formatkit.MAX_TENSORS
        if more_json_objects_than(index, 2 * limit + 2 * 4096):
            raise self._err(f"index holds more JSON objects than {limit} tensors with their metadata; VCGA reads "
                            f"at most {limit} tensors from one file (vcga.formatkit.MAX_TENSORS)", index_offset)
        try:
            doc = json.loads(bytes(index).decode("ascii"), object_pairs_hook=_no_duplicates,
                             parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise self._err(f"index is not valid JSON: {str(e)[:200]}", index_offset, "an ASCII JSON object") from None
        self._check_doc(doc, index_offset)

    def _check_doc(self, doc: Any, at: int) -> None:
        if not isinstance(doc, dict):
            raise self._err("index is not a JSON object", at, "a JSON object")
        strict = self.version[1] <= VERSION[1]  # a newer minor may add keys we do not know
        missing = _DOC_KEYS - doc.keys()
        if missing:
            raise self._err(f"index lacks {sorted(missing)}", at, f"keys {sorted(_DOC_KEYS)}")
        if strict and doc.keys() - _DOC_KEYS - _DOC_OPTIONAL:
            raise self._err(f"index has unknown keys {sorted(doc.keys() - _DOC_KEYS - _DOC_OPTIONAL)}", at)
        if doc["format"] != FORMAT_NAME:
            raise self._err(f"index format is {_short(doc['format'])}", at, repr(FORMAT_NAME))
        if not (isinstance(doc["version"], list) and all(_is_int(v) for v in doc["version"])
                and doc["version"] == list(self.version)):
            raise self._err(f"index version {_short(doc['version'])} differs from the preamble's", at,
                            str(list(self.version)))
        if doc["file_id"] != self.file_id.hex():
            raise self._err("index belongs to a different file", at, f"file id {self.file_id.hex()}")
        if not _is_int(doc["alignment"]) or doc["alignment"] != self.alignment:
            raise self._err(f"index alignment {_short(doc['alignment'])} differs from the preamble's", at,
                            str(self.alignment))
        if not _is_str_map(doc["metadata"]):
            raise self._err("file metadata is not an object of strings", at, "a JSON object of strings")
        self.metadata: dict[str, str] = doc["metadata"]
        self.shard_info = doc.get("shard")
        if self.shard_info is not None and not (
                isinstance(self.shard_info, dict) and set(self.shard_info) == {"number"}
                and _is_int(self.shard_info["number"]) and self.shard_info["number"] >= 0):
            raise self._err(f"bad shard description {_short(self.shard_info)}", at, '{"number": <int >= 0>}')
        self.shards = doc.get("shards")
        if self.shards is not None:
            self._check_shards(self.shards, at)
        if not isinstance(doc["tensors"], list):
            raise self._err("index 'tensors' is not a list", at, "a JSON list")
        if len(doc["tensors"]) > formatkit.MAX_TENSORS:
            raise self._err(f"index lists {len(doc['tensors'])} tensors, more than the {formatkit.MAX_TENSORS} VCGA "
                            "reads from one file (vcga.formatkit.MAX_TENSORS)", at)
        self.records = self._check_tensors(doc["tensors"], at, strict, sharded=self.shards is not None)

    def _check_shards(self, shards: Any, at: int) -> None:
        if not isinstance(shards, list):
            raise self._err("index 'shards' is not a list", at, "a list of shard descriptions")
        seen: set[str] = set()
        for i, s in enumerate(shards):
            if not (isinstance(s, dict) and set(s) == {"file", "file_id", "size", "tensors"}):
                raise self._err(f"shard {i}: bad description {_short(s)}", at,
                                "keys file, file_id, size, tensors")
            name = s["file"]
            # A shard name is a plain file name in the index's directory: no path can escape it.
            if not is_plain_name(name) or Path(name).name != name or name in seen:
                raise self._err(f"shard {i}: file name {_short(name)} is not a plain file name in the index's "
                                "directory", at, "a unique base name without path separators or '..'")
            seen.add(name)
            fid = s["file_id"]
            if not (isinstance(fid, str) and len(fid) == 32 and all(c in "0123456789abcdef" for c in fid)):
                raise self._err(f"shard {i}: bad file id {_short(fid)}", at, "32 lowercase hex digits")
            if not (_is_int(s["size"]) and s["size"] >= PREAMBLE_SIZE + TRAILER_SIZE
                    and _is_int(s["tensors"]) and s["tensors"] >= 0):
                raise self._err(f"shard {i}: bad size or tensor count", at, "non-negative integers")

    def _check_tensors(self, items: list[Any], at: int, strict: bool, sharded: bool) -> list[_Record]:
        records: list[_Record] = []
        names: set[str] = set()
        end = PREAMBLE_SIZE  # end of the previous tensor's bytes (in its shard, when sharded)
        nshards = len(self.shards) if sharded and self.shards is not None else 0
        current_shard = 0
        allowed = _ENTRY_KEYS | _ENTRY_OPTIONAL
        for i, t in enumerate(items):
            if not isinstance(t, dict):
                raise self._err(f"tensor #{i} is not an object", at, "a JSON object")
            if not t.keys() >= _ENTRY_KEYS:
                raise self._err(f"tensor #{i} lacks {sorted(_ENTRY_KEYS - t.keys())}", at,
                                f"keys {sorted(_ENTRY_KEYS)}")
            if strict and t.keys() - allowed:
                raise self._err(f"tensor #{i} has unknown keys {sorted(t.keys() - allowed)}", at)
            name = t["name"]
            if not isinstance(name, str):
                raise self._err(f"tensor #{i}: name {_short(name)} is not a string", at, "a string")
            if name in names:
                raise self._err(f"duplicate tensor name {_short(name)}", at, "unique names")
            names.add(name)
            what = f"tensor {_short(name)}"
            dtype = t["dtype"]
            if not isinstance(dtype, str) or dtype not in dtypes.DTYPES:
                raise self._err(f"{what}: unknown dtype {_short(dtype)}", at, f"one of {', '.join(dtypes.EVERY)}")
            shape = t["shape"]
            if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
                    and all(_is_int(d) and 0 <= d <= _MAX_INDEX for d in shape)):
                raise self._err(f"{what}: bad shape {_short(shape)}", at,
                                f"a list of at most {MAX_NDIM} non-negative int64 values")
            numel, nonzero = 1, 1
            for d in shape:
                numel *= d
                nonzero *= d or 1
                if nonzero > _MAX_INDEX:
                    raise self._err(f"{what}: shape {shape} has more elements than int64 can index", at)
            nbytes, offset = t["nbytes"], t["offset"]
            itemsize = dtypes.DTYPES[dtype].itemsize
            if not _is_int(nbytes) or nbytes != numel * itemsize:
                raise self._err(f"{what}: nbytes {_short(nbytes)} does not match shape {shape} of {dtype}", at,
                                str(numel * itemsize))
            if not _is_int(offset):
                raise self._err(f"{what}: offset {_short(offset)} is not an integer", at, "an integer")
            if nbytes == 0 and offset != 0:
                raise self._err(f"{what}: an empty tensor has offset {offset}", at, "0")
            shard = t.get("shard")
            if sharded:
                if not (_is_int(shard) and current_shard <= shard < nshards):
                    raise self._err(f"{what}: shard {_short(shard)} is not one of the {nshards} shards in order", at,
                                    f"an integer in [{current_shard}, {nshards})")
                if shard != current_shard:
                    current_shard, end = shard, PREAMBLE_SIZE  # offsets restart in the next shard
            elif shard is not None:
                raise self._err(f"{what}: a 'shard' field in a file that is not a shard index", at)
            if nbytes:
                align = _required_alignment(nbytes, self.alignment)
                if offset % align:
                    raise self._err(f"{what}: offset {offset} is not aligned", at, f"a multiple of {align}")
                if offset < end:
                    raise self._err(f"{what}: offset {offset} overlaps the preamble or the previous tensor", at,
                                    f"at least {end}")
                limit = self.index_offset if not sharded else None
                if limit is not None and offset + nbytes > limit:
                    raise self._err(f"{what}: bytes {offset}..{offset + nbytes} run past the tensor data, "
                                    f"which ends at the index ({limit})", at, f"an end <= {limit}")
                end = offset + nbytes
            try:
                digest = tensors.parse_checksum(t["checksum"])
            except ValueError as e:
                raise self._err(f"{what}: {e}", at, "xxh3_64:<16 lowercase hex>") from None
            meta = t.get("metadata", {})
            if not _is_str_map(meta):
                raise self._err(f"{what}: metadata is not an object of strings", at, "a JSON object of strings")
            records.append(_Record(name, dtype, tuple(shape), offset, nbytes, digest, meta, shard))
        if sharded:
            end = PREAMBLE_SIZE  # offsets refer to the shard files: the index file holds no tensor bytes
        if end != self.index_offset:
            # Every byte is accounted for: the index starts where the last tensor ends.
            raise self._err(f"index starts at {self.index_offset}, not where the tensor data ends ({end})",
                            self.size - TRAILER_SIZE + 16, str(end))
        return records

    def view(self, rec: _Record) -> memoryview:
        return self.buf[rec.offset:rec.offset + rec.nbytes]

    def release(self, rec: _Record) -> None:
        """Drop a tensor's pages from this process's resident memory (they fault back in from the
        page cache if read again). Skipped once tensors sharing the mapping were handed out: a
        write through one of them made a private page that dropping would silently undo."""
        if self._mm is None or self._raw or not rec.nbytes:
            return
        page = mmap.PAGESIZE
        start = -(-rec.offset // page) * page
        stop = (rec.offset + rec.nbytes) // page * page
        if stop > start:
            try:
                self._mm.madvise(mmap.MADV_DONTNEED, start, stop - start)
            except (OSError, ValueError, AttributeError):  # only a hint
                pass

    def raw(self, framework: str) -> Any:
        """The whole file as one uint8 array/tensor to cut tensors from; None when torch cannot
        share it (a read-only buffer)."""
        if framework not in self._raw:
            self._raw[framework] = (None if framework == "pt" and self.buf.readonly
                                    else tensors.raw_bytes(self.buf, framework))
        return self._raw[framework]

    def check_padding(self) -> None:
        """Every byte between tensors is zero (flips there are caught here)."""
        pos = PREAMBLE_SIZE
        own = self.records if self.shards is None else []  # a shard index's records live in the shards
        for rec in sorted((r for r in own if r.nbytes), key=lambda r: r.offset):
            self._check_zero(pos, rec.offset)
            pos = rec.offset + rec.nbytes
        self._check_zero(pos, self.index_offset)

    def _check_zero(self, start: int, stop: int) -> None:
        if stop > start:
            check_zero_padding(self.source, start, self.buf[start:stop])

    def advise(self, advice: int, start: int = 0, length: int | None = None) -> None:
        """``madvise`` the mapping, or the pages covering ``[start, start + length)`` of it."""
        if self._mm is not None:
            try:
                if length is None:
                    self._mm.madvise(advice)
                elif length > 0:
                    first = start // mmap.PAGESIZE * mmap.PAGESIZE
                    self._mm.madvise(advice, first, start + length - first)
            except (OSError, ValueError, AttributeError):  # advice is only a hint
                pass

    def close(self) -> None:
        self._raw.clear()
        try:
            self.buf.release()
        except BufferError:
            pass
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # Tensors handed out still view the mapping; it closes when the last one is freed.
                pass
            self._mm = None


def _map_file(path: Path) -> _VbinFile:
    with os.fdopen(open_regular(path), "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        if size < PREAMBLE_SIZE + TRAILER_SIZE:
            data = f.read(size + 1)
            return _VbinFile(path, data[:size], len(data[:size]))
        try:
            # A private (copy-on-write) mapping: tensors made from it are writable, and a write
            # changes only this process's copy of the page -- the file is never modified.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError:
            # Strict overcommit can refuse a writable private mapping: fall back to read-only
            # (torch tensors are then copied, see vcga.tensors.to_torch).
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # Parsing touches the preamble, the trailer and the index only: a cold fault then reads just
    # its page, not the kernel's read-around of up to 8 MiB on each side of it, read before the
    # caller has asked for any tensor (docs/vendor-bin.md, "Piece sizes and access patterns").
    # Lazy tensor access gets the read-around back.
    random = getattr(mmap, "MADV_RANDOM", None)
    if random is not None:
        try:
            mm.madvise(random)
        except OSError:  # only a hint
            pass
    vf = _VbinFile(path, mm, len(mm), mm)  # closes the mapping itself if the file is bad
    if random is not None:
        vf.advise(mmap.MADV_NORMAL)
    vf.identity = (st.st_dev, st.st_ino)
    return vf
