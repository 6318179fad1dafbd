"""Reading vendor-bin: :class:`VbinReader`, mapped, validated before use (summary in :mod:`vcga.formats.vbin`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from vcga import tensors
from vcga.contract import TensorEntry
from vcga.errors import VcgaChecksumError, VcgaFormatError
from vcga.formatkit import ReaderContext, named_file, open_regular

from ._file import _map_file, _VbinFile, check_zero_padding
from ._format import PREAMBLE_SIZE, _Record

# Bytes per read of read_in_order: each piece is hashed right after its read, while it is still
# in the CPU's cache. Measured on a 128 MiB shard (docs/vendor-bin.md, "Piece sizes and access
# patterns"): warm 3.1 GB/s with 1 MiB against 2.8 with 8 MiB; cold every size reads at the disk's pace.
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
            self.fd = open_regular(f.source)
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
            check_zero_padding(self.f.source, at, piece)


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
        than the mapping: measured on a 128 MiB shard (docs/vendor-bin.md, "Piece sizes and access
        patterns"), reading straight into
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
        path = named_file(self.path.parent, desc["file"], source=self.path, what=f"shard {number}")
        if not path.exists():
            raise VcgaFormatError(self.path, f"shard {number} ({desc['file']}) is missing",
                                  expected=f"{path} beside the index")
        f = _map_file(path)
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
