"""Reading vendor-bin: :class:`VbinReader`, mapped, validated before use (summary in :mod:`vcga.formats.vbin`)."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import reprlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from vcga import dtypes, tensors
from vcga.contract import TensorEntry
from vcga.errors import VcgaChecksumError, VcgaFormatError
from vcga.formatkit import ReaderContext

from ._format import (
    FORMAT_NAME,
    MAGIC,
    MAX_ALIGNMENT,
    MAX_NDIM,
    MIN_ALIGNMENT,
    PREAMBLE_SIZE,
    TRAILER_MAGIC,
    TRAILER_SIZE,
    VERSION,
    _DOC_KEYS,
    _DOC_OPTIONAL,
    _ENTRY_KEYS,
    _ENTRY_OPTIONAL,
    _MAX_INDEX,
    _PREAMBLE,
    _Record,
    _TRAILER,
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


def _is_int(x: Any) -> bool:
    return type(x) is int


def _is_str_map(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(v, str) for v in x.values())


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
            if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
                    or "\0" in name or os.sep in name or (os.altsep and os.altsep in name)
                    or Path(name).name != name or name in seen):
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
            if not _ENTRY_KEYS <= t.keys():
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
        if stop > start and any(self.buf[start:stop]):
            gap = bytes(self.buf[start:stop])
            bad = start + next(i for i, b in enumerate(gap) if b)
            raise VcgaChecksumError(self.source, "non-zero byte in the padding between tensors "
                                    "(the file was damaged)", offset=bad, expected="zero padding")

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
    with open(path, "rb") as f:
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
    # caller has asked for any tensor (measured on a cold 128 MiB shard: opening took 14 ms with
    # the read-around, 1.2 ms without, and the whole load was faster; docs/benchmarks.md).
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


# Bytes per read of read_in_order: each piece is hashed right after its read, while it is still
# in the CPU's cache. Measured on a 128 MiB shard (docs/benchmarks.md): warm 3.1 GB/s with 1 MiB
# against 2.8 with 8 MiB; cold all sizes from 256 KiB to 16 MiB read at the disk's pace.
READ_CHUNK = 1 << 20


class _Pass:
    """One sequential pass of reads over a file of a set (:meth:`VbinReader.read_in_order`):
    the same file that was opened and validated (a file replaced since is an error), read with
    ``pread`` in pieces of at most :data:`READ_CHUNK` bytes, each hashed right after its read."""

    def __init__(self, f: _VbinFile, owner: VbinReader) -> None:
        self.f = f
        self.owner = owner
        self.fd = -1
        if f.identity is not None:  # a mapped file (not bytes in memory)
            self.fd = os.open(f.source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                st = os.fstat(self.fd)
                if (st.st_dev, st.st_ino) != f.identity or st.st_size != f.size:
                    raise VcgaFormatError(f.source, "was replaced while it was being read",
                                          expected=f"the file opened, of {f.size} bytes")
            except BaseException:
                os.close(self.fd)
                raise

    def __enter__(self) -> _Pass:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def scratch(self, nbytes: int) -> memoryview:
        """A buffer of the reader's of ``nbytes`` (reused: valid until the next call)."""
        buf = self.owner._scratch
        if len(buf) < nbytes:
            # Replaced, never resized: a tensor still viewing the old one keeps it alive.
            buf = self.owner._scratch = bytearray(max(nbytes, min(2 * len(buf), READ_CHUNK)))
        return memoryview(buf)[:nbytes]

    def _fill(self, offset: int, view: memoryview) -> None:
        if self.fd < 0:
            view[:] = self.f.buf[offset:offset + view.nbytes]
            return
        done, n = 0, view.nbytes
        while done < n:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise VcgaFormatError(self.f.source, "ended early: it was truncated while being read",
                                      offset=offset + done, expected=f"{self.f.size} bytes")
            done += got

    def read(self, offset: int, data: memoryview, verify: bool) -> int:
        """Read ``data.nbytes`` bytes at ``offset`` into ``data``; their XXH3-64 (0 unverified)."""
        h = xxhash.xxh3_64() if verify else None
        for start in range(0, data.nbytes, READ_CHUNK):
            piece = data[start:start + READ_CHUNK]
            self._fill(offset + start, piece)
            if h is not None:
                h.update(piece)
        return h.intdigest() if h is not None else 0

    def hash(self, offset: int, nbytes: int) -> int:
        """The XXH3-64 of ``nbytes`` bytes at ``offset``, read in pieces into the scratch buffer."""
        h = xxhash.xxh3_64()
        for start in range(0, nbytes, READ_CHUNK):
            piece = self.scratch(min(READ_CHUNK, nbytes - start))
            self._fill(offset + start, piece)
            h.update(piece)
        return h.intdigest()

    def zeros(self, start: int, stop: int) -> None:
        """That the padding ``[start, stop)`` is all zero bytes."""
        for at in range(start, stop, READ_CHUNK):
            piece = self.scratch(min(READ_CHUNK, stop - at))
            self._fill(at, piece)
            if any(piece):
                bad = at + next(i for i, b in enumerate(piece) if b)
                raise VcgaChecksumError(self.f.source, "non-zero byte in the padding between tensors "
                                        "(the file was damaged)", offset=bad, expected="zero padding")


