"""Writing vendor-bin: :class:`VbinWriter`, streaming, sharded, atomic (summary in :mod:`vcga.formats.vbin`)."""

from __future__ import annotations

import functools
import io
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import xxhash

from vcga import tensors
from vcga.contract import TensorEntry
from vcga.errors import VcgaChecksumError, VcgaConversionError
from vcga.formatkit import WriterContext

from ._format import (
    _PREAMBLE,
    _TRAILER,
    DEFAULT_ALIGNMENT,
    FORMAT_NAME,
    MAGIC,
    MAX_NDIM,
    TRAILER_MAGIC,
    VERSION,
    _check_alignment,
    _check_metadata,
    _check_text,
    _Record,
    _required_alignment,
    _roundup,
    shard_name,
)

_ZEROS = bytes(1 << 16)
_WRITEBACK_CHUNK = 8 << 20  # start the disk on every 8 MiB written
# Write-and-hash step. Small enough that the hash reads the piece from cache right after the copy
# (a server core's L2 is 1-2 MiB, its L3 far more), large enough that the page cache keeps large
# folios: reading a file back through a mapping faults longer after smaller writes
# (docs/vendor-bin.md, "Piece sizes and access patterns").
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
    :param publish_into: name the outputs in this folder at commit (see :class:`~vcga.formatkit.WriterContext`).
    """

    def __init__(self, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None,
                 shard_size: int | None = None, alignment: int = DEFAULT_ALIGNMENT,
                 overwrite: bool = True, publish_into: str | os.PathLike[str] | None = None) -> None:
        self._init_outputs(publish_into)
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
        self._shard_records: list[_Record] = []
        self._shards: list[dict[str, Any]] = []
        self._current: _FileWriter | None = None
        self._current_payload = 0
        if shard_size is None:
            self._current = _FileWriter(self._open_output(self.path, overwrite=overwrite).file,
                                        self.alignment, self.path)

    # -- FormatWriter ----------------------------------------------------------------------------

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        """Replace the file-level metadata (string to string); allowed until :meth:`commit`."""
        self._check_open()
        self._metadata = _check_metadata(metadata, self.path)

    def write(self, entry: TensorEntry) -> None:
        """Append one tensor entry. Its data is written straight from its buffer and hashed.

        A bad entry (duplicate name, wrong length, ...) is refused before anything is written and
        the writer stays usable. If writing fails, or the entry carries a checksum its bytes do not
        match (:class:`~vcga.errors.VcgaChecksumError`: the source is damaged), the writer aborts."""
        self._check_open()
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
        data = tensors.check_entry(entry, target=FORMAT_NAME)
        # The checksum is computed piece by piece as the bytes are written (see _FileWriter.put).
        # A helper thread hashing while this one writes gained nothing where it was measured
        # (memory bandwidth, not the CPU, is the limit; docs/vendor-bin.md, "Piece sizes and access
        # patterns"), so there is none.
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

    def _finish(self) -> None:
        """Write the index(es) and trailers (commit then fsyncs and names everything)."""
        if self.shard_size is None:
            assert self._current is not None
            self._current.finish(self._metadata)
        else:
            self._close_shard()
            index = _FileWriter(self._open_output(self.path, overwrite=self.overwrite).file,
                                self.alignment, self.path)
            index.finish(self._metadata, {"shards": self._shards}, self._shard_records, with_shard=True)

    # -- sharding --------------------------------------------------------------------------------

    def _writer_for(self, nbytes: int) -> _FileWriter:
        if self.shard_size is None:
            assert self._current is not None
            return self._current
        if self._current is not None and self._current_payload and self._current_payload + nbytes > self.shard_size:
            self._close_shard()
        if self._current is None:
            name = shard_name(self.path, len(self._shards))
            self._current = _FileWriter(self._open_output(self.path.with_name(name), overwrite=self.overwrite).file,
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
