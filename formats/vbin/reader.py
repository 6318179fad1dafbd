"""vendor-bin (``.vbin``): VCGA's own checkpoint format -- streaming writes, mapped reads, checksums.

Specified in ``docs/vendor-bin.md``; in short::

    [preamble 64 B] [tensor bytes at aligned offsets, zero padding between] [index: JSON] [trailer 64 B]

- A writer appends each tensor as it comes (memory bounded by one tensor) and writes the index and
  the fixed-size trailer last, so a converter streams any checkpoint through in one pass.
- A tensor of at least ``alignment`` bytes (default 4096) starts at a multiple of it -- the page size
  of x86-64 and most aarch64 kernels and the logical block size O_DIRECT needs on 512e and 4Kn
  drives -- so it can be mapped, registered for DMA or read with O_DIRECT on its own; smaller
  tensors start at a multiple of 64 (a cache line, more than any dtype needs) rather than wasting
  a page each.
- Each tensor carries an XXH3-64 checksum; the index and the trailer carry their own, and the
  preamble its own, so any single-bit flip in the file is detected (payload flips when the tensor
  is verified, padding flips by :meth:`VbinReader.verify`, everything else on open).
- A reader maps the file and validates every preamble, trailer and index field against the file
  size before it slices or allocates anything; tensors are views of the mapping (no copy), checked
  on first access when ``verify`` is on.
- Sharding: with ``shard_size`` the writer produces ``<stem>-00000.vbin``, ``<stem>-00001.vbin``, ...
  (each a complete vendor-bin file) and, at the path asked for, an index file listing them.

This module never imports torch: torch tensors are made by :func:`vcga.tensors.to_torch` on demand.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import mmap
import os
import reprlib
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import xxhash

from vcga import dtypes, tensors
from vcga.atomic import AtomicFile, AtomicGroup
from vcga.contract import FormatSpec, TensorEntry, hookimpl
from vcga.errors import VcgaChecksumError, VcgaConversionError, VcgaFormatError
from vcga.formatkit import ReaderContext, WriterContext

__all__ = [
    "FORMAT_NAME",
    "EXTENSION",
    "MAGIC",
    "TRAILER_MAGIC",
    "VERSION",
    "DEFAULT_ALIGNMENT",
    "SMALL_ALIGNMENT",
    "PREAMBLE_SIZE",
    "TRAILER_SIZE",
    "VbinReader",
    "VbinWriter",
    "open_reader",
    "open_writer",
    "sniff",
    "save_file",
    "load_file",
    "save",
    "load",
    "safe_open",
    "shard_name",
    "SPEC",
]

FORMAT_NAME = "vendor-bin"
EXTENSION = ".vbin"
#: PNG-style signature: the high byte catches 7-bit channels, CR LF catches newline translation,
#: ^Z stops a DOS ``type``.
MAGIC = b"\x89VBIN\r\n\x1a"
TRAILER_MAGIC = b"\x89VBINEND"
#: (major, minor). Readers accept every minor of their major; a newer minor may add optional index
#: keys (ignored by older readers) but never changes the meaning of existing bytes.
VERSION = (1, 0)
DEFAULT_ALIGNMENT = 4096
SMALL_ALIGNMENT = 64
MIN_ALIGNMENT, MAX_ALIGNMENT = SMALL_ALIGNMENT, 1 << 30
PREAMBLE_SIZE = 64
TRAILER_SIZE = 64
MAX_NDIM = 64
_MAX_INDEX = (1 << 63) - 1

# magic, major, minor, alignment, file_id, reserved, xxh3 of the 56 bytes before it
_PREAMBLE = struct.Struct("<8sHHI16s24sQ")
# magic, major, minor, flags, index_offset, index_length, index_xxh3, file_id, xxh3 of the 56 bytes before it
_TRAILER = struct.Struct("<8sHHIQQQ16sQ")
assert _PREAMBLE.size == PREAMBLE_SIZE and _TRAILER.size == TRAILER_SIZE
_ZEROS = bytes(1 << 16)
_WRITEBACK_CHUNK = 8 << 20  # start the disk on every 8 MiB written
# Write-and-hash step. Small enough that the hash reads the piece from cache right after the copy
# (a server core's L2 is 1-2 MiB, its L3 far more), large enough that the page cache keeps large
# folios: reading a file back through a mapping faulted 45% longer after 256 KiB writes than after
# 2 MiB ones (measured here, Linux 6.18 / ext4).
_HASH_PIECE = 2 << 20


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, do not wait


@functools.cache
def _sync_file_range() -> Any:
    """libc's sync_file_range, or None off Linux (loaded on first use: ctypes is not cheap to import)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _start_writeback_of(fd: int, offset: int, length: int) -> None:
    """Start writing a range of the file to disk without waiting (a hint: failures are ignored).

    Linux's sync_file_range(SYNC_FILE_RANGE_WRITE) does exactly that (os has no binding, so
    ctypes; it releases the GIL). Elsewhere POSIX_FADV_DONTNEED starts writeback as a side effect;
    without either, the commit's fsync simply does all the work."""
    sync_file_range = _sync_file_range()
    if sync_file_range is not None:
        sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
    elif hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