class VbinReader(ReaderContext):
    """Reads a vendor-bin checkpoint (one file or a sharded set) lazily from a mapping.

    A :class:`~vcga.contract.FormatReader`. Opening validates the preamble, trailer and index of
    the file (of the index file and, on first use, of each shard); tensor data is not touched
    until asked for. Tensors are views of the mapping: :meth:`numpy` and :meth:`torch` copy nothing.

    :param source: a path, or the bytes of a single (unsharded) file.
    :param verify: check each tensor's checksum the first time its data is accessed (default).
        With ``verify=False`` nothing is hashed until :meth:`verify` is called.
    :param framework: what :meth:`get_tensor` returns: "pt" (torch) or "np" (numpy).
    """

    def __init__(self, source: str | os.PathLike[str] | bytes | bytearray | memoryview, *,
                 verify: bool = True, framework: str = "pt") -> None:
        self.verify_on_access = verify
        self.framework = framework
        self._verified: set[str] = set()
        self._scratch = bytearray()  # read_in_order's buffer for tensors read without a destination
        if isinstance(source, (bytes, bytearray, memoryview)):
            self.path: Path | None = None
            mv = tensors.byte_view(source)
            root = _VbinFile("<bytes>", mv, mv.nbytes)
        else:
            self.path = Path(source)
            root = _map_file(self.path)
        self._root = root
        self.metadata: Mapping[str, str] = root.metadata
        self._shards: list[_VbinFile | None] = []
        if root.shards is not None:
            if self.path is None:
                raise VcgaFormatError("<bytes>", "a shard index read from memory cannot open its shards",
                                      expected="a path")
            self._shards = [None] * len(root.shards)
        self._records = root.records
        self._by_name = {r.name: r for r in self._records}

    # -- FormatReader ----------------------------------------------------------------------------

    def index(self) -> list[TensorEntry]:
        """Every tensor's name, dtype, shape, metadata and stored checksum (``data=None``)."""
        return [r.entry(None) for r in self._records]

    def entries(self) -> Iterator[TensorEntry]:
        """Each tensor with its data (a read-only view of the mapping), in file order.

        Streaming: once the next entry is requested, the previous one's pages leave this process's
        resident memory (its view stays valid), so reading a whole checkpoint costs about one
        tensor of memory rather than the file's size."""
        prev: _Record | None = None
        for rec in self._records:
            if prev is not None:
                self._file_of(prev).release(prev)
            entry = self._entry(rec)
            yield dataclasses.replace(entry, data=entry.data.toreadonly())
            prev = rec
        if prev is not None:
            self._file_of(prev).release(prev)

    def close(self) -> None:
        """Release the mappings. Tensors already handed out stay valid (they keep their pages)."""
        for f in [self._root, *self._shards]:
            if f is not None:
                f.close()
        self._shards = [None] * len(self._shards)


    def release(self, name: str | None = None) -> None:
        """Drop the pages of tensor ``name`` (of every tensor read so far when None) from this
        process's resident memory. Views handed out stay valid: their pages fault back in from the
        page cache if read again. Random-access readers call it after each tensor to keep memory
        bounded by one tensor, as :meth:`entries` does on its own."""
        if name is not None:
            rec = self._by_name.get(name)
            if rec is not None:
                self._file_of(rec).release(rec)
            return
        for rec in self._records:
            f = self._root if rec.shard is None else self._shards[rec.shard]
            if f is not None:  # a shard never opened has no pages
                f.release(rec)

    # -- lazy access -----------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return [r.name for r in self._records]

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def sharded(self) -> bool:
        return self._root.shards is not None

    @property
    def files(self) -> list[str]:
        """The files this checkpoint consists of (the index first when sharded)."""
        out = [str(self._root.source)]
        if self._root.shards is not None and self.path is not None:
            out += [str(self.path.with_name(s["file"])) for s in self._root.shards]
        return out

    def entry(self, name: str) -> TensorEntry:
        """One tensor with its data (a view of the mapping, checked first when ``verify`` is on)."""
        try:
            rec = self._by_name[name]
        except KeyError:
            raise KeyError(f"{self._root.source}: no tensor named {name!r}") from None
        return self._entry(rec)

    def numpy(self, name: str) -> Any:
        """One tensor as a numpy array viewing the mapping."""
        return self.get_tensor(name, "np")

    def torch(self, name: str) -> Any:
        """One tensor as a torch tensor sharing the mapping (copy-on-write: the file never changes)."""
        return self.get_tensor(name, "pt")

    def get_tensor(self, name: str, framework: str | None = None) -> Any:
        """safetensors' verb: ``framework`` ("pt"/"torch" or "np"/"numpy") defaults to the reader's."""
        try:
            rec = self._by_name[name]
        except KeyError:
            raise KeyError(f"{self._root.source}: no tensor named {name!r}") from None
        return self._tensor(rec, _framework(framework or self.framework))

    def tensors(self, framework: str | None = None) -> Iterator[tuple[str, Any]]:
        """``(name, tensor)`` for every tensor, in file order (what :func:`load_file` collects)."""
        fw = _framework(framework or self.framework)
        for rec in self._records:
            yield rec.name, self._tensor(rec, fw)

    def verify(self, names: Sequence[str] | None = None) -> None:
        """Check every tensor's checksum and that all padding is zero (every file of the set),
        or, given ``names``, just those tensors' checksums (``vcga inspect --verify`` per row).

        :raises VcgaChecksumError: the first damaged tensor or padding byte found.
        :raises KeyError: a name that is not in the checkpoint."""
        if names is not None:
            for name in names:
                if name not in self._by_name:
                    raise KeyError(f"{self._root.source}: no tensor named {name!r}")
                rec = self._by_name[name]
                f = self._file_of(rec)
                self._check(rec, f.view(rec), f)
            return
        for rec in self._records:
            f = self._file_of(rec)
            self._check(rec, f.view(rec), f)
        self._check_padding()

    def read_in_order(self, *, verify: bool = True, into: Mapping[str, memoryview] | None = None,
                      wanted: Collection[str] | None = None) -> Iterator[TensorEntry]:
        """Every tensor in file order, read with ``pread`` -- not through the mapping -- with the
        whole checkpoint verified as :meth:`verify` does: each tensor yielded as soon as its own
        checksum has been checked, the padding of each file checked as the pass reaches it.

        One sequential pass of :data:`READ_CHUNK`-byte reads per file, so that verifying costs
        little beside reading: each read brings a piece of the file from the disk (the kernel
        reading ahead meanwhile) and it is hashed while still in the CPU's cache. Reads rather
        than the mapping: measured on a 128 MiB shard (docs/benchmarks.md), reading straight into
        the destination was faster cold and warm than hashing in the mapping and copying out of
        it (page faults, then a copy).

        :param into: tensor name -> a writable flat byte buffer of exactly that tensor's size
            (a destination tensor's memory): the tensor's bytes are read straight into it, and the
            entry yielded views it. The bytes land before they are checked: when the check
            fails, the buffer holds the damaged bytes, the error is raised and nothing is yielded
            for that tensor.
        :param wanted: the names to yield (default every tensor). Tensors not wanted are still
            read and hashed when ``verify`` is on, in pieces, and skipped unread when it is off.
            A wanted tensor without an ``into`` buffer is read into a buffer of the reader's,
            which the next step of the iteration reuses: copy what you need before asking for
            the next entry.
        ``verify=False`` hashes and checks nothing (what a reader without checksums does: for
        comparisons at equal work). Only a generator run to its end has verified the whole
        checkpoint.

        :raises VcgaChecksumError: the first damaged tensor or padding byte found.
        :raises VcgaFormatError: a file was replaced or truncated after it was opened."""
        into = into or {}
        for rec in self._records:
            target = into.get(rec.name)
            if target is not None and (target.readonly or target.nbytes != rec.nbytes or target.format != "B"
                                       or target.ndim != 1):
                raise ValueError(f"into[{rec.name!r}]: a writable flat byte buffer of {rec.nbytes} bytes is "
                                 "needed")
        files = [(None, self._root)] if self._root.shards is None else [
            (i, self._shard(i)) for i in range(len(self._shards))]
        if verify and self._root.shards is not None:
            self._root.check_padding()  # a shard index holds no tensor data: its own padding only
        for number, f in files:
            recs = [r for r in self._records if r.shard == number]
            with _Pass(f, self) as p:
                pos = PREAMBLE_SIZE
                for rec in recs:
                    want = wanted is None or rec.name in wanted
                    if rec.nbytes:
                        if verify:
                            p.zeros(pos, rec.offset)
                        pos = rec.offset + rec.nbytes
                        if want:
                            data = into.get(rec.name)
                            if data is None:
                                data = p.scratch(rec.nbytes)
                            got = p.read(rec.offset, data, verify)
                        elif verify:
                            got = p.hash(rec.offset, rec.nbytes)
                        else:
                            continue
                    else:
                        data = memoryview(b"")
                        got = xxhash.xxh3_64_intdigest(data)
                    if verify:
                        if got != rec.checksum:
                            raise self._mismatch(rec, got, f)
                        self._verified.add(rec.name)
                    if want:
                        yield rec.entry(data)
                if verify:
                    p.zeros(pos, f.index_offset)

    # -- internals -------------------------------------------------------------------------------

    def _check_padding(self) -> None:
        """That every padding byte of every file of the set is zero."""
        for f in [self._root, *(self._shard(i) for i in range(len(self._shards)))]:
            f.check_padding()

    def _file_of(self, rec: _Record) -> _VbinFile:
        return self._root if rec.shard is None else self._shard(rec.shard)

    def _entry(self, rec: _Record) -> TensorEntry:
        f = self._file_of(rec)
        data = f.view(rec)
        if self.verify_on_access and rec.name not in self._verified:
            self._check(rec, data, f)
        return rec.entry(data)

    def _tensor(self, rec: _Record, framework: str) -> Any:
        """A tensor cut from one shared view of its file (cheaper than a buffer export per tensor)."""
        f = self._file_of(rec)
        if self.verify_on_access and rec.name not in self._verified:
            self._check(rec, f.view(rec), f)
        raw = f.raw(framework)
        if raw is None:  # a read-only buffer: torch gets a copy of this tensor only
            return tensors.to_torch(rec.entry(f.view(rec)))
        return tensors.typed_view(raw, rec.offset, rec.nbytes, rec.dtype, rec.shape)

    def _check(self, rec: _Record, data: memoryview, f: _VbinFile) -> None:
        got = xxhash.xxh3_64_intdigest(data)
        if got != rec.checksum:
            raise self._mismatch(rec, got, f)
        self._verified.add(rec.name)

    @staticmethod
    def _mismatch(rec: _Record, got: int, f: _VbinFile) -> VcgaChecksumError:
        return VcgaChecksumError(f.source, f"tensor {rec.name!r}: checksum mismatch (computed "
                                 f"{tensors.format_checksum(got)}); the file was damaged after it was written",
                                 offset=rec.offset, expected=tensors.format_checksum(rec.checksum))

    def _shard(self, number: int) -> _VbinFile:
        f = self._shards[number]
        if f is not None:
            return f
        assert self.path is not None and self._root.shards is not None
        desc = self._root.shards[number]
        path = self.path.with_name(desc["file"])
        try:
            f = _map_file(path)
        except FileNotFoundError:
            raise VcgaFormatError(self.path, f"shard {number} ({desc['file']}) is missing",
                                  expected=f"{path} beside the index") from None
        try:
            if f.size != desc["size"] or f.file_id.hex() != desc["file_id"]:
                raise VcgaFormatError(path, f"is not the shard the index lists (size {f.size}, file id "
                                      f"{f.file_id.hex()}); it was replaced or belongs to another checkpoint",
                                      expected=f"size {desc['size']}, file id {desc['file_id']}")
            if f.shards is not None or f.shard_info != {"number": number}:
                raise VcgaFormatError(path, f"is not shard {number} of {self.path}",
                                      expected=f'a shard with "shard": {{"number": {number}}}')
            mine = [r for r in self._records if r.shard == number]
            if len(mine) != desc["tensors"] or [r._replace(shard=None) for r in mine] != f.records:
                raise VcgaFormatError(path, f"its tensors differ from what the index {self.path} lists",
                                      expected=f"{desc['tensors']} tensors as listed")
        except BaseException:
            f.close()
            raise
        self._shards[number] = f
        return f


def _framework(framework: str) -> str:
    if framework in ("pt", "torch"):
        return "pt"
    if framework in ("np", "numpy"):
        return "np"
    raise ValueError(f"framework must be 'pt' or 'np', got {framework!r}")