_ENTRY_KEYS = {"name", "dtype", "shape", "offset", "nbytes", "checksum"}
_ENTRY_OPTIONAL = {"metadata", "shard"}
_DOC_KEYS = {"format", "version", "file_id", "alignment", "metadata", "tensors"}
_DOC_OPTIONAL = {"shard", "shards"}


def shard_name(path: str | os.PathLike[str], number: int) -> str:
    """The file name of shard ``number`` of the checkpoint whose index is ``path``."""
    base = Path(path).name
    stem = base[: -len(EXTENSION)] if base.endswith(EXTENSION) and len(base) > len(EXTENSION) else base
    return f"{stem}-{number:05d}{EXTENSION}"


def _required_alignment(nbytes: int, alignment: int) -> int:
    return alignment if nbytes >= alignment else SMALL_ALIGNMENT


def _roundup(n: int, a: int) -> int:
    return -(-n // a) * a


# ===================================================================================================
# Writing
# ===================================================================================================


class _Record(NamedTuple):
    """One tensor of the index, as written and as validated on read."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int
    metadata: Mapping[str, str]
    shard: int | None = None

    def to_json(self, with_shard: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                             "offset": self.offset, "nbytes": self.nbytes,
                             "checksum": tensors.format_checksum(self.checksum)}
        if self.metadata:
            d["metadata"] = dict(self.metadata)
        if with_shard:
            d["shard"] = self.shard
        return d

    def entry(self, data: Any) -> TensorEntry:
        return TensorEntry(self.name, self.dtype, self.shape, data, self.metadata,
                           tensors.format_checksum(self.checksum))


def _dump_index(doc: Mapping[str, Any]) -> bytes:
    # ensure_ascii keeps the index pure ASCII, so a bad byte anywhere is a clean decode error.
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def _preamble(alignment: int, file_id: bytes) -> bytes:
    head = _PREAMBLE.pack(MAGIC, VERSION[0], VERSION[1], alignment, file_id, bytes(24), 0)[:56]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def _trailer(index_offset: int, index: bytes, file_id: bytes) -> bytes:
    head = _TRAILER.pack(TRAILER_MAGIC, VERSION[0], VERSION[1], 0, index_offset, len(index),
                         xxhash.xxh3_64_intdigest(index), file_id, 0)[:56]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


class _FileWriter:
    """Writes one vendor-bin file to a binary stream, one tensor at a time."""

    def __init__(self, out: IO[bytes], alignment: int, where: Any) -> None:
        self.out = out
        self.alignment = alignment
        self.where = where
        self.file_id = os.urandom(16)
        self.records: list[_Record] = []
        self.pos = 0
        self._flushed = 0  # bytes already handed to the kernel's writeback
        try:
            self._fd: int | None = (out.fileno() if _sync_file_range() is not None or hasattr(os, "posix_fadvise")
                                    else None)
        except (OSError, AttributeError, io.UnsupportedOperation):
            self._fd = None  # an in-memory stream
        self._write(_preamble(alignment, self.file_id))

    def _write(self, data: Any) -> None:
        n = self.out.write(data)
        size = memoryview(data).nbytes
        if n is not None and n != size:  # raw streams may write short; buffered ones never do
            raise OSError(f"{self.where}: short write ({n} of {size} bytes)")
        self.pos += size

    def _pad_to(self, offset: int) -> None:
        while self.pos < offset:
            self._write(_ZEROS[: min(len(_ZEROS), offset - self.pos)])

    def put(self, data: memoryview, hasher: Any = None) -> int:
        """Write one tensor's bytes at its aligned offset; returns the offset (0 for no bytes).

        With ``hasher`` (an ``xxhash.xxh3_64``), the bytes are written and hashed in 2 MiB pieces:
        each piece is hashed right after the copy brought it into the CPU cache, which costs about
        half of a second pass over the whole tensor."""
        nbytes = data.nbytes
        if not nbytes:
            return 0  # empty tensors occupy no bytes and have no place in the file
        offset = _roundup(self.pos, _required_alignment(nbytes, self.alignment))
        self._pad_to(offset)
        if hasher is None:
            self._write(data)
        else:
            for start in range(0, nbytes, _HASH_PIECE):
                piece = data[start:start + _HASH_PIECE]
                self._write(piece)
                hasher.update(piece)
        self._start_writeback()
        return offset

    def record(self, entry: TensorEntry, offset: int, nbytes: int, digest: int, shard: int | None) -> _Record:
        rec = _Record(entry.name, entry.dtype, tuple(entry.shape), offset, nbytes, digest,
                      dict(entry.metadata), shard)
        self.records.append(rec)
        return rec

    def add(self, entry: TensorEntry, data: memoryview, digest: int, shard: int | None) -> _Record:
        return self.record(entry, self.put(data), data.nbytes, digest, shard)

    def _start_writeback(self) -> None:
        """Ask the kernel to start writing what we wrote so far, without waiting.

        The commit's fsync then waits only for the tail instead of the whole file, so the disk
        works while we copy the next tensors."""
        if self._fd is None or self.pos - self._flushed < _WRITEBACK_CHUNK:
            return
        self.out.flush()
        _start_writeback_of(self._fd, self._flushed, self.pos - self._flushed)
        self._flushed = self.pos

    def finish(self, metadata: Mapping[str, str], extra: Mapping[str, Any] | None = None,
               records: Sequence[_Record] | None = None, with_shard: bool = False) -> int:
        """Write the index and the trailer; returns the file size."""
        doc: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": list(VERSION),
            "file_id": self.file_id.hex(),
            "alignment": self.alignment,
            "metadata": dict(metadata),
            "tensors": [r.to_json(with_shard) for r in (self.records if records is None else records)],
        }
        if extra:
            doc.update(extra)
        index = _dump_index(doc)
        index_offset = self.pos
        self._write(index)
        self._write(_trailer(index_offset, index, self.file_id))
        return self.pos


def _check_metadata(metadata: Any, where: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise VcgaConversionError(f"{where}: file metadata must map strings to strings", target=FORMAT_NAME)
    for s in (*metadata.keys(), *metadata.values()):
        _check_text(s, where, "metadata")
    return dict(metadata)


def _check_text(s: str, where: Any, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise VcgaConversionError(f"{where}: {what} {s!r} is not valid Unicode (lone surrogate)",
                                  target=FORMAT_NAME) from None


def _check_alignment(alignment: Any) -> int:
    if (type(alignment) is not int or alignment < MIN_ALIGNMENT or alignment > MAX_ALIGNMENT
            or alignment & (alignment - 1)):
        raise ValueError(f"alignment must be a power of two between {MIN_ALIGNMENT} and {MAX_ALIGNMENT}, "
                         f"got {alignment!r}")
    return alignment


class VbinWriter(WriterContext):
    """Writes a vendor-bin checkpoint atomically, one tensor at a time (a :class:`~vcga.contract.FormatWriter`).

    Nothing appears at ``path`` until :meth:`commit`; as a context manager it commits on success
    and removes every temporary on error. Memory stays bounded by the tensor being written: tensor
    bytes go straight from the caller's buffer to the file.

    :param path: the destination (the index file when sharding).
    :param metadata: file-level metadata, string to string (also settable until commit).
    :param shard_size: when set, start a new shard file before a tensor that would take the current
        shard's tensor bytes beyond this many bytes (a larger tensor gets a shard of its own).
    :param alignment: power of two, 64 B to 1 GiB (default 4096): tensors of at least this size
        start at a multiple of it.
    :param overwrite: when False, refuse to replace existing files.
    """

    def __init__(self, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None,
                 shard_size: int | None = None, alignment: int = DEFAULT_ALIGNMENT,
                 overwrite: bool = True) -> None:
        self.path = Path(path)
        self.alignment = _check_alignment(alignment)
        if shard_size is not None and (type(shard_size) is not int or shard_size <= 0):
            raise ValueError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
        self.shard_size = shard_size
        self.overwrite = overwrite
        if not overwrite and self.path.exists():  # fail before writing gigabytes, not at the rename
            raise FileExistsError(f"{self.path} exists; refusing to overwrite")
        self._metadata = _check_metadata(metadata, self.path)
        self._names: set[str] = set()
        self._group = AtomicGroup()
        self._done = False
        self._shard_records: list[_Record] = []
        self._shards: list[dict[str, Any]] = []
        self._current: _FileWriter | None = None
        self._current_payload = 0
        if shard_size is None:
            self._current = _FileWriter(self._group.open(self.path, overwrite=overwrite).file,
                                        self.alignment, self.path)

    # -- FormatWriter ----------------------------------------------------------------------------

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        """Replace the file-level metadata (string to string); allowed until :meth:`commit`."""
        self._metadata = _check_metadata(metadata, self.path)

    def write(self, entry: TensorEntry) -> None:
        """Append one tensor entry. Its data is written straight from its buffer and hashed.

        A bad entry (duplicate name, wrong length, ...) is refused before anything is written and
        the writer stays usable. If writing fails, or the entry carries a checksum its bytes do not
        match (:class:`~vcga.errors.VcgaChecksumError`: the source is damaged), the writer aborts."""
        if self._done:
            raise ValueError(f"{self.path}: writer already committed or aborted")
        if not isinstance(entry.name, str):
            raise VcgaConversionError(f"{self.path}: tensor names must be strings, got {entry.name!r}",
                                      target=FORMAT_NAME)
        _check_text(entry.name, self.path, "tensor name")
        if entry.name in self._names:
            raise VcgaConversionError(f"{self.path}: duplicate tensor name {entry.name!r}",
                                      tensor=entry.name, target=FORMAT_NAME)
        if len(entry.shape) > MAX_NDIM:
            raise VcgaConversionError(f"{self.path}: tensor {entry.name!r} has {len(entry.shape)} dims "
                                      f"(at most {MAX_NDIM})", tensor=entry.name, target=FORMAT_NAME)
        _check_metadata(entry.metadata, f"{self.path}: tensor {entry.name!r}")
        data = tensors.check_entry(entry, self.path)
        # The checksum is computed piece by piece as the bytes are written (see _FileWriter.put).
        # A helper thread hashing while this one writes gained nothing on the 2-core machine this
        # was measured on (memory bandwidth, not the CPU, is the limit), so there is none.
        hasher = xxhash.xxh3_64()
        try:
            writer = self._writer_for(data.nbytes)
            offset = writer.put(data, hasher)
        except BaseException:
            # A failed write (disk full, interrupted) leaves a partial tensor in the file: the
            # checkpoint cannot be completed, so remove the temporaries now.
            self.abort()
            raise
        digest = hasher.intdigest()
        if entry.checksum is not None and tensors.format_checksum(digest) != entry.checksum:
            self.abort()  # the bytes are in the file already: this checkpoint cannot be finished
            raise VcgaChecksumError(self.path, f"tensor {entry.name!r} does not match the checksum its source "
                                    f"stored (computed {tensors.format_checksum(digest)}); the source is damaged. "
                                    "Nothing was written to the destination.", expected=entry.checksum)
        rec = writer.record(entry, offset, data.nbytes, digest,
                            len(self._shards) if self.shard_size is not None else None)
        self._names.add(entry.name)
        if self.shard_size is not None:
            self._shard_records.append(rec)
            self._current_payload += data.nbytes

    def add(self, name: str, tensor: Any, metadata: Mapping[str, str] | None = None) -> None:
        """Append a torch tensor or numpy array (zero-copy for contiguous host memory)."""
        self.write(tensors.from_any(name, tensor, metadata))

    def commit(self) -> None:
        """Write the index(es) and trailers, fsync, and rename everything into place."""
        if self._done:
            raise ValueError(f"{self.path}: writer already committed or aborted")
        try:
            if self.shard_size is None:
                assert self._current is not None
                self._current.finish(self._metadata)
            else:
                self._close_shard()
                index = _FileWriter(self._group.open(self.path, overwrite=self.overwrite).file,
                                    self.alignment, self.path)
                index.finish(self._metadata, {"shards": self._shards}, self._shard_records, with_shard=True)
            self._group.commit()
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Remove every temporary; nothing at the destination changes."""
        self._group.abort()
        self._done = True

    @property
    def finished(self) -> bool:
        return self._done

    # -- sharding --------------------------------------------------------------------------------

    def _writer_for(self, nbytes: int) -> _FileWriter:
        if self.shard_size is None:
            assert self._current is not None
            return self._current
        if self._current is not None and self._current_payload and self._current_payload + nbytes > self.shard_size:
            self._close_shard()
        if self._current is None:
            name = shard_name(self.path, len(self._shards))
            self._current = _FileWriter(self._group.open(self.path.with_name(name), overwrite=self.overwrite).file,
                                        self.alignment, self.path.with_name(name))
            self._current_payload = 0
        return self._current

    def _close_shard(self) -> None:
        w = self._current
        if w is None:
            return
        number = len(self._shards)
        size = w.finish({}, {"shard": {"number": number}})
        self._shards.append({"file": shard_name(self.path, number), "file_id": w.file_id.hex(), "size": size,
                             "tensors": len(w.records)})
        self._current = None


# ===================================================================================================
# Reading
# ===================================================================================================


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
                raise self._err(f"{what}: unknown dtype {_short(dtype)}", at, f"one of {', '.join(dtypes.ALL)}")
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

    def advise(self, advice: int) -> None:
        if self._mm is not None:
            try:
                self._mm.madvise(advice)
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
        size = os.fstat(f.fileno()).st_size
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
    return _VbinFile(path, mm, len(mm), mm)  # closes the mapping itself if the file is bad


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
        for f in [self._root, *(self._shard(i) for i in range(len(self._shards)))]:
            f.check_padding()

    # -- internals -------------------------------------------------------------------------------

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
            raise VcgaChecksumError(f.source, f"tensor {rec.name!r}: checksum mismatch (computed "
                                    f"{tensors.format_checksum(got)}); the file was damaged after it was written",
                                    offset=rec.offset, expected=tensors.format_checksum(rec.checksum))
        self._verified.add(rec.name)

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


# ===================================================================================================
# The plugin and the convenience API
# ===================================================================================================


def sniff(path: Any) -> bool:
    """True when ``path`` starts with the vendor-bin signature. Reads 8 bytes; never raises."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except (OSError, TypeError, ValueError):
        return False


def open_reader(path: str | os.PathLike[str], *, verify: bool = True, **_options: Any) -> VbinReader:
    """``FormatSpec.open_reader``: a :class:`VbinReader` (unknown options are ignored)."""
    return VbinReader(path, verify=verify)


def open_writer(path: str | os.PathLike[str], *, shard_size: int | None = None,
                alignment: int = DEFAULT_ALIGNMENT, metadata: Mapping[str, str] | None = None,
                overwrite: bool = True, **_options: Any) -> VbinWriter:
    """``FormatSpec.open_writer``: a :class:`VbinWriter` (unknown options are ignored)."""
    return VbinWriter(path, shard_size=shard_size, alignment=alignment, metadata=metadata, overwrite=overwrite)


def save_file(tensors_: Mapping[str, Any], filename: str | os.PathLike[str],
              metadata: Mapping[str, str] | None = None, *, shard_size: int | None = None,
              alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Save a dict of torch tensors and/or numpy arrays (safetensors' verb). Atomic: the file
    appears complete or not at all. Non-contiguous tensors are packed; nothing else is copied."""
    with VbinWriter(filename, metadata=metadata, shard_size=shard_size, alignment=alignment) as w:
        for name, t in tensors_.items():
            w.add(name, t)


def load_file(filename: str | os.PathLike[str], framework: str = "pt", *, verify: bool = True) -> dict[str, Any]:
    """Load every tensor (safetensors' verb): torch tensors (``"pt"``) or numpy arrays (``"np"``)
    sharing the file's mapping, each checksum checked unless ``verify=False``."""
    with VbinReader(filename, verify=verify) as r:
        for f in [r._root, *(r._shard(i) for i in range(len(r._shards)))]:
            f.advise(mmap.MADV_WILLNEED)  # everything will be read: start the readahead now
        return dict(r.tensors(framework))


def save(tensors_: Mapping[str, Any], metadata: Mapping[str, str] | None = None, *,
         alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """The bytes of a vendor-bin file holding ``tensors_`` (in memory; no sharding)."""
    _check_alignment(alignment)
    out = io.BytesIO()
    w = _FileWriter(out, alignment, "<bytes>")
    names: set[str] = set()
    for name, t in tensors_.items():
        entry = tensors.from_any(name, t)
        if name in names:  # pragma: no cover - dict keys are unique
            raise VcgaConversionError(f"duplicate tensor name {name!r}", tensor=name, target=FORMAT_NAME)
        names.add(name)
        data = tensors.check_entry(entry)
        w.add(entry, data, xxhash.xxh3_64_intdigest(data), None)
    w.finish(_check_metadata(metadata, "<bytes>"))
    return out.getvalue()


def load(data: bytes | bytearray | memoryview, framework: str = "np", *, verify: bool = True) -> dict[str, Any]:
    """Load every tensor from the bytes of a vendor-bin file (views of ``data``)."""
    with VbinReader(data, verify=verify) as r:
        return dict(r.tensors(framework))


def safe_open(filename: str | os.PathLike[str], framework: str = "pt", *, verify: bool = True) -> VbinReader:
    """safetensors' ``safe_open``: a lazy reader; ``get_tensor(name)`` returns ``framework`` tensors."""
    return VbinReader(filename, verify=verify, framework=framework)


SPEC = FormatSpec(
    name=FORMAT_NAME,
    extensions=(EXTENSION,),
    dtypes=frozenset(dtypes.ALL),
    sniff=sniff,
    open_reader=open_reader,
    open_writer=open_writer,
    description="VCGA vendor-bin: aligned tensors, per-tensor xxh3, streaming writes, zero-copy mapped reads",
)


@hookimpl
def vcga_formats() -> list[FormatSpec]:
    return [SPEC]
